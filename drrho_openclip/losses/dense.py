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


# the temperature's derivative multiplies two b×B matrices elementwise: in this many blocks of rows (an eighth of a
# b×B matrix at a time, in a number of steps that does not grow with the batch)
_SLOPE_BLOCKS = 8


def linear_in_inv_tau(value: torch.Tensor, slope: torch.Tensor, inv_tau: torch.Tensor) -> torch.Tensor:
    """`value` (computed with 1/τ detached) made differentiable in `inv_tau` through its derivative `slope` there:
    value + slope·(inv_tau − inv_tau.detach()) adds exactly zero. A gradient with respect to τ alone, which a learned
    temperature takes inside every forward call for its own step, then costs O(b) instead of a second backward pass
    over the b×B matrices; the training backward gets the same τ-gradient as from the full expression."""
    if not inv_tau.requires_grad:
        return value
    return value + slope * (inv_tau - inv_tau.detach())


class _LogMeanExpRows(torch.autograd.Function):
    """(log g, ∂ log g/∂inv_tau) with log g_i = log mean_{j≠i} exp(ℓ̂_ij·inv_tau_i + log w_ij) from a [b, B] block of
    shifted similarities d (s, or s − s^ref), ℓ̂_ij = d_ij − d_ii, with the gradient written out by hand: autograd's
    version of the same expression keeps four b×B matrices for backward (the shifted loss, the logits, the mask, the
    softmax), this keeps one (the softmax) and builds the gradient in place in it.

    ∂ log g_i/∂d_ij = inv_tau_i p_ij (j ≠ i) and −inv_tau_i Σ_j p_ij at the positive (ℓ̂ subtracts d_ii from every
    candidate), with p the softmax of row i over the negatives; ∂ log g_i/∂inv_tau_i = Σ_j p_ij ℓ̂_ij, computed in
    forward when `with_slope` (empty otherwise) and not differentiable: `inv_tau` is a constant here,
    `linear_in_inv_tau` puts the dependence back.
    """

    @staticmethod
    def forward(ctx, shifted, inv_tau, log_w, offset, with_slope):
        with autocast_disabled(shifted.device):
            return _LogMeanExpRows._forward(ctx, shifted, inv_tau, log_w, offset, with_slope)

    @staticmethod
    def _forward(ctx, shifted, inv_tau, log_w, offset, with_slope):
        inv_tau_col = inv_tau.reshape(-1, 1) if inv_tau.dim() else inv_tau
        # (d_ij − d_ii)·inv_tau_i in one pass over the block
        logits = torch.addcmul(-shifted.diagonal(offset)[:, None] * inv_tau_col, shifted, inv_tau_col)
        if log_w is not None:
            logits.add_(log_w)
        logits.diagonal(offset).fill_(float('-inf'))  # the positives: out of the sum, and a softmax weight of 0
        lse = torch.logsumexp(logits, dim=1)
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[:, None]
        slope = lse.new_empty(0)
        if with_slope or ctx.needs_input_grad[0]:
            p = logits.sub_(lse_safe).exp_()  # the logits are not needed again
            weight = p.sum(dim=1)  # Σ_j p_ij: the slope and backward's positive term both read it
        else:
            p = weight = None
        if with_slope:
            # Σ_j p_ij ℓ̂_ij = Σ_j p_ij d_ij − d_ii Σ_j p_ij (ℓ̂_ij = d_ij − d_ii, whatever the log-weights): the products
            # p_ij d_ij by blocks of rows, so that only a fraction of a b×B matrix is ever added to the loss's memory
            block_rows = -(-p.shape[0] // _SLOPE_BLOCKS)
            weighted = torch.cat([torch.linalg.vecdot(p[r0:r0 + block_rows], shifted[r0:r0 + block_rows], dim=1)
                                  for r0 in range(0, p.shape[0], block_rows)])
            slope = weighted - shifted.diagonal(offset) * weight
        ctx.mark_non_differentiable(slope)
        ctx.save_for_backward(p, weight, inv_tau)
        ctx.offset = offset
        return lse - math.log(shifted.shape[1] - 1), slope

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad_out, _grad_slope):
        p, weight, inv_tau = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        coef = (grad_out * inv_tau)[:, None]
        grad = p.mul_(coef)  # p is not needed again (backward runs once)
        grad.diagonal(ctx.offset).copy_((-coef * weight[:, None]).squeeze(1))
        return grad, None, None, None, None


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
    shifted = sim if ref_sim is None else sim - ref_sim
    return _log_mean_exp_shifted(shifted, sim, offset, inv_tau, negative_log_weight)


def _log_mean_exp_shifted(shifted, sim, offset, inv_tau, negative_log_weight):
    """`log_mean_exp_sim` from the shifted similarities (s, or s − s^ref); `sim`, the raw ones, is read by the
    log-weights only (None without them)."""
    inv_tau = torch.as_tensor(inv_tau, dtype=shifted.dtype, device=shifted.device)
    log_w = None
    if negative_log_weight is not None:
        mask = positive_mask(sim.shape[0], sim.shape[1], offset, sim.device)
        log_w = negative_log_weight(sim.detach(), mask).detach().to(shifted.dtype)
    log_g, slope = _LogMeanExpRows.apply(shifted, inv_tau.detach(), log_w, offset, inv_tau.requires_grad)
    return linear_in_inv_tau(log_g, slope, inv_tau)


def dense_aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference=None,
                    negative_log_weight=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log g of the image anchors over the texts, log g of the text anchors over the images), holding b×B matrices
    (the contract in the module docstring).

    When the anchors are the whole batch (one process) the text direction's similarities are the transpose of the
    image direction's: one matrix product (and one reference shift s − s^ref) serves both, and backward sums both
    directions' gradients into it before the two products with the features.
    """
    with autocast_disabled(image.device):
        whole_batch = image is all_image and text is all_text
        sim_image = similarities(image, all_text)
        sim_text = sim_image.T if whole_batch else similarities(text, all_image)
        shifted_image, shifted_text = sim_image, sim_text
        if reference is not None:
            ref_image, ref_text, all_ref_image, all_ref_text = reference
            shifted_image = sim_image - similarities(ref_image, all_ref_text)
            shifted_text = shifted_image.T if whole_batch else sim_text - similarities(ref_text, all_ref_image)
        # the raw similarities are needed for the log-weights only (e.g. ADNCE's): otherwise they are let go here
        raw_image, raw_text = (sim_image, sim_text) if negative_log_weight is not None else (None, None)
        del sim_image, sim_text
        return (_log_mean_exp_shifted(shifted_image, raw_image, offset, inv_tau_image, negative_log_weight),
                _log_mean_exp_shifted(shifted_text, raw_text, offset, inv_tau_text, negative_log_weight))
