"""MobileCLIP's loss (Vasu et al., 2024; seed 001 Eq. 12): (1 − λ) · CLIP + λ · KD, over OpenCLIP's own
DistillClipLoss (whose KD term is `distill.soft_cross_entropy`'s), with the reference model as the teacher.

Imported only when such a loss is built: importing open_clip must wait for the plugin's import hook.
"""
from open_clip.loss import DistillClipLoss

from .core import ReferenceFeatures


class MobileClipLoss(ReferenceFeatures, DistillClipLoss):

    def __init__(self, distill_weight: float, teacher_logit_scale: float = 100.0, **clip_options):
        super().__init__(**clip_options)
        if not 0 < distill_weight <= 1:
            raise ValueError(f"the distillation weight λ must be in (0, 1], got {distill_weight}")
        self.distill_weight = distill_weight
        self.teacher_logit_scale = teacher_logit_scale
        self._last = {}

    def forward(self, image_features, text_features, logit_scale, ref_image_features=None, ref_text_features=None,
                output_dict=False, **_):
        if ref_image_features is None or ref_text_features is None:
            raise ValueError("distillation needs the reference (teacher) features: pass --ref-features DIR or "
                             "--ref-model")
        contrastive, distill = super().forward(image_features, text_features, logit_scale, ref_image_features,
                                               ref_text_features, self.teacher_logit_scale)
        self._last = {'contrastive': contrastive.detach(), 'distill': distill.detach()}
        losses = {'contrastive_loss': (1 - self.distill_weight) * contrastive,
                  'distill_loss': self.distill_weight * distill}
        return losses if output_dict else sum(losses.values())

    def metrics(self) -> dict:
        """The unweighted terms of the last call."""
        return {k: v.item() for k, v in self._last.items()}
