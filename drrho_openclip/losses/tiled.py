"""A tiled, memory-linear drop-in for the untiled aggregation `dense.dense_aggregate` (same contract, same result).

`dense.dense_aggregate` materialises b×B matrices (the similarities, the logits, the gradient in backward), so the
loss needs O(b·B) memory: at a global batch of 65 536 on one device that is 16 GiB per
float32 matrix. The function here computes the same value and the same gradients while never holding more than a
b×T block of any pairwise matrix (T = `tile_size` columns):

- forward: every b×T tile of d goes through the same passes as the untiled aggregation (`passes.py`: compiled on
  CUDA, eager elsewhere), and its row statistics (log-sum-exp, Σ_j p_ij, the τ-slope Σ_j p_ij ℓ̂_ij) are merged into
  the running ones as a streaming log-sum-exp does (FlashAttention's online softmax). Only [b] statistics and the
  inputs are kept for backward.
- backward: every tile is recomputed and its gradient, the softmax of the whole row times the upstream gradient,
  is turned into the tile's contribution to the gradients of the anchors, of the candidates and, should they
  require it, of the reference features.
- when one process holds the whole batch (`tiled_aggregate` with the anchors as candidates, offset 0), a tile's
  columns are whole rows of the other direction: the same pass over the tiles computes both, as the untiled
  aggregation computes both from one matrix.

Memory is O((b + B)·d + b·T); the arithmetic is the untiled one plus one recomputation of d.

Use it with the core through the loss's `tile_size` option (`--tile-size`), which also chunks the distillation
term to the same rows:

    loss = create_loss('drrho', num_samples=n, tile_size=DEFAULT_TILE_SIZE)

Negative log-weights (`negative_log_weight`, e.g. ADNCE-style hardness weights) are supported under a contract,
since the full row never exists:

- a plain callable `negative_log_weight(sim, positive_mask) -> log w` is called once per tile (in forward and again
  in backward) with the tile's [b, T] similarities (detached) and the matching slice of the positive mask (and,
  for the other direction when one pass serves both, with their transposes: whole rows of that direction). It must
  be *row-separable per tile*: its value on a column block must equal that block of its value on the whole row,
  i.e. log w_ij may depend on (i, j, s_ij, positive or not) and on fixed parameters, but not on other columns.
  An elementwise function of s_ij qualifies; a per-row normalisation (a softmax over j, a row mean or std) does
  not, and would silently give a different loss. Nothing here can detect a violation.
- a per-row normalisation of the form log w_ij = h_ij − log mean_{j≠i} exp(h_ij), with h row-separable, is
  tile-composable: wrap h as `RowNormalizedLogWeight(h)`. Called on a whole row (as the untiled core does) it
  returns the normalised weights; the tiled function recognises it, streams h and accumulates the normaliser
  log Σ_{j≠i} exp h_ij online in the same pass, so both paths compute the same loss.
The weights are constants of the graph (detached) in both implementations.
"""
import functools
import math
from typing import Callable, Optional

import torch

from . import passes
from .precision import autocast_disabled, elementwise_dtype, product, subtract_product_, without_autocast

__all__ = [
    'DEFAULT_TILE_SIZE', 'RowNormalizedLogWeight', 'make_tiled_aggregate', 'negative_weight_entropy', 'tiled_aggregate',
    'tiled_log_mean_exp_rows',
]

# Columns per tile. Chosen with the tile-size sweep of `python benchmarks/tiled_memory.py` on the 2-core CPU (AMD EPYC,
# MKL) this was developed on, drrho forward+backward, d = 512, float32 (benchmarks/results/tiled_memory*.md); the
# machine was shared, 1-min load average 5-9, so times are rough:
#   2 threads, global batch 8192, T = 128 / 256 / 512 / 1024 / 2048 / 4096:
#     step 68 / 46 / 34 / 22.6 / 20.7 / 24.2 s,  peak 0.07 / 0.09 / 0.20 / 0.16 / 0.25 / 0.42 GiB
#   1 thread,  global batch 4096, T = 256 / 1024 / 4096:  step 4.1 / 4.3 / 4.8 s,  peak 0.05 / 0.14 / 0.21 GiB
#   1 thread, global batch 8192, both directions in one pass (tiled_memory_shared_passes.md), T = 512 / 1024 / 2048 /
#     4096: step 4.4 / 5.0 / 5.0 / 4.8 s, peak 0.10 / 0.16 / 0.23 / 0.44 GiB
# Small tiles pay a per-tile cost (~20 small kernels per tile, each an OpenMP region, which is what hurts on an
# oversubscribed 2-core machine); beyond ~1024 columns time is flat while the b×T blocks (a few alive at once,
# 4·b·T bytes each) keep growing. 1024: the smallest tile on the first sweeps' time plateau. On a GPU, larger tiles
# (4096–8192) keep kernels busier; the value is a per-run choice (`--tile-size`), not part of the loss's
# definition.
DEFAULT_TILE_SIZE = 1024


class RowNormalizedLogWeight:
    """Log-weights normalised per row over the negatives: log w_ij = h_ij − log mean_{j≠i} exp(h_ij).

    `log_weight(sim, positive_mask) -> h` must be row-separable per tile (see the module docstring). On a whole
    [b, B] row block the instance returns the normalised log-weights (what the untiled core needs); the tiled
    aggregation streams h and the normaliser instead, which gives the same result.
    """

    def __init__(self, log_weight: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.log_weight = log_weight

    def __call__(self, sim: torch.Tensor, positive_mask: torch.Tensor) -> torch.Tensor:
        h = self.log_weight(sim, positive_mask)
        # h is the caller's (it may be a view of the similarities, a broadcast, or kept elsewhere): not written to;
        # the masked copy is a temporary of this line, gone before the result is allocated
        log_sum = torch.logsumexp(h.masked_fill(positive_mask, float('-inf')), dim=1, keepdim=True)
        return h - (log_sum - math.log(sim.shape[1] - 1))

    def __repr__(self):
        return f'{type(self).__name__}({self.log_weight!r})'


def _check_tile_size(tile_size):
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"tile_size must be a positive int, got {tile_size!r}")


def _check_inputs(anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, tile_size):
    _check_tile_size(tile_size)
    if anchors.dim() != 2 or candidates.dim() != 2 or anchors.shape[1] != candidates.shape[1]:
        raise ValueError(f"anchors [b, d] and candidates [B, d] expected, got {tuple(anchors.shape)} "
                         f"and {tuple(candidates.shape)}")
    b, num_candidates = anchors.shape[0], candidates.shape[0]
    if not 0 <= offset <= num_candidates - b:
        raise ValueError(f"the positives of {b} anchors start at column {offset}, outside the "
                         f"{num_candidates} candidates")
    if inv_tau.numel() not in (1, b):
        raise ValueError(f"inv_tau must be a scalar or have one value per anchor ({b}), got shape "
                         f"{tuple(inv_tau.shape)}")
    if (ref_anchors is None) != (ref_candidates is None):
        raise ValueError("give both reference feature sets or neither")
    if ref_anchors is not None and (ref_anchors.shape[0] != b or ref_candidates.shape[0] != num_candidates
                                    or ref_anchors.shape[1] != ref_candidates.shape[1]):
        raise ValueError(f"reference features {tuple(ref_anchors.shape)} / {tuple(ref_candidates.shape)} do not "
                         f"match anchors {tuple(anchors.shape)} / candidates {tuple(candidates.shape)}")


def _positives(anchors, candidates, ref_anchors, ref_candidates, offset):
    """d_ii [b] of every anchor and its positive (candidate offset + i), in the elementwise dtype."""
    def dot(x, y):
        dtype = elementwise_dtype(x.dtype)
        return (x.to(dtype) * y[offset:offset + x.shape[0]].to(dtype)).sum(1)
    return dot(anchors, candidates) if ref_anchors is None else \
        dot(anchors, candidates) - dot(ref_anchors, ref_candidates)


def _tiles(anchors, candidates, ref_anchors, ref_candidates, offset, tile_size, log_weight, columns_log_weight=None):
    """(first column, d's tile [b, T] in float32 or wider, its log-weights h or None, and with `columns_log_weight`
    those of its columns [T, b] or None) of every column tile; the weights from the tile's raw similarities
    (detached) and its slice of the positive mask. d = s − s^ref is two products per tile, the second accumulated
    into the first (`subtract_product_`; apart when log-weights may hold a view of s)."""
    for c0 in range(0, candidates.shape[0], tile_size):
        c1 = min(c0 + tile_size, candidates.shape[0])
        tile = product(anchors, candidates[c0:c1].T)
        log_w = log_w_columns = None
        if log_weight is not None:
            mask = passes.positive_mask(tile.shape[0], c1 - c0, offset - c0, tile.device)
            log_w = log_weight(tile, mask).to(tile.dtype).expand_as(tile)  # a broadcastable result is fine
            if columns_log_weight is not None:
                log_w_columns = columns_log_weight(tile.T, mask.T).to(tile.dtype).expand_as(tile.T)
        if ref_anchors is not None:
            if log_weight is not None:  # they may hold a view of the raw similarities
                tile = tile - product(ref_anchors, ref_candidates[c0:c1].T)
            else:
                subtract_product_(tile, ref_anchors, ref_candidates[c0:c1].T)
        yield c0, tile, log_w, log_w_columns


def _in_tile(values, c0, tile):
    return values[c0:c0 + tile.shape[1]]


# ---- the call sites compiled on CUDA: a tile's rows (a part of each anchor's row), and with `columns` its columns,
# whole rows of the other direction when one process holds the whole batch (offset 0) -------------------------------

def _tile_statistics(tile, rows, columns, offset, c0, positive, with_slope):
    """`row_statistics` of the tile's rows, `rows` = (inv_tau, log_w), and of its columns, `columns` = (inv_tau,
    log_w) of the candidates in the tile, or None."""
    stats = passes.row_statistics(tile, *rows, offset - c0, positive, with_slope)
    if columns is None:
        return stats
    return stats + passes.row_statistics(tile.T, *columns, c0, _in_tile(positive, c0, tile), with_slope)


def _tile_gradient(tile, rows, columns, offset, c0, positive, dtype, overwrite):
    """The tile's ∂/∂d over its negatives in `dtype`, the features' (for the products with them); `rows`, `columns`:
    (inv_tau, log_w, lse, upstream·inv_tau) of each side. The tile is recomputed for this call alone: with
    `overwrite` (no log-weights are a view of it) the rows' gradient is written into it, last, so that one process's
    two directions hold two b×T blocks at a time, not three."""
    grad_columns = None if columns is None else \
        passes.row_gradient(tile.T, *columns[:2], c0, _in_tile(positive, c0, tile), *columns[2:])
    grad = passes.row_gradient(tile, *rows[:2], offset - c0, positive, *rows[2:], overwrite=overwrite)
    if grad_columns is not None:
        grad.add_(grad_columns.T)
    return grad.to(dtype)


class _TiledLogMeanExp(torch.autograd.Function):
    """(log g, τ-slope) of the anchors over the candidates, one column tile at a time (the module docstring), and
    with `inv_tau_columns` also of the candidates over the anchors (one process, offset 0: each tile's columns are
    whole rows of that direction, so one pass over the tiles serves both). 1/τ is one constant per anchor ([b]); the
    slope is computed only `with_slope` (zeros otherwise) and not differentiable: `passes.linear_in_inv_tau` puts the
    dependence on τ back."""

    @staticmethod
    def forward(ctx, anchors, candidates, ref_anchors, ref_candidates, inv_tau, inv_tau_columns, negative_log_weight,
                offset, with_slope, tile_size):
        normalize = isinstance(negative_log_weight, RowNormalizedLogWeight)
        log_weight = negative_log_weight.log_weight if normalize else negative_log_weight
        # a tile's columns are whole rows: their log-weights, normalised or not, come whole from the tile
        columns_log_weight = negative_log_weight if inv_tau_columns is not None else None
        with autocast_disabled(anchors.device):
            positive = _positives(anchors, candidates, ref_anchors, ref_candidates, offset)
            stats = normalizer = None
            column_stats = []
            for c0, tile, log_w, log_w_columns in _tiles(anchors, candidates, ref_anchors, ref_candidates, offset,
                                                         tile_size, log_weight, columns_log_weight):
                columns = None if inv_tau_columns is None else (_in_tile(inv_tau_columns, c0, tile), log_w_columns)
                tile_stats = passes.fused(_tile_statistics, tile)(tile, (inv_tau, log_w), columns, offset, c0,
                                                                  positive, with_slope)
                stats = tile_stats[:3] if stats is None else passes.merge(stats, tile_stats[:3])
                column_stats.append(tile_stats[3:])
                if normalize:  # log Σ_{j≠i} exp h_ij: the normaliser is a constant of the graph
                    negatives = passes.set_positives(log_w.clone(), offset - c0, float('-inf'))
                    tile_normalizer = torch.logsumexp(negatives, dim=1)
                    normalizer = tile_normalizer if normalizer is None else torch.logaddexp(normalizer,
                                                                                            tile_normalizer)
        lse, weight, slope = stats
        log_mean = math.log(candidates.shape[0] - 1)
        # log mean_{j≠i} w̄_ij exp(ℓ̂_ij/τ_i) with w̄ = exp(h)/mean exp(h) is log Σ exp(ℓ̂/τ + h) − log Σ exp(h)
        out = lse - normalizer if normalize else lse - log_mean
        if inv_tau_columns is None:
            lse_columns = weight_columns = slope_columns = out_columns = lse.new_empty(0)
        else:
            lse_columns, weight_columns, slope_columns = (torch.cat(parts) for parts in zip(*column_stats))
            out_columns = lse_columns - math.log(anchors.shape[0] - 1)
        ctx.save_for_backward(anchors, candidates, ref_anchors, ref_candidates, inv_tau, inv_tau_columns, positive,
                              lse, weight, lse_columns, weight_columns)
        ctx.offset, ctx.tile_size, ctx.log_weights = offset, tile_size, (log_weight, columns_log_weight)
        ctx.mark_non_differentiable(slope, slope_columns)
        return out, slope, out_columns, slope_columns

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, upstream, _slope, upstream_columns, _slope_columns):
        (anchors, candidates, ref_anchors, ref_candidates, inv_tau, inv_tau_columns, positive, lse, weight,
         lse_columns, weight_columns) = ctx.saved_tensors
        offset, tile_size = ctx.offset, ctx.tile_size
        need_a, need_c, need_ra, need_rc = ctx.needs_input_grad[:4]
        dtype = elementwise_dtype(anchors.dtype)

        def zeros(like):  # gradients accumulate in the elementwise dtype, whatever the features'
            return torch.zeros(like.shape, dtype=dtype, device=like.device)

        grad_a = zeros(anchors) if need_a else None
        grad_c = zeros(candidates) if need_c else None
        grad_ra = zeros(ref_anchors) if need_ra else None
        grad_rc = zeros(ref_candidates) if need_rc else None
        scale = upstream.to(dtype) * inv_tau
        # ℓ̂_ij subtracts d_ii = s_ii − s^ref_ii for every j: those terms receive −scale_i Σ_j p_ij (from each side)
        coef = scale * weight
        if inv_tau_columns is not None:
            scale_columns = upstream_columns.to(dtype) * inv_tau_columns
            coef = coef + scale_columns * weight_columns
        # without a reference, a tile is the raw similarities, which log-weights may return views of
        overwrite = ctx.log_weights[0] is None or ref_anchors is not None
        for c0, tile, log_w, log_w_columns in _tiles(anchors, candidates, ref_anchors, ref_candidates, offset,
                                                     tile_size, *ctx.log_weights):
            c1 = c0 + tile.shape[1]
            columns = None if inv_tau_columns is None else (
                _in_tile(inv_tau_columns, c0, tile), log_w_columns, _in_tile(lse_columns, c0, tile),
                _in_tile(scale_columns, c0, tile))
            g = passes.fused(_tile_gradient, tile)(tile, (inv_tau, log_w, lse, scale), columns, offset, c0,
                                                    positive, anchors.dtype, overwrite)
            # the products with the features run in the features' dtype (16-bit: on the tensor cores)
            if need_a:
                grad_a += product(g, candidates[c0:c1])
            if need_c:
                grad_c[c0:c1] = product(g.T, anchors)
            if need_ra:
                grad_ra -= product(g, ref_candidates[c0:c1])
            if need_rc:
                grad_rc[c0:c1] = -product(g.T, ref_anchors)
            del tile, log_w, log_w_columns, g

        coef = coef[:, None]
        pos = slice(offset, offset + anchors.shape[0])
        if need_a:
            grad_a.sub_(coef * candidates[pos])
        if need_c:
            grad_c[pos] -= coef * anchors
        if need_ra:
            grad_ra.add_(coef * ref_candidates[pos])
        if need_rc:
            grad_rc[pos] += coef * ref_anchors
        grads = [grad if grad is None else grad.to(like.dtype)
                 for grad, like in zip((grad_a, grad_c, grad_ra, grad_rc),
                                       (anchors, candidates, ref_anchors, ref_candidates))]
        return (*grads, None, None, None, None, None, None)


def tiled_log_mean_exp_rows(
        anchors: torch.Tensor,
        candidates: torch.Tensor,
        offset: int,
        inv_tau,
        ref_anchors: Optional[torch.Tensor] = None,
        ref_candidates: Optional[torch.Tensor] = None,
        negative_log_weight: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        *,
        tile_size: int = DEFAULT_TILE_SIZE,
) -> torch.Tensor:
    """log g_i = log mean_{j≠i} exp(ℓ̂_ij · inv_tau_i [+ log w_ij]) of the anchors against the candidates (anchor
    i's positive is candidate offset + i): `dense.log_mean_exp_rows`, tiled. `tile_size` is the
    number of candidate columns processed at a time, so no more than a [b, tile_size] block of a pairwise matrix is
    alive in forward or backward.
    Differentiable in `anchors`, `candidates`, `inv_tau` (0-dim, [1] or [b]) and the reference features.
    Products in the features' dtype, elementwise work in float32 or wider (`precision.py`); the result is float32
    or wider. `negative_log_weight` must be row-separable per tile, or a `RowNormalizedLogWeight` (see the module
    docstring).
    """
    _check_inputs(anchors, candidates, offset, torch.as_tensor(inv_tau), ref_anchors, ref_candidates, tile_size)
    return passes.log_mean_exp_rows_with(_TiledLogMeanExp, anchors, candidates, offset, inv_tau, ref_anchors,
                                         ref_candidates, negative_log_weight, tile_size)


def tiled_aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference=None,
                    negative_log_weight=None, *, tile_size: int = DEFAULT_TILE_SIZE):
    """`dense.dense_aggregate`, tiled (the contract in `dense.py`'s docstring). When the anchors are the whole batch
    (one process) one pass over the tiles serves both directions: a tile's columns are whole text rows."""
    ref_image, ref_text, all_ref_image, all_ref_text = reference if reference is not None else (None,) * 4
    _check_inputs(image, all_text, offset, torch.as_tensor(inv_tau_image), ref_image, all_ref_text, tile_size)
    _check_inputs(text, all_image, offset, torch.as_tensor(inv_tau_text), ref_text, all_ref_image, tile_size)
    return passes.aggregate_with(_TiledLogMeanExp, image, text, all_image, all_text, offset, inv_tau_image,
                                 inv_tau_text, reference, negative_log_weight, tile_size)[:2]


def make_tiled_aggregate(tile_size: int = DEFAULT_TILE_SIZE) -> Callable:
    """An `aggregate` for `DROContrastiveLoss` (the contract in `dense.py`'s docstring) with the given tile size."""
    _check_tile_size(tile_size)
    return functools.partial(tiled_aggregate, tile_size=tile_size)


@torch.no_grad()
def negative_weight_entropy(anchors, candidates, offset, inv_tau, ref_anchors=None, ref_candidates=None,
                            negative_log_weight=None, *, tile_size: int = DEFAULT_TILE_SIZE) -> torch.Tensor:
    """[b] entropy −Σ_{j≠i} p_ij log p_ij of every anchor's DRO weights over its negatives, p_ij the softmax of
    ℓ̂_ij·inv_tau_i [+ log w_ij] over j ≠ i (the arguments of `tiled_log_mean_exp_rows`); exp of it is the effective
    number of negatives. One streaming pass, memory linear in the batch, whichever aggregation the loss uses."""
    inv_tau = torch.as_tensor(inv_tau, device=anchors.device)
    _check_inputs(anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, tile_size)
    # normalising h shifts every logit of a row alike, which leaves the entropy unchanged: h itself serves
    log_weight = getattr(negative_log_weight, 'log_weight', negative_log_weight)
    inv_tau = passes.per_row(inv_tau, anchors)
    with autocast_disabled(anchors.device):
        positive = _positives(anchors, candidates, ref_anchors, ref_candidates, offset)
        stats = None
        for c0, tile, log_w, _ in _tiles(anchors, candidates, ref_anchors, ref_candidates, offset, tile_size,
                                         log_weight):
            tile_stats = passes.row_entropy_statistics(tile, inv_tau, log_w, offset - c0, positive)
            stats = tile_stats if stats is None else passes.merge(stats, tile_stats)
    lse, mean_logit = stats
    return lse - mean_logit
