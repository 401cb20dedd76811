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
(like the core's rows), from the gathered features (with gradient) and the gathered estimates (without). With a row
block size (the tiled core's tile size) the blocks are recomputed in backward, so memory is O(rows × B).
"""
import math

import torch
from torch.utils.checkpoint import checkpoint

from .collectives import gather_batch
from .precision import at_least_float32, similarities


def _joined(features, ref_features, sign):
    """[x, sign·x^ref], so that d = s − α s^ref is one product of rows joined with +1 and columns with −1 (as
    dense.py makes it); x alone without a shift."""
    return features if ref_features is None else torch.cat([features, sign * ref_features], 1)


def _log_column_sums(rows, candidates, positives, inv_tau, log_eps_u):
    """Row j: log Σ_k exp((d_jk − d_kk)·inv_tau − log(ε + u_k)), d between this rank's samples (`rows`) and the
    global batch's (`candidates`), both `_joined`; d_kk = `positives`."""
    return torch.logsumexp((similarities(rows, candidates) - positives) * inv_tau - log_eps_u, dim=1)


def _in_blocks(rows, candidates, positives, inv_tau, log_eps_u, block_rows):
    """`_log_column_sums` of all rows, `block_rows` at a time, each block recomputed in backward (0: all at once)."""
    if not block_rows or block_rows >= rows.shape[0]:
        return _log_column_sums(rows, candidates, positives, inv_tau, log_eps_u)
    return torch.cat([checkpoint(_log_column_sums, block, candidates, positives, inv_tau, log_eps_u,
                                 use_reentrant=False) for block in rows.split(block_rows)])


def column_step(image, text, all_image, all_text, shift, tau_image, tau_text, log_u_image, log_u_text, log_eps,
                world_size, rows=0):
    """[b]: for each of this rank's samples, the image anchors' column of its text plus the text anchors' column of
    its image (C_j above, each with its direction's τ and u). `shift`: the α-scaled reference features (ref_image,
    ref_text, all_ref_image, all_ref_text) or None; `log_u_*`: this rank's anchors' log u; `log_eps`: log ε."""
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

    tau_image, tau_text = tau_image.detach(), tau_text.detach()
    # the image anchors k against this rank's texts j: rows j, d_jk = text_j·image_k − α ref_text_j·ref_image_k
    over_images = _in_blocks(_joined(text, ref_text, 1), _joined(all_image, all_ref_image, -1), positives,
                             1 / tau_image, log_eps_u(log_u_image), rows)
    # the text anchors k against this rank's images i: d_ik = image_i·text_k − α ref_image_i·ref_text_k
    over_texts = _in_blocks(_joined(image, ref_image, 1), _joined(all_text, all_ref_text, -1), positives,
                            1 / tau_text, log_eps_u(log_u_text), rows)
    log_batch = math.log(all_image.shape[0])
    return tau_image * (over_images - log_batch) + tau_text * (over_texts - log_batch)
