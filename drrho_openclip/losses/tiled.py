"""A tiled, memory-linear drop-in for the untiled aggregation `dense.dense_aggregate` (same contract, same result).

`dense.dense_aggregate` materialises b×B matrices (the similarities, the logits, the gradient in backward), so the
loss needs O(b·B) memory: at a global batch of 65 536 on one device that is 16 GiB per
float32 matrix. The function here computes the same value and the same gradients while never holding more than a
b×T block of any pairwise matrix (T = `tile_size` columns):

- forward: a streaming (online) log-sum-exp over column tiles of the candidates, with a running row maximum and a
  running rescaled sum, as in FlashAttention. Only the [b] results and the inputs are kept for backward.
- backward: every tile is recomputed and its softmax weights p_ij = exp(logit_ij − lse_i) (times the upstream
  gradient) are turned into the tile's contribution to the gradients of the anchors, of the candidates and, should
  they require it, of the reference features. The derivative in `inv_tau` (scalar or per row), Σ_j p_ij ℓ̂_ij, is
  accumulated in the forward pass when `inv_tau` requires a gradient (`dense.linear_in_inv_tau`).

Memory is O((b + B)·d + b·T); the arithmetic is the untiled one plus one recomputation of the similarities.

Use it with the core:

    loss = create_loss('drrho', num_samples=n)
    loss.aggregate = make_tiled_aggregate(DEFAULT_TILE_SIZE)

Negative log-weights (`negative_log_weight`, e.g. ADNCE-style hardness weights) are supported under a contract,
since the full row never exists:

- a plain callable `negative_log_weight(sim, positive_mask) -> log w` is called once per tile (in forward and again
  in backward) with the tile's [b, T] similarities (detached) and the matching slice of the positive mask. It must
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

from .dense import linear_in_inv_tau
from .precision import autocast_disabled, elementwise_dtype, product, without_autocast

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
# Small tiles pay a per-tile cost (~20 small kernels per tile, each an OpenMP region, which is what hurts on an
# oversubscribed 2-core machine); beyond ~1024 columns time is flat while the b×T blocks (a few alive at once,
# 4·b·T bytes each) keep growing. 1024 is the smallest tile on the time plateau. On a GPU, larger tiles (4096–8192)
# keep kernels busier; the value is a per-run choice (`make_tiled_aggregate(tile_size)`), not part of the
# loss's definition.
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
        negatives = h.masked_fill(positive_mask, float('-inf'))
        log_mean = torch.logsumexp(negatives, dim=1, keepdim=True) - math.log(sim.shape[1] - 1)
        return h - log_mean

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


class _TiledLogMeanExpRows(torch.autograd.Function):

    @staticmethod
    def _tile_logits(a, c_tile, inv_tau_col, s_pos, ref_a, rc_tile, r_pos, c0, offset, log_weight, keep_ell,
                     keep_log_w=False):
        """The tile's logits ℓ̂_ij·inv_tau_i + log w_ij (positives at −inf); ℓ̂_ij too if `keep_ell`, and
        the log-weights (positives at −inf) if `keep_log_w`."""
        sim = product(a, c_tile.T)
        b, t = sim.shape
        # anchor i's positive, candidate offset + i, is the tile's column i + offset − c0: a diagonal of the block
        # (empty when the tile holds no positives), set without indices or a host round trip
        positives = offset - c0
        log_w = None
        if log_weight is not None:
            mask = torch.zeros(b, t, dtype=torch.bool, device=a.device)
            mask.diagonal(positives).fill_(True)
            log_w = log_weight(sim, mask).to(sim.dtype).expand(b, t)  # a broadcastable result is fine
            ell = sim - s_pos[:, None]   # not in place: log_w may be a view of sim
        else:
            ell = sim.sub_(s_pos[:, None])
        del sim
        if ref_a is not None:
            ref_sim = product(ref_a, rc_tile.T)
            ref_sim.sub_(r_pos[:, None])
            ell.sub_(ref_sim)
            del ref_sim
        logits = ell * inv_tau_col if keep_ell else ell.mul_(inv_tau_col)
        if log_w is not None:
            logits.add_(log_w)
            if keep_log_w:  # a copy of its own: log_w may be an expanded view of anything
                log_w = torch.empty_like(logits).copy_(log_w)
                log_w.diagonal(positives).fill_(float('-inf'))
            else:
                log_w = None
        logits.diagonal(positives).fill_(float('-inf'))
        return logits, (ell if keep_ell else None), log_w

    @staticmethod
    def forward(ctx, anchors, candidates, inv_tau, ref_anchors, ref_candidates, offset, tile_size,
                negative_log_weight, with_slope):
        with autocast_disabled(anchors.device):
            out, lse, s_pos, r_pos, slope = _stream_rows(anchors, candidates, inv_tau, ref_anchors, ref_candidates,
                                                         offset, tile_size, negative_log_weight,
                                                         accumulate_dot='slope' if with_slope else None)
        log_weight = negative_log_weight
        if isinstance(negative_log_weight, RowNormalizedLogWeight):
            log_weight = negative_log_weight.log_weight  # its normaliser is a constant of the graph
        ctx.save_for_backward(anchors, candidates, inv_tau, ref_anchors, ref_candidates, s_pos, r_pos, lse)
        ctx.offset, ctx.tile_size, ctx.log_weight = offset, tile_size, log_weight
        ctx.mark_non_differentiable(slope)
        return out, slope

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad_out, _grad_slope):
        anchors, candidates, inv_tau, ref_anchors, ref_candidates, s_pos, r_pos, lse = ctx.saved_tensors
        offset, tile_size, log_weight = ctx.offset, ctx.tile_size, ctx.log_weight
        need_a, need_c, _, need_ra, need_rc = ctx.needs_input_grad[:5]
        dtype = elementwise_dtype(anchors.dtype)
        b, num_candidates = anchors.shape[0], candidates.shape[0]
        inv_tau_col = inv_tau.to(dtype).reshape(-1, 1)
        grad_out = grad_out.to(dtype)
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[:, None]

        def zeros(like):  # gradients accumulate in the elementwise dtype, whatever the features'
            return torch.zeros(like.shape, dtype=dtype, device=like.device)

        grad_a = zeros(anchors) if need_a else None
        grad_c = zeros(candidates) if need_c else None
        grad_ra = zeros(ref_anchors) if need_ra else None
        grad_rc = zeros(ref_candidates) if need_rc else None
        weight_rows = torch.zeros(b, dtype=dtype, device=anchors.device)  # Σ_j w_ij, for the positive term

        for c0 in range(0, num_candidates, tile_size):
            c1 = min(c0 + tile_size, num_candidates)
            c_tile = candidates[c0:c1]
            rc_tile = ref_candidates[c0:c1] if ref_candidates is not None else None
            logits, _, _ = _TiledLogMeanExpRows._tile_logits(
                anchors, c_tile, inv_tau_col, s_pos, ref_anchors, rc_tile, r_pos, c0, offset, log_weight,
                keep_ell=False)
            # w_ij = ∂out_i/∂logit_ij · grad_out_i (0 at the positive); the normaliser of
            # RowNormalizedLogWeight is a constant, so the softmax is the same either way
            w = logits.sub_(lse_safe).exp_().mul_(grad_out[:, None])
            del logits
            weight_rows += w.sum(1)
            g = w.mul_(inv_tau_col)  # ∂/∂s_ij of out_i for j ≠ positive (in place: w is no longer needed)
            # the products with the features run in the features' dtype (16-bit: on the tensor cores)
            if need_a:
                grad_a += product(g.to(c_tile.dtype), c_tile)
            if need_c:
                grad_c[c0:c1] = product(g.T.to(anchors.dtype), anchors)
            if need_ra:
                grad_ra -= product(g.to(rc_tile.dtype), rc_tile)
            if need_rc:
                grad_rc[c0:c1] = -product(g.T.to(ref_anchors.dtype), ref_anchors)
            del g

        # ℓ̂_ij subtracts s_ii (and adds s^ref_ii) for every j: those terms receive −inv_tau_i Σ_j w_ij (resp. +)
        coef = (inv_tau_col * weight_rows[:, None])
        pos = slice(offset, offset + b)
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
        return grads[0], grads[1], None, grads[2], grads[3], None, None, None, None


def _stream_rows(anchors, candidates, inv_tau, ref_anchors, ref_candidates, offset, tile_size, negative_log_weight,
                 accumulate_dot=None):
    """One streaming pass over the column tiles: (log g, log Σ_{j≠i} exp(logit_ij), s_ii, s^ref_ii, slope) of every
    row, p being the row's softmax over its negatives; `accumulate_dot` 'slope': slope_i = Σ_j p_ij ℓ̂_ij (= ∂ log
    g_i/∂inv_tau_i; empty otherwise); 'entropy': only the entropy −Σ_j p_ij log p_ij of every row."""
    dtype = elementwise_dtype(anchors.dtype)
    b, num_candidates = anchors.shape[0], candidates.shape[0]
    normalize = isinstance(negative_log_weight, RowNormalizedLogWeight)
    log_weight = negative_log_weight.log_weight if normalize else negative_log_weight
    inv_tau_col = inv_tau.detach().to(dtype).reshape(-1, 1)  # [b, 1] or [1, 1]
    s_pos = (anchors.to(dtype) * candidates[offset:offset + b].to(dtype)).sum(1)
    r_pos = None
    if ref_anchors is not None:
        r_pos = (ref_anchors.to(dtype) * ref_candidates[offset:offset + b].to(dtype)).sum(1)
    # running max m and running sum Σ exp(logit − m) of every row, and the same for h when normalising; for the
    # entropy the running Σ exp(logit − m)·logit as well, for the slope Σ exp(logit − m)·ℓ̂
    run_max = torch.full((b,), float('-inf'), dtype=dtype, device=anchors.device)
    run_sum = torch.zeros(b, dtype=dtype, device=anchors.device)
    w_max, w_sum, run_dot = run_max.clone(), run_sum.clone(), run_sum.clone()

    def accumulate(m, s, x, dot=None, values=None):
        m_new = torch.maximum(m, x.max(dim=1).values)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all −inf so far: no NaN
        rescale = torch.exp(m - m_safe)
        e = torch.exp(x - m_safe[:, None])
        s = s * rescale + e.sum(1)
        if dot is not None:
            if values is None:  # the positive's e is 0 and its logit −inf: leave it out of the product
                values = torch.where(e > 0, x, torch.zeros_like(x))
            dot = dot * rescale + (e * values).sum(1)
        return m_new, s, dot

    for c0 in range(0, num_candidates, tile_size):
        c1 = min(c0 + tile_size, num_candidates)
        rc_tile = ref_candidates[c0:c1] if ref_candidates is not None else None
        logits, ell, log_w = _TiledLogMeanExpRows._tile_logits(
            anchors, candidates[c0:c1], inv_tau_col, s_pos, ref_anchors, rc_tile, r_pos, c0, offset,
            log_weight, keep_ell=accumulate_dot == 'slope', keep_log_w=normalize)
        run_max, run_sum, run_dot = accumulate(run_max, run_sum, logits, run_dot if accumulate_dot else None, ell)
        if normalize:
            w_max, w_sum, _ = accumulate(w_max, w_sum, log_w)
        del logits, ell, log_w
    lse = run_max + torch.log(run_sum)  # log Σ_{j≠i} exp(logit_ij): what backward's softmax needs
    if normalize:
        out = lse - (w_max + torch.log(w_sum))
    else:
        out = lse - math.log(num_candidates - 1)
    if accumulate_dot == 'entropy':
        # H_i = lse_i − Σ_j p_ij logit_ij; normalising h shifts every logit of a row alike, which leaves H unchanged
        return lse - run_dot / run_sum
    slope = lse.new_empty(0)
    if accumulate_dot == 'slope':  # a row with no weight anywhere has no slope
        slope = torch.where(run_sum > 0, run_dot / run_sum, torch.zeros_like(run_sum))
    return out, lse, s_pos, r_pos, slope


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
    inv_tau = torch.as_tensor(inv_tau, device=anchors.device)
    _check_inputs(anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, tile_size)
    log_g, slope = _TiledLogMeanExpRows.apply(anchors, candidates, inv_tau.detach(), ref_anchors, ref_candidates,
                                              int(offset), tile_size, negative_log_weight, inv_tau.requires_grad)
    return linear_in_inv_tau(log_g, slope, inv_tau.to(log_g.dtype))


def tiled_aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference=None,
                    negative_log_weight=None, *, tile_size: int = DEFAULT_TILE_SIZE):
    """`dense.dense_aggregate`, both directions tiled (the contract in `dense.py`'s docstring)."""
    ref_image, ref_text, all_ref_image, all_ref_text = reference if reference is not None else (None,) * 4
    return (tiled_log_mean_exp_rows(image, all_text, offset, inv_tau_image, ref_image, all_ref_text,
                                    negative_log_weight, tile_size=tile_size),
            tiled_log_mean_exp_rows(text, all_image, offset, inv_tau_text, ref_text, all_ref_image,
                                    negative_log_weight, tile_size=tile_size))


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
    with autocast_disabled(anchors.device):
        return _stream_rows(anchors, candidates, inv_tau, ref_anchors, ref_candidates, int(offset), tile_size,
                            negative_log_weight, accumulate_dot='entropy')
