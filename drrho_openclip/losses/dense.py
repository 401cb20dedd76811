"""The untiled aggregation of the DRO core: log g_i = log mean_{j≠i} exp(ℓ̂_ij/τ_i [+ log w_ij]) of every anchor,
holding b×B matrices. `tiled.py` computes the same in column tiles, with memory linear in the batch.

Both follow one contract, `aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text,
reference=None, negative_log_weight=None) -> (log_g_image, log_g_text)`:

- `image`, `text` [b, d]: this rank's anchors; `all_image`, `all_text` [B, d]: the candidates (the global batch),
  anchor i's positive being candidate offset + i. In the features' dtype: float32 and float64 compute as given;
  with fp16/bf16 the pairwise products run in that dtype (float32 accumulation, `precision.py`) and everything
  elementwise in float32.
- `inv_tau_image`, `inv_tau_text`: 1/τ, 0-dim or one per anchor ([b]), float32 or wider.
- `reference`: (ref_image, ref_text, all_ref_image, all_ref_text) in the features' dtype for the RHO shift
  ℓ̂_ij = (s_ij − s_ii) − (s^ref_ij − s^ref_ii), or None for ℓ̂_ij = s_ij − s_ii.
- `negative_log_weight(sim, positive_mask) -> log w`: constant log-weights of the candidates (e.g. ADNCE's); see
  `tiled.py` for what a tiled aggregation needs of it.
- Returns the [b] log g of the image anchors over the texts and of the text anchors over the images, in float32 or
  wider, differentiable in the features, 1/τ and (should they require it) the reference features. Same value and
  gradients from both implementations; forward and backward do not depend on the ambient autocast state.
"""
import math
from typing import Callable, Optional, Tuple

import torch

from .precision import autocast_disabled, similarities, without_autocast


def positive_mask(num_anchors: int, num_candidates: int, offset: int, device) -> torch.Tensor:
    """[b, B] boolean mask of each anchor's own pair, which sits at column offset + i."""
    rows = torch.arange(num_anchors, device=device)
    mask = torch.zeros(num_anchors, num_candidates, dtype=torch.bool, device=device)
    mask[rows, rows + offset] = True
    return mask


class _LogMeanExpRows(torch.autograd.Function):
    """log g_i = log mean_{j≠i} exp(ℓ̂_ij·inv_tau_i + log w_ij) from a [b, B] similarity block, with the gradient
    written out by hand: autograd's version of the same expression keeps four b×B matrices for backward (the shifted
    loss, the logits, the mask, the softmax), this keeps one (the logits) and builds the gradient in one more.

    ∂ log g_i/∂s_ij = inv_tau_i p_ij (j ≠ i) and −inv_tau_i Σ_j p_ij at the positive (ℓ̂ subtracts s_ii from every
    candidate), with p the softmax of row i over the negatives; the reference similarities get the negated gradient;
    ∂ log g_i/∂inv_tau_i = Σ_j p_ij ℓ̂_ij.
    """

    @staticmethod
    def forward(ctx, sim, ref_sim, inv_tau, log_w, offset):
        with autocast_disabled(sim.device):
            return _LogMeanExpRows._forward(ctx, sim, ref_sim, inv_tau, log_w, offset)

    @staticmethod
    def _forward(ctx, sim, ref_sim, inv_tau, log_w, offset):
        positive_sim = sim.diagonal(offset)[:, None]
        if ref_sim is None:
            logits = sim - positive_sim
        else:
            logits = (sim - ref_sim).sub_(positive_sim - ref_sim.diagonal(offset)[:, None])
        inv_tau_col = inv_tau.reshape(-1, 1) if inv_tau.dim() else inv_tau
        logits.mul_(inv_tau_col)
        if log_w is not None:
            logits.add_(log_w)
        positives = logits.diagonal(offset)
        positives.fill_(float('-inf'))
        lse = torch.logsumexp(logits, dim=1)
        positives.zero_()  # backward zeroes the positives' softmax weight; 0·(−inf) would give NaN in Σ_j p_ij·logit_ij
        ctx.save_for_backward(logits, inv_tau, log_w, lse)
        ctx.offset = offset
        return lse - math.log(sim.shape[1] - 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad_out):
        logits, inv_tau, log_w, lse = ctx.saved_tensors
        need_sim, need_ref, need_tau = ctx.needs_input_grad[:3]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[:, None]
        p = (logits - lse_safe).exp_()
        p.diagonal(ctx.offset).zero_()
        grad_tau = None
        if need_tau:
            # Σ_j p_ij ℓ̂_ij, with ℓ̂_ij = (logit_ij − log w_ij) / inv_tau_i
            slope = torch.einsum('ij,ij->i', p, logits)
            if log_w is not None:
                slope -= torch.einsum('ij,ij->i', p, log_w.expand_as(p))
            grad_rows = grad_out * slope / inv_tau
            grad_tau = grad_rows.sum().reshape(inv_tau.shape) if inv_tau.numel() == 1 else grad_rows
        if not (need_sim or need_ref):
            return None, None, grad_tau, None, None
        coef = (grad_out * inv_tau)[:, None]
        positive_weight = p.sum(dim=1, keepdim=True)
        grad_sim = p.mul_(coef)
        grad_sim.diagonal(ctx.offset).copy_((-coef * positive_weight).squeeze(1))
        return (grad_sim if need_sim else None, -grad_sim if need_ref else None, grad_tau, None, None)


def log_mean_exp_sim(
        sim: torch.Tensor,
        offset: int,
        inv_tau: torch.Tensor,
        ref_sim: Optional[torch.Tensor] = None,
        negative_log_weight: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """log g_i = log mean_{j≠i} exp(ℓ̂_ij · inv_tau_i [+ log w_ij]) for every row of a [b, B] similarity block
    whose positives sit at column offset + i; ℓ̂_ij = (s_ij − s_ii) − (s^ref_ij − s^ref_ii), the reference term only
    when `ref_sim` is given. Differentiable in `sim`, `ref_sim` and `inv_tau` (a scalar or a [b] tensor).

    `negative_log_weight(sim, positive_mask)` returns [b, B] log-weights of the candidates (e.g. ADNCE), constants of
    the graph; it sees the raw similarities.
    """
    inv_tau = torch.as_tensor(inv_tau, dtype=sim.dtype, device=sim.device)
    log_w = None
    if negative_log_weight is not None:
        mask = positive_mask(sim.shape[0], sim.shape[1], offset, sim.device)
        log_w = negative_log_weight(sim.detach(), mask).detach().to(sim.dtype)
    return _LogMeanExpRows.apply(sim, ref_sim, inv_tau, log_w, offset)


def dense_aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference=None,
                    negative_log_weight=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log g of the image anchors over the texts, log g of the text anchors over the images), holding b×B matrices
    (the contract in the module docstring).

    When the anchors are the whole batch (one process) the text direction's similarities are the transpose of the
    image direction's: one matrix product serves both, and backward sums both directions' gradients into it before
    the two products with the features.
    """
    with autocast_disabled(image.device):
        whole_batch = image is all_image and text is all_text
        sim_image = similarities(image, all_text)
        sim_text = sim_image.T if whole_batch else similarities(text, all_image)
        ref_sim_image = ref_sim_text = None
        if reference is not None:
            ref_image, ref_text, all_ref_image, all_ref_text = reference
            ref_sim_image = similarities(ref_image, all_ref_text)
            ref_sim_text = ref_sim_image.T if whole_batch else similarities(ref_text, all_ref_image)
        return (log_mean_exp_sim(sim_image, offset, inv_tau_image, ref_sim_image, negative_log_weight),
                log_mean_exp_sim(sim_text, offset, inv_tau_text, ref_sim_text, negative_log_weight))
