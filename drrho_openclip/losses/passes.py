"""The passes over a block of the pairwise matrix that both aggregations run, `dense.py` on a whole b×B row block and
`tiled.py` on its b×T column tiles.

A block holds d_ij = s_ij − s^ref_ij (or s_ij without a reference) of b anchors and some candidates; anchor i's
positive sits at column offset + i of the block, which may lie outside it (a tile without the positives). Its logits
are ℓ̂_ij·inv_tau_i [+ log w_ij], ℓ̂_ij = d_ij − d_ii, −inf at the positive; p_i is their softmax over the negatives.

These are plain torch functions: on CUDA, TorchInductor compiles each call site (`fused`) into a few kernels that
stream the block (a reduction pass forward, one pass backward) instead of one kernel per operation, each reading and
writing a b×B float32 matrix; on the CPU they run eagerly, in place where they can. Around them, what both
aggregations share: 1/τ as one constant per anchor (`per_row`), the result made differentiable in 1/τ through its
slope (`linear_in_inv_tau`), and the entry points that run either aggregation's autograd function
(`log_mean_exp_rows_with`, `aggregate_with`).
"""
import functools
import importlib.util
import os
import warnings

import torch

from .precision import autocast_disabled, elementwise_dtype


def per_row(inv_tau, features: torch.Tensor) -> torch.Tensor:
    """1/τ (a number, 0-dim, [1] or [b]) as one constant per anchor [b], detached, in the elementwise dtype of
    `features`."""
    inv_tau = torch.as_tensor(inv_tau, dtype=elementwise_dtype(features.dtype), device=features.device)
    return inv_tau.detach().expand(features.shape[0]).contiguous()


def positive_mask(num_anchors: int, num_candidates: int, offset: int, device) -> torch.Tensor:
    """[b, T] boolean mask of each anchor's own pair, which sits at column offset + i (a comparison of indices,
    which a compiled pass computes in its kernel instead of reading a b×T tensor; no column when it lies outside)."""
    rows = torch.arange(num_anchors, device=device)[:, None]
    return torch.arange(num_candidates, device=device) == rows + offset


def set_positives(block: torch.Tensor, offset: int, value) -> torch.Tensor:
    """`block` [b, T] with `value` (a number, or one per row [b]) at each anchor's positive, column offset + i.
    Compiled, a `where` on the index comparison, which the kernel evaluates as it streams the block; eager, the
    entries written in place (a b×T mask and a copy would be two more passes over the block on the CPU)."""
    if torch.compiler.is_compiling():
        value = value[:, None] if torch.is_tensor(value) else value
        return torch.where(positive_mask(*block.shape, offset, block.device), value, block)
    positives = block.diagonal(offset)
    positives.copy_(value) if torch.is_tensor(value) else positives.fill_(value)
    return block


def negative_logits(block, inv_tau, log_w, offset, positive, overwrite=False):
    """[b, T] ℓ̂_ij·inv_tau_i (+ log w_ij), −inf at the positives. `positive`: d_ii [b], or None when the positives
    are in the block (its diagonal at `offset`). With `overwrite` (a block read by nothing afterwards, `positive`
    given, `log_w` not a view of it) the eager pass writes the logits into the block instead of a second b×T matrix;
    compiled, the kernel streams the block either way."""
    if overwrite and not torch.compiler.is_compiling():
        logits = block.mul_(inv_tau[:, None]).add_((-positive * inv_tau)[:, None])  # addcmul's arithmetic
    else:
        positive = block.diagonal(offset) if positive is None else positive
        logits = torch.addcmul((-positive * inv_tau)[:, None], block, inv_tau[:, None])
    if log_w is not None:
        logits += log_w
    return set_positives(logits, offset, float('-inf'))


def safe_lse(lse):
    """A row's log-sum-exp where it is finite, 0 where the row has no weight at all (all −inf): subtracting it then
    gives weights 0, not NaN."""
    return torch.nan_to_num(lse, nan=0.0, posinf=0.0, neginf=0.0)  # one op (isfinite is six, eager)


def softmax_(logits, lse):
    """The logits' softmax rows, in place, given their log-sum-exp (of these logits, or of the whole row a tile is
    part of)."""
    return logits.sub_(safe_lse(lse)[:, None]).exp_()


def row_statistics(block, inv_tau, log_w, offset, positive, with_slope):
    """(lse_i, Σ_j p_ij, Σ_j p_ij ℓ̂_ij) of every row of the block, p_i the softmax of its logits. Σ_j p_ij is 1 up to
    rounding (0 for an all −inf row); backward uses the computed sum, so that each row's gradient sums to zero, as
    ℓ̂'s invariance to adding a constant to d's row says it must. The slope only `with_slope` (zeros otherwise)."""
    positive = block.diagonal(offset) if positive is None else positive
    logits = negative_logits(block, inv_tau, log_w, offset, positive)
    lse = torch.logsumexp(logits, dim=1)
    p = softmax_(logits, lse)
    weight = p.sum(dim=1)
    if not with_slope:
        return lse, weight, torch.zeros_like(lse)
    # Σ_j p_ij ℓ̂_ij = Σ_j p_ij d_ij − d_ii Σ_j p_ij (whatever the log-weights)
    return lse, weight, p.mul_(block).sum(dim=1) - positive * weight


def row_entropy_statistics(block, inv_tau, log_w, offset, positive):
    """(lse_i, Σ_j p_ij logit_ij) of every row: its entropy is lse − Σ_j p_ij logit_ij."""
    logits = negative_logits(block, inv_tau, log_w, offset, positive)
    lse = torch.logsumexp(logits, dim=1)
    finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))  # p is 0 where logits are −inf
    return lse, (softmax_(logits, lse) * finite).sum(dim=1)


def row_gradient(block, inv_tau, log_w, offset, positive, lse, scale, overwrite=False):
    """∂ Σ_i upstream_i log g_i / ∂d over the block's negatives, scale_i = upstream_i·inv_tau_i: scale_i p_ij, 0 at
    the positives (whose entry, −scale_i Σ_j p_ij over the whole row, the caller adds). `lse` is the whole row's.
    `overwrite`: as for `negative_logits`, the gradient takes the block's place."""
    logits = negative_logits(block, inv_tau, log_w, offset, positive, overwrite)
    return softmax_(logits, lse).mul_(scale[:, None])


def merge(total, part):
    """The running (lse, Σ p·x, ...) of every row over the tiles so far, and one more tile's: the same of both, the
    sums re-weighted to the joint softmax (each tile's p is its own softmax: p_joint = p_tile·exp(lse_tile − lse))."""
    lse = torch.logaddexp(total[0], part[0])
    to_joint = [torch.exp(stats[0] - safe_lse(lse)) for stats in (total, part)]
    return (lse, *(a * to_joint[0] + b * to_joint[1] for a, b in zip(total[1:], part[1:])))


def linear_in_inv_tau(value: torch.Tensor, slope: torch.Tensor, inv_tau: torch.Tensor) -> torch.Tensor:
    """`value` (computed with 1/τ detached) made differentiable in `inv_tau` through its derivative `slope` there:
    value + slope·(inv_tau − inv_tau.detach()) adds exactly zero. A gradient with respect to τ alone, which a learned
    temperature takes inside every forward call for its own step, then costs O(b) instead of a second backward pass
    over the b×B matrices; the training backward gets the same τ-gradient as from the full expression."""
    if not inv_tau.requires_grad:
        return value
    return value + slope * (inv_tau - inv_tau.detach())


def _rows_with(function, anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, negative_log_weight,
               *options):
    """(log g, the pairwise matrix d it was computed from or None) of `log_mean_exp_rows_with`'s arguments."""
    inv_tau = torch.as_tensor(inv_tau, device=anchors.device)
    with autocast_disabled(anchors.device):
        log_g, slope, _, _, *kept = function.apply(anchors, candidates, ref_anchors, ref_candidates,
                                                   per_row(inv_tau, anchors), None, negative_log_weight, int(offset),
                                                   inv_tau.requires_grad, *options)
    return linear_in_inv_tau(log_g, slope, inv_tau.to(log_g.dtype)), (kept[0] if kept else None)


def log_mean_exp_rows_with(function, anchors, candidates, offset, inv_tau, ref_anchors=None, ref_candidates=None,
                           negative_log_weight=None, *options) -> torch.Tensor:
    """log g of the anchors over the candidates through an aggregation's autograd `function` (dense or tiled, given
    its own `options` after the common arguments), differentiable in `inv_tau` (a number, 0-dim, [1] or [b])."""
    return _rows_with(function, anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates,
                      negative_log_weight, *options)[0]


def aggregate_with(function, image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference,
                   negative_log_weight, *options):
    """The `aggregate` contract (`dense.py`'s docstring) through an aggregation's autograd `function`: each direction
    on its own; or, when the anchors are the whole batch (one process), both from one pass over one matrix, the text
    direction's being the transpose of the image direction's. Returns (log g image, log g text, pairs): `pairs` =
    (d of the image anchors' rows, d of the text anchors' rows), each [b, B] and differentiable, where `function`
    keeps its whole matrix (the dense one; the second a transposed view of the first in one process), else None."""
    ref_image, ref_text, all_ref_image, all_ref_text = reference if reference is not None else (None,) * 4
    if not (image is all_image and text is all_text):
        log_g_image, pairs_image = _rows_with(function, image, all_text, offset, inv_tau_image, ref_image,
                                              all_ref_text, negative_log_weight, *options)
        log_g_text, pairs_text = _rows_with(function, text, all_image, offset, inv_tau_text, ref_text, all_ref_image,
                                            negative_log_weight, *options)
        return log_g_image, log_g_text, (None if pairs_image is None else (pairs_image, pairs_text))
    inv_tau_image, inv_tau_text = (torch.as_tensor(t, device=image.device) for t in (inv_tau_image, inv_tau_text))
    with autocast_disabled(image.device):
        log_g_image, slope_image, log_g_text, slope_text, *kept = function.apply(
            image, text, ref_image, ref_text, per_row(inv_tau_image, image), per_row(inv_tau_text, text),
            negative_log_weight, int(offset), inv_tau_image.requires_grad or inv_tau_text.requires_grad, *options)
    return (linear_in_inv_tau(log_g_image, slope_image, inv_tau_image.to(log_g_image.dtype)),
            linear_in_inv_tau(log_g_text, slope_text, inv_tau_text.to(log_g_text.dtype)),
            (kept[0], kept[0].T) if kept else None)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    # not fullgraph: a process that calls with more configurations than dynamo's recompile limit (a benchmark of
    # every loss, not a training run) then runs the rest eagerly instead of failing; sizes become dynamic after
    # the first change, so a run's shapes compile at most twice
    return torch.compile(fn)


@functools.lru_cache(maxsize=None)
def compiles_for(device: torch.device) -> bool:
    """Whether the passes are compiled on `device`: a CUDA GPU that TorchInductor's code generator, Triton, supports
    (installed, compute capability 7.0 and up), unless `TORCH_COMPILE_DISABLE=1` turns compilation off; elsewhere
    they run eagerly, with the same results. A GPU too old for Triton (a P100, a K80) gets a warning once instead of
    a failed compilation at the first step."""
    # read as torch reads it: with compilation off the passes run eagerly, and so must what is chosen for eager
    # passes (the log-weights kept, not recomputed; no start-up message about compiling)
    if device.type != 'cuda' or os.environ.get('TORCH_COMPILE_DISABLE', '0') == '1':
        return False
    capability = torch.cuda.get_device_capability(device)
    if importlib.util.find_spec('triton') is not None and capability >= (7, 0):
        return True
    why = 'Triton is not installed' if capability >= (7, 0) else \
        f"Triton needs compute capability 7.0 or more, this GPU has {capability[0]}.{capability[1]}"
    warnings.warn(f"drrho-openclip: the loss's passes over the pairwise matrix run eagerly on {device} ({why}): "
                  f"the same results, more memory traffic")
    return False


def fused(fn, block):
    """`fn` as the device runs it best: compiled by TorchInductor on a CUDA GPU it supports (a pass over the block per
    reduction or elementwise chain, instead of one per operation; `TORCH_COMPILE_DISABLE=1` turns it off), eager
    elsewhere (the CPU's own kernels, no compiler needed)."""
    return _compiled(fn) if compiles_for(block.device) else fn
