"""The k-step balanced CLIP loss (Liu, Mehta, Pal, Harchaoui, NeurIPS 2024; balancing.md §1.4, §4).

CLIP's loss is one Sinkhorn half-step (a KL projection onto a uniform marginal) of the batch's model coupling
exp(Λ), Λ = S/τ, in each of two orders, read at the positives. k half-steps alternate rows and columns:

    P-branch: A_0 = Λ,  A_t = log_softmax(A_{t−1}) over the texts (t odd) or over the images (t even)
    Q-branch: the same starting with the images
    L^(k) = −(1/N) Σ_i ½ (A_k[i,i] + B_k[i,i])

k = 1 is CLIP's loss exactly; k = 2 is the paper's "doubly centered" loss. Gradients flow through every step.
With reference features, Λ = (S − S^ref)/τ: balancing of the RHO-shifted logits (DRRho-CLIP's ℓ̂ up to terms
constant along the rows).

Distributed: rows are this rank's anchors, columns the global batch (gathered with gradient); a column step's
log-sum-exp over all ranks' rows is gathered with gradient too, so value and gradients equal the global loss.
"""
import torch
from torch import nn

from .base import LastCallMetrics, ReferenceFeatures, check_eval_call, keep_in_graph
from .collectives import gather_batch
from .precision import autocast_disabled, pairwise_dtype, product, similarities


def column_logsumexp(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """log Σ over the rows of every rank, per column: [1, N]."""
    rows = x.logsumexp(dim=0, keepdim=True)
    return gather_batch(rows, world_size, with_grad=True, device=x.device).logsumexp(dim=0, keepdim=True)


def balanced_at_positives(logits: torch.Tensor, steps: int, world_size: int, positives):
    """(A_k at the positives [b], the first half-step's row normaliser [b]) of this rank's [b, N] rows, the rows
    normalised first. k − 1 half-steps are taken over the whole matrix; the loss reads A_k only at the positives, so
    the last one is its normaliser there (a reduction, no k-th b×N matrix kept for backward)."""
    rows, columns = positives
    for step in range(steps):
        if step % 2 == 0:
            normaliser = logits.logsumexp(dim=1, keepdim=True)
            if step == 0:
                first = normaliser[:, 0]
        else:
            normaliser = column_logsumexp(logits, world_size)
        if step == steps - 1:
            at_positives = normaliser[rows, 0] if step % 2 == 0 else normaliser[0, columns]
            return logits[positives] - at_positives, first
        logits = logits - normaliser


class BalancedClipLoss(ReferenceFeatures, LastCallMetrics, nn.Module):

    def __init__(self, temperature: nn.Module, steps: int = 2, use_reference: bool = False, rank: int = 0,
                 world_size: int = 1):
        super().__init__()
        if steps < 1:
            raise ValueError(f"the balanced loss needs at least one balancing step (1 = CLIP), got {steps}")
        self.temperature = temperature
        self.steps = steps
        self.use_reference = use_reference
        self.rank = rank
        self.world_size = world_size
        self._last = {}

    def forward(self, image_features, text_features, logit_scale=None, ref_image_features=None,
                ref_text_features=None, accum_step=None, output_dict=False, **_):
        if self.use_reference:
            self.require_reference(ref_image_features, ref_text_features, "shifts by the reference model")
        check_eval_call(self, accum_step)
        device = image_features.device
        with autocast_disabled(device):
            # 16-bit features stay 16-bit for the products (float32 accumulation); the balancing runs in float32
            dtype = pairwise_dtype(image_features, text_features)
            image, text = image_features.to(dtype), text_features.to(dtype)
            all_image = gather_batch(image, self.world_size, with_grad=True, device=device)
            all_text = gather_batch(text, self.world_size, with_grad=True, device=device)
            # one process holds the whole batch: the text rows' logits are the image rows' transposed
            whole_batch = self.world_size == 1
            sim_image = similarities(image, all_text)
            sim_text = None if whole_batch else similarities(text, all_image)
            tau = self.temperature(logit_scale=logit_scale)[0].to(sim_image.dtype)
            if accum_step:  # a later call on the same window: τ's gradient came whole with the first call
                tau = keep_in_graph(tau.detach(), tau)
            if self.use_reference:
                ref_image, ref_text = ref_image_features.to(dtype), ref_text_features.to(dtype)
                all_ref_text = gather_batch(ref_text, self.world_size, with_grad=False, device=device)
                sim_image = sim_image - product(ref_image, all_ref_text.T)
                if not whole_batch:
                    all_ref_image = gather_batch(ref_image, self.world_size, with_grad=False, device=device)
                    sim_text = sim_text - product(ref_text, all_ref_image.T)
            logits_image = sim_image / tau
            logits_text = logits_image.T if whole_batch else sim_text / tau
            rows = torch.arange(logits_image.shape[0], device=logits_image.device)
            positives = (rows, rows + self.rank * logits_image.shape[0])
            p, lse_image = balanced_at_positives(logits_image, self.steps, self.world_size, positives)
            q, lse_text = balanced_at_positives(logits_text, self.steps, self.world_size, positives)
            loss = -(p + q).mean() / 2
            if self.training:  # for metrics()
                with torch.no_grad():  # CLIP's loss (k = 1) alongside: k ≥ 2 collapsing towards 0 alone is the warning
                    # the first half-step's row normalisers are CLIP's log-softmax denominators
                    clip = -((logits_image[positives] - lse_image) + (logits_text[positives] - lse_text)).mean() / 2
                self._last = {'clip_loss': clip, 'tau': tau.detach()}
        return {'contrastive_loss': loss} if output_dict else loss
