"""MobileCLIP's loss (Vasu et al., 2024; seed 001 Eq. 12): (1 − λ) · CLIP + λ · KD, with the reference model as the
teacher. As OpenCLIP's `DistillClipLoss`: KD (`distill.soft_cross_entropy`) of the student's CLIP logits against
the teacher's at its logit scale (given, or calibrated on the first batch: `distill.ReferenceLogitScale`), over the
same rows and columns, averaged over both directions."""
from .base import ReferenceFeatures, check_eval_call, fixed_within_window
from .clip import ClipLoss
from .distill import ReferenceLogitScale, soft_cross_entropy


class MobileClipLoss(ReferenceFeatures, ClipLoss):

    def __init__(self, distill_weight: float, teacher_logit_scale='auto', **clip_options):
        super().__init__(**clip_options)
        if not 0 < distill_weight <= 1:
            raise ValueError(f"distill_weight λ must be in (0, 1], got {distill_weight}")
        self.distill_weight = distill_weight
        self.teacher_logit_scale = ReferenceLogitScale(teacher_logit_scale, self.world_size)

    def forward(self, image_features, text_features, logit_scale, ref_image_features=None, ref_text_features=None,
                accum_step=None, output_dict=False, **_):
        self.require_reference(ref_image_features, ref_text_features, "distills from the reference (teacher) model")
        check_eval_call(self, accum_step)
        logit_scale = fixed_within_window(logit_scale, accum_step)
        logits_per_image, logits_per_text = self.logits(image_features, text_features, logit_scale)
        teacher_scale = self.teacher_logit_scale(ref_image_features, ref_text_features)
        teacher_per_image, teacher_per_text = self.logits(ref_image_features, ref_text_features,
                                                          teacher_scale.to(ref_image_features.dtype))
        contrastive = self.contrastive(logits_per_image, logits_per_text)
        distill = (soft_cross_entropy(teacher_per_image, logits_per_image)
                   + soft_cross_entropy(teacher_per_text, logits_per_text)) / 2
        if self.training:
            self._last = {'contrastive': contrastive.detach(), 'distill': distill.detach(),
                          'teacher_logit_scale': teacher_scale}
        losses = {'contrastive_loss': (1 - self.distill_weight) * contrastive,
                  'distill_loss': self.distill_weight * distill}
        return losses if output_dict else sum(losses.values())
