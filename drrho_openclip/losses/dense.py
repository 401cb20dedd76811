"""The untiled aggregation of the DRO core: log g_i = log mean_{j≠i} exp(ℓ̂_ij/τ_i [+ log w_ij]) of every anchor,
over b×B matrices. `tiled.py` computes the same in column tiles, with memory linear in the batch.

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

How this one spends its time. With the shift, d_ij = s_ij − s^ref_ij = [x_i, x^ref_i]·[y_j, −y^ref_j] is one matrix
product of the concatenated features (no second b×B matrix, no subtraction pass). Forward keeps that one matrix d
(float32) and two numbers per row (log-sum-exp and Σ_j p_ij; the τ-slope is an output only); backward recomputes
the softmax from them and writes the gradient straight in the features' dtype, for the two products with the
features. When one process holds the whole batch both directions read the same d (the text rows are its columns),
and backward writes one gradient for both. Everything over the b×B matrix is a pass of `passes.py`, compiled on CUDA.

Log-weights (ADNCE's) are a function of the raw similarities, d itself without a reference. Where the passes are
compiled, they are evaluated inside the passes that read them, forward and again in backward: the kernels compute
them as they stream d, so none is written or kept (with a reference the similarities are one more product, made
again in backward rather than kept). Eagerly (the CPU) that recomputation would be several more passes over b×B
each time, so there they are computed once in forward and kept for backward.
"""
import math
from typing import Tuple

import torch

from . import passes
from .precision import autocast_disabled, product, without_autocast


# ---- the call sites compiled on CUDA: the passes over d's rows, and over its columns when one process holds all ----

def _log_weight(log_w, negative_log_weight, sim, offset):
    """The log-weights of one direction: `log_w` as computed before the pass, or, when `negative_log_weight` is
    passed in (compiled passes), evaluated here from `sim`, the raw similarities of that direction."""
    if negative_log_weight is None:
        return log_w
    return negative_log_weight(sim, passes.positive_mask(*sim.shape, offset, sim.device))


def _statistics(shifted, rows, columns, offset, with_slope, sim=None, negative_log_weight=None):
    """`row_statistics` of the rows of d, and of its columns when `columns` is given (inv_tau, log_w of the
    candidates' side: one process holds the whole batch, offset 0). Log-weights as `_log_weight` says."""
    inv_tau, log_w = rows
    stats = passes.row_statistics(shifted, inv_tau, _log_weight(log_w, negative_log_weight, sim, offset), offset,
                                  None, with_slope)
    if columns is None:
        return stats
    inv_tau, log_w = columns
    sim = None if sim is None else sim.T
    return stats + passes.row_statistics(shifted.T, inv_tau, _log_weight(log_w, negative_log_weight, sim, 0), 0,
                                         None, with_slope)


def _gradient(shifted, rows, columns, offset, dtype, upstream_d=None, sim=None, negative_log_weight=None):
    """∂/∂d of Σ upstream·log g over the rows (and columns) of d, plus `upstream_d` (what reached d itself, the
    returned matrix, or None), in `dtype`, the features' (the products with the features read it). `rows`, `columns`:
    (inv_tau, log_w, lse, weight, upstream) of each side; a positive d_ii, which every ℓ̂_ij of its row subtracts,
    gets −upstream_i inv_tau_i Σ_j p_ij."""
    inv_tau, log_w, lse, weight, upstream = rows
    scale = upstream * inv_tau
    grad = passes.row_gradient(shifted, inv_tau, _log_weight(log_w, negative_log_weight, sim, offset), offset, None,
                               lse, scale)
    positive = -scale * weight
    if columns is not None:
        inv_tau, log_w, lse, weight, upstream = columns
        scale = upstream * inv_tau
        sim = None if sim is None else sim.T
        grad.add_(passes.row_gradient(shifted.T, inv_tau, _log_weight(log_w, negative_log_weight, sim, 0), 0, None,
                                      lse, scale).T)
        positive = positive - scale * weight
    grad = passes.set_positives(grad, offset, positive)
    return (grad if upstream_d is None else grad.add_(upstream_d)).to(dtype)


# ---- the aggregation ------------------------------------------------------------------------------------------------

class _DenseLogMeanExp(torch.autograd.Function):
    """(log g, τ-slope) of the anchors over the candidates, d = anchors·candidatesᵀ [− ref_anchors·ref_candidatesᵀ],
    and with `inv_tau_columns` also of the candidates over the anchors (d's columns; one process, offset 0), and d
    itself (float32 or wider; the matrix backward keeps anyway, for a later pass over the same pairs, whose gradient
    then joins this one's before the products). 1/τ is one constant per anchor ([b]); `negative_log_weight` (or None)
    gives each direction's constant log-weights from its raw similarities. The slope ∂ log g_i/∂inv_tau_i =
    Σ_j p_ij ℓ̂_ij is computed only `with_slope` (zeros otherwise) and not differentiable: `passes.linear_in_inv_tau`
    puts the dependence on τ back. Differentiable in the four feature sets."""

    @staticmethod
    def forward(ctx, anchors, candidates, ref_anchors, ref_candidates, inv_tau, inv_tau_columns, negative_log_weight,
                offset, with_slope):
        with autocast_disabled(anchors.device):
            if ref_anchors is None:
                shifted = product(anchors, candidates.T)
            else:  # s − s^ref as one product of the concatenated features
                shifted = product(torch.cat([anchors, ref_anchors], 1), torch.cat([candidates, -ref_candidates], 1).T)
            log_w = log_w_columns = sim = None
            in_pass = negative_log_weight is not None and passes.compiles_for(shifted.device)
            if negative_log_weight is not None:
                sim = _similarities(anchors, candidates, ref_anchors, shifted)
                if not in_pass:  # eager: computed once here, kept for backward
                    log_w = _log_weight(None, negative_log_weight, sim, offset)
                    if inv_tau_columns is not None:
                        log_w_columns = _log_weight(None, negative_log_weight, sim.T, 0)
            rows = (inv_tau, log_w)
            columns = None if inv_tau_columns is None else (inv_tau_columns, log_w_columns)
            in_pass_args = (sim, negative_log_weight) if in_pass else ()
            stats = passes.fused(_statistics, shifted)(shifted, rows, columns, offset, with_slope, *in_pass_args)
            del sim, in_pass_args
        # backward reads each direction's log-sum-exp and Σ_j p_ij; the τ-slopes are outputs only
        ctx.save_for_backward(anchors, candidates, ref_anchors, ref_candidates, shifted, *stats[:2], *stats[3:5])
        ctx.rows, ctx.columns, ctx.offset = rows, columns, offset
        ctx.in_pass_log_weight = negative_log_weight if in_pass else None
        ctx.set_materialize_grads(False)  # d unused afterwards must cost no b×B matrix of zeros in backward
        log_mean = math.log(shifted.shape[1] - 1)
        lse, _, slope = stats[:3]
        lse_columns, _, slope_columns = stats[3:] if columns is not None else (lse.new_empty(0),) * 3
        ctx.mark_non_differentiable(slope, slope_columns)
        return lse - log_mean, slope, lse_columns - log_mean, slope_columns, shifted

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, upstream, _slope, upstream_columns, _slope_columns, upstream_d):
        anchors, candidates, ref_anchors, ref_candidates, shifted, *stats = ctx.saved_tensors

        def given(upstream, lse):  # an unused log g gets nothing: its upstream is zero
            return torch.zeros_like(lse) if upstream is None else upstream

        rows = (*ctx.rows, *stats[:2], given(upstream, stats[0]))
        columns = None if ctx.columns is None else (*ctx.columns, *stats[2:4], given(upstream_columns, stats[2]))
        in_pass_args = ()
        if ctx.in_pass_log_weight is not None:  # the raw similarities again (d itself without a reference)
            in_pass_args = (_similarities(anchors, candidates, ref_anchors, shifted), ctx.in_pass_log_weight)
        grad = passes.fused(_gradient, shifted)(shifted, rows, columns, ctx.offset, anchors.dtype, upstream_d,
                                                *in_pass_args)
        del in_pass_args
        needs = ctx.needs_input_grad
        grads = (product(grad, candidates).to(anchors.dtype) if needs[0] else None,
                 product(grad.T, anchors).to(candidates.dtype) if needs[1] else None,
                 (-product(grad, ref_candidates)).to(ref_anchors.dtype) if needs[2] else None,
                 (-product(grad.T, ref_anchors)).to(ref_candidates.dtype) if needs[3] else None)
        return (*grads, None, None, None, None, None)


def _similarities(anchors, candidates, ref_anchors, shifted):
    """The raw similarities that log-weights are of: d itself without a reference, their own product with one."""
    return shifted if ref_anchors is None else product(anchors, candidates.T)


def log_mean_exp_rows(anchors, candidates, offset, inv_tau, ref_anchors=None, ref_candidates=None,
                      negative_log_weight=None) -> torch.Tensor:
    """log g_i = log mean_{j≠i} exp(ℓ̂_ij·inv_tau_i [+ log w_ij]) of every anchor [b] over the candidates [B] (anchor
    i's positive is candidate offset + i), ℓ̂_ij = (s_ij − s_ii) − (s^ref_ij − s^ref_ii), the reference term only with
    reference features. Differentiable in the features and `inv_tau` (a number, 0-dim, [1] or [b])."""
    return passes.log_mean_exp_rows_with(_DenseLogMeanExp, anchors, candidates, offset, inv_tau, ref_anchors,
                                         ref_candidates, negative_log_weight)


def dense_aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference=None,
                    negative_log_weight=None, keep_pairs=False) -> Tuple[torch.Tensor, ...]:
    """(log g of the image anchors over the texts, log g of the text anchors over the images), holding b×B matrices
    (the contract in the module docstring). When the anchors are the whole batch (one process) the text direction's
    matrix is the transpose of the image direction's: one product, one matrix and one gradient serve both. With
    `keep_pairs`, also (d of the image anchors' rows, d of the text anchors' rows), each [b, B], differentiable (the
    second a transposed view of the first in one process): another pass over the same pairs (the column step) reads
    them instead of multiplying the features again, its gradient joining the aggregation's before its products."""
    out = passes.aggregate_with(_DenseLogMeanExp, image, text, all_image, all_text, offset, inv_tau_image,
                                inv_tau_text, reference, negative_log_weight)
    return out if keep_pairs else out[:2]
