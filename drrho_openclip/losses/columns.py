"""One column half-step of the DRO core's shifted logits, each anchor's SogCLR estimate as its row's normaliser.

The DRO core normalises each anchor's row of exp(ℓ̂/τ) (its KL-DRO over the candidates). The balanced CLIP loss
(seed 004) follows CLIP's row normalisation by one over the columns, and with the reference shift it beat every
`drrho` setting measured (docs/defaults.md, "The shift inside the balanced loss"). This term gives the DRO the same
second half-step. Per direction, candidate j's column over the global batch's anchors k:

    C_j = τ log (1/B) Σ_k exp(ℓ̂_kj / τ) / (ε + u_k)

ℓ̂_kj being anchor k's shifted pairwise loss against j (the positive k = j included, as in a column of the
balanced loss) and ε + u_k anchor k's row normaliser: its SogCLR estimate, a constant as in SogCLR's weights, where
the balanced loss differentiates through the batch's own row sums. So pair (k, j) gets, beside its row weight, its
column's softmax of exp(ℓ̂_kj/τ)/(ε + u_k). τ is a constant here: a learned τ steps on the DRO objective alone.

Layout: candidate j's column is this rank's sample j against every anchor of the global batch, so each rank
computes the columns of its own samples, as rows of a [b, B] matrix whose log-sum-exp runs along the global batch
(like the core's rows), with the gathered estimates. That matrix is one the core's other direction already has: the
image anchors' columns over this rank's texts are the rows of the text anchors' d (text_j·image_k − α ref·ref), and
when one process holds the whole batch the columns of the image anchors' d. With the dense core (`pairs`, its kept
matrices) the step is one more pass over them forward and one backward, whose ∂/∂d joins the core's gradient before
the core's products: no product of its own. With the tiled core (a row block size, its tile size) it multiplies the
features itself, T rows at a time, and recomputes them in backward, so its memory follows the core's.
"""
import math

import torch

from . import passes
from .collectives import gather_batch
from .precision import at_least_float32, autocast_disabled, product, without_autocast


def _joined(features, ref_features, sign):
    """[x, sign·x^ref], so that d = s − α s^ref is one product of rows joined with +1 and columns with −1 (as
    dense.py makes it); x alone without a shift."""
    return features if ref_features is None else torch.cat([features, sign * ref_features], 1)


def _exponents(product_, positives, inv_tau, log_eps_u, dim, in_place=False):
    """(d_jk − d_kk)·inv_tau − log(ε + u_k) for the anchors k along `dim` of the product (d_kk: `positives`); written
    over the product with `in_place` (its last use: one b×B matrix fewer at the peak)."""
    shape = (1, -1) if dim == 1 else (-1, 1)
    out = product_ if in_place else product_.clone()
    return out.sub_(positives.view(shape)).mul_(inv_tau).sub_(log_eps_u.view(shape))


# the passes over d, compiled on CUDA as the core's are (passes.fused): forward's log-sum-exps, backward's gradient;
# with `in_place` they overwrite d (eager, a product of the step's own, dropped after), else d is only read (the
# core's d; and compiled, where an overwritten input would be written back to memory for nothing)

def _log_sums(d, positives, inv_tau, log_eps_u, transposed, in_place):
    """log Σ_k of each row's exponents, and with `transposed` = (inv_tau, log ε + u) of each column's over its rows."""
    if transposed is None:
        return (torch.logsumexp(_exponents(d, positives, inv_tau, log_eps_u, 1, in_place), dim=1),)
    rows = torch.logsumexp(_exponents(d, positives, inv_tau, log_eps_u, 1), dim=1)
    return rows, torch.logsumexp(_exponents(d, positives, *transposed, 0, in_place), dim=0)


def _softmaxes(d, positives, inv_tau, log_eps_u, transposed, lse, upstream, offset, in_place):
    """Row j's softmax times upstream_j·inv_tau, and with `transposed` column k's times upstream_k·inv_tau_k (else
    None): ∂/∂d of the rows' and of the columns' log-sum-exps, each d_jk − d_kk of a row subtracting the positive of
    its column (d_kk, `positives`), of a column the positive of its row. Row j's own pair (column offset + j) gets 0:
    its exponent d_jj − d_jj is constant, and its two equal and opposite terms (often d's largest gradient entries)
    would otherwise cancel only after rounding."""
    rows = _exponents(d, positives, inv_tau, log_eps_u, 1, in_place and transposed is None)
    rows = passes.set_positives(rows.sub_(lse[0][:, None]).exp_().mul_((upstream[0] * inv_tau)[:, None]), offset, 0.0)
    if transposed is None:
        return rows, None
    columns = _exponents(d, positives, *transposed, 0, in_place)
    columns = passes.set_positives(columns.sub_(lse[1][None, :]).exp_().mul_((upstream[1] * transposed[0])[None, :]),
                                   offset, 0.0)
    return rows, columns


def _positives_gradient(*softmaxes_args):
    """∂/∂positives: minus each column's sum of the rows' part, and each row's sum of the columns' part."""
    rows, columns = _softmaxes(*softmaxes_args)
    return -rows.sum(0) if columns is None else -rows.sum(0) - columns.sum(1)


def _pairs_gradient(*softmaxes_args, dtype):
    """∂/∂d in `dtype`."""
    rows, columns = _softmaxes(*softmaxes_args)
    return (rows if columns is None else rows + columns).to(dtype)


def _gradient(d, *softmaxes_args, dtype):
    """(∂/∂d in `dtype`, ∂/∂positives). Eagerly from one evaluation of the softmaxes. Compiled, one function that
    returns both keeps the two softmaxes as b×B buffers (each read by a reduction and by the gradient), so the two
    are separate functions there, keeping only the gradient at the price of one more read of d."""
    if passes.compiles_for(d.device):
        return (passes.fused(_pairs_gradient, d)(d, *softmaxes_args, dtype=dtype),
                passes.fused(_positives_gradient, d)(d, *softmaxes_args))
    rows, columns = _softmaxes(d, *softmaxes_args)
    positives = -rows.sum(0)
    if columns is not None:
        positives = positives - columns.sum(1)
        rows.add_(columns)
    return rows.to(dtype), positives


class _ColumnLogSumExp(torch.autograd.Function):
    """Per row j of d: log Σ_k exp((d_jk − d_kk)·inv_tau − log(ε + u_k)) over the candidates k; with `transposed` =
    (inv_tau, log ε + u) of the other direction, also per column of d, over its rows (one process: the other
    direction's matrix is dᵀ, its anchors d's rows). Row j's own pair is column offset + j. d is either `pairs`, a
    matrix the dense core already holds, read and never written (backward returns ∂/∂d in d's dtype, which the core
    adds to its own gradient of d before its products with the features), or, with `pairs` None, rows·candidatesᵀ,
    multiplied here and again in backward (the step keeps no b×B matrix; backward returns the features' gradients).
    Differentiable in those and in the positives."""

    @staticmethod
    def forward(ctx, rows, candidates, pairs, positives, inv_tau, log_eps_u, transposed, offset):
        own = pairs is None
        with autocast_disabled(positives.device):
            d = product(rows, candidates.T) if own else pairs
            in_place = own and not passes.compiles_for(d.device)
            out = passes.fused(_log_sums, d)(d, positives, inv_tau, log_eps_u, transposed, in_place)
        ctx.save_for_backward(rows, candidates, pairs, positives, *out)
        ctx.inv_tau, ctx.log_eps_u, ctx.transposed, ctx.offset = inv_tau, log_eps_u, transposed, offset
        return out if transposed is not None else out[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, *upstream):
        rows, candidates, pairs, positives, *lse = ctx.saved_tensors
        own = pairs is None
        d = product(rows, candidates.T) if own else pairs
        in_place = own and not passes.compiles_for(d.device)
        grad, grad_positives = _gradient(d, positives, ctx.inv_tau, ctx.log_eps_u, ctx.transposed, lse, upstream,
                                         ctx.offset, in_place, dtype=rows.dtype if own else d.dtype)
        del d
        features = ((product(grad, candidates).to(rows.dtype), product(grad.T, rows).to(candidates.dtype)) if own
                    else (None, None))
        return (*features, None if own else grad, grad_positives, None, None, None, None)


def _log_column_sums(rows, candidates, positives, inv_tau, log_eps_u, offset, block_rows):
    """`_ColumnLogSumExp` of all rows, `block_rows` at a time (0: all at once)."""
    if not block_rows or block_rows >= rows.shape[0]:
        return _ColumnLogSumExp.apply(rows, candidates, None, positives, inv_tau, log_eps_u, None, offset)
    return torch.cat([_ColumnLogSumExp.apply(block, candidates, None, positives, inv_tau, log_eps_u, None,
                                             offset + start)
                      for start, block in zip(range(0, rows.shape[0], block_rows), rows.split(block_rows))])


def column_step(image, text, all_image, all_text, shift, tau_image, tau_text, log_u_image, log_u_text, log_eps,
                world_size, offset=0, rows=0, pairs=None):
    """[b]: for each of this rank's samples, the image anchors' column of its text plus the text anchors' column of
    its image (C_j above, each with its direction's τ and u). `shift`: the α-scaled reference features (ref_image,
    ref_text, all_ref_image, all_ref_text) or None; `log_u_*`: this rank's anchors' log u; `log_eps`: log ε;
    `offset`: this rank's first sample in the global batch. `pairs`: the dense core's (d of the image anchors' rows,
    d of the text anchors' rows) of the same features and shift (`dense_aggregate(keep_pairs=True)`), read instead of
    multiplying the features; else `rows` > 0 multiplies them that many rows at a time."""
    if tau_image.dim() or tau_text.dim():
        raise ValueError("the column step needs a global temperature (each column mixes every anchor's τ)")
    device = image.device
    positives = (at_least_float32(all_image) * at_least_float32(all_text)).sum(1)
    ref_image, ref_text, all_ref_image, all_ref_text = shift if shift is not None else (None,) * 4
    if shift is not None:
        positives = positives - (at_least_float32(all_ref_image) * at_least_float32(all_ref_text)).sum(1)

    def log_eps_u(log_u):
        log_u = gather_batch(log_u, world_size, with_grad=False, device=device)
        return torch.logaddexp(log_u, torch.full_like(log_u, log_eps))

    inv_tau_image, inv_tau_text = 1 / tau_image.detach(), 1 / tau_text.detach()
    # the image anchors k against this rank's texts j: rows j, d_jk = text_j·image_k − α ref_text_j·ref_image_k
    if pairs is not None and world_size == 1:
        # the image anchors' d_ik (rows: this process's images) is the text anchors' d transposed: its rows are the
        # text anchors' columns, its columns the image anchors'
        over_texts, over_images = _ColumnLogSumExp.apply(
            None, None, pairs[0], positives, inv_tau_text, log_eps_u(log_u_text),
            (inv_tau_image, log_eps_u(log_u_image)), 0)
    elif pairs is not None:  # the text anchors' rows are this rank's texts against every image anchor, and back
        over_images = _ColumnLogSumExp.apply(None, None, pairs[1], positives, inv_tau_image, log_eps_u(log_u_image),
                                             None, offset)
        over_texts = _ColumnLogSumExp.apply(None, None, pairs[0], positives, inv_tau_text, log_eps_u(log_u_text),
                                            None, offset)
    elif world_size == 1 and not 0 < rows < image.shape[0]:
        # the text anchors' d_ik = image_i·text_k − α ref_image_i·ref_text_k is the same d, transposed
        over_images, over_texts = _ColumnLogSumExp.apply(
            _joined(text, ref_text, 1), _joined(all_image, all_ref_image, -1), None, positives, inv_tau_image,
            log_eps_u(log_u_image), (inv_tau_text, log_eps_u(log_u_text)), 0)
    else:
        over_images = _log_column_sums(_joined(text, ref_text, 1), _joined(all_image, all_ref_image, -1), positives,
                                       inv_tau_image, log_eps_u(log_u_image), offset, rows)
        # the text anchors k against this rank's images i: d_ik = image_i·text_k − α ref_image_i·ref_text_k
        over_texts = _log_column_sums(_joined(image, ref_image, 1), _joined(all_text, all_ref_text, -1), positives,
                                      inv_tau_text, log_eps_u(log_u_text), offset, rows)
    log_batch = math.log(all_image.shape[0])
    return (over_images - log_batch) / inv_tau_image + (over_texts - log_batch) / inv_tau_text
