"""CLIP's contrastive loss with OpenCLIP's `ClipLoss` semantics, on torch alone (the package's collectives).

Logits are s·I·Tᵀ at the model's logit scale s; the loss is the mean of the image→text and text→image
cross-entropies with the positives as labels. With several ranks, as OpenCLIP's flags say:

- `local_loss`: the rows are this rank's samples against the global batch's columns (labels offset by the
  rank); otherwise every rank computes the whole global B×B matrix.
- `gather_with_grad`: the global batch is gathered with gradient (the backward sums every rank's gradient into
  each rank's slice); otherwise it is gathered without, and with the whole matrix this rank's own slice is put back
  so that its rows carry gradient.

Plain `--loss clip` in a training run is OpenCLIP's own ClipLoss; this module serves the losses built on CLIP's
(MobileCLIP's distillation, JEST) and `create_loss('clip')`, which a training loop of one's own calls as it calls the
other losses: with the batch's extras (sample index, reference features, which CLIP's loss does not read), an
`accum_step`, and `metrics()`.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .base import LastCallMetrics, check_eval_call, fixed_within_window
from .collectives import gather_batch


class ClipLoss(LastCallMetrics, nn.Module):

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.rank = rank
        self.world_size = world_size
        self._last = {}  # CLIP's loss has no diagnostics beyond its value; the losses built on it add theirs

    def _gather(self, features: torch.Tensor) -> torch.Tensor:
        gathered = gather_batch(features, self.world_size, with_grad=self.gather_with_grad, device=features.device)
        if self.gather_with_grad or self.local_loss or self.world_size == 1:
            return gathered
        rows = features.shape[0]  # the whole matrix from constants: this rank's slice with its gradient
        return torch.cat([gathered[:self.rank * rows], features, gathered[(self.rank + 1) * rows:]])

    def logits(self, image_features, text_features, logit_scale):
        """(image→text logits, text→image logits) as OpenCLIP's `ClipLoss.get_logits` computes them."""
        if self.world_size == 1:
            return logit_scale * image_features @ text_features.T, logit_scale * text_features @ image_features.T
        all_image, all_text = self._gather(image_features), self._gather(text_features)
        if self.local_loss:
            return logit_scale * image_features @ all_text.T, logit_scale * text_features @ all_image.T
        logits_per_image = logit_scale * all_image @ all_text.T
        return logits_per_image, logits_per_image.T

    def contrastive(self, logits_per_image: torch.Tensor, logits_per_text: torch.Tensor) -> torch.Tensor:
        """The mean of both directions' cross-entropies, the positives being the labels."""
        labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
        if self.world_size > 1 and self.local_loss:
            labels = labels + logits_per_image.shape[0] * self.rank
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2

    def forward(self, image_features, text_features, logit_scale, output_dict=False, *, accum_step=None, **_):
        check_eval_call(self, accum_step)
        logit_scale = fixed_within_window(logit_scale, accum_step)
        loss = self.contrastive(*self.logits(image_features, text_features, logit_scale))
        return {'contrastive_loss': loss} if output_dict else loss
