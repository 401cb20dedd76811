"""The knowledge-distillation term of MobileCLIP (Vasu et al., 2024), as used by DRRho-CLIP (seed 001, Eq. 16).

KD = ½ [ mean_i CE(softmax(t·s^ref_i·), log_softmax(s·s_i·)) + the same over texts as anchors ], the teacher being
the reference model at its own logit scale t (the official code's default 100).

Normalisation: Eq. 16 prints 1/|B|² in front of each direction's double sum and adds the two directions. Its λ
values come from the official code, which (like MobileCLIP's and OpenCLIP's DistillClipLoss) averages over the
anchors (1/|B|) and over the two directions (½), so KD is on the scale of CLIP's loss in Eq. 12; we do the same.

Pure torch: anchors are this rank's rows, candidates the global batch, as in the DRO core.
"""
import torch


def soft_cross_entropy(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean over rows of −Σ_j softmax(teacher)_ij · log softmax(student)_ij."""
    return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean()


def distillation_loss(anchors, candidates, ref_anchors, ref_candidates, logit_scale, teacher_logit_scale):
    """KD of the local (image, text) anchors against the global (image, text) candidates, given as pairs; the
    reference pairs likewise. `logit_scale` is the student's (gradient flows to it), `teacher_logit_scale` a number."""
    (image, text), (all_image, all_text) = anchors, candidates
    (ref_image, ref_text), (all_ref_image, all_ref_text) = ref_anchors, ref_candidates
    t, s = teacher_logit_scale, logit_scale
    image_to_text = soft_cross_entropy(t * ref_image @ all_ref_text.T, s * image @ all_text.T)
    text_to_image = soft_cross_entropy(t * ref_text @ all_ref_image.T, s * text @ all_image.T)
    return (image_to_text + text_to_image) / 2
