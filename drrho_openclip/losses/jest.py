"""JEST (Evans et al., 2024), the online batch selection DRRho-CLIP compares with (seed 001 §6.2, C.2).

From a super-batch, JEST keeps the fraction `selection_ratio` with the highest learnability (the learner's loss
minus the reference model's), drawn in `num_chunks` chunks, each conditioned on the chunks drawn before, and trains
with CLIP's loss on that sub-batch only. With L = s·S (learner, s its logit scale) and R = t·S^ref (reference at
its logit scale t: given, or calibrated on the first batch as for distillation, `distill.ReferenceLogitScale`), the
learnability of candidate i given the selected set S is

    chunk 1:    d_i = R_ii − L_ii                                   (the loss of the positive pair alone)
    chunk ≥ 2:  d_i + ½ Σ_dir [log Σ_{j∈S} exp(L^dir_ij) − log Σ_{j∈S} exp(R^dir_ij)]
                = ½ Σ_dir [ℓ_learner(i | S) − ℓ_ref(i | S)],  ℓ(i | S) = −L_ii + log Σ_{j∈S} exp L_ij,

over both directions (image→text rows and text→image columns). Each chunk is drawn without replacement with
probabilities ∝ exp(learnability) (the official code drew the first chunk ∝ d_i − min d, linearly), by the
Gumbel-top-k trick: the chunk's top scores after adding Gumbel noise, which needs no normalised probabilities and
so survives scores spanning thousands. JEST (top-k) takes the top scores without noise from the second chunk on.

Distributed: every rank draws its share of each chunk from its own rows (all ranks then hold equal sub-batches,
as CLIP's gathered loss needs); the set S that later chunks condition on is the global one, gathered after every
chunk (the official code needed torch.distributed even on one process; here one process just skips the gather).
The Gumbel noise is a hash of (seed, rank, selection count, chunk, row), not a draw from torch's global RNG, which
OpenCLIP reseeds at every start: the count is the loss's state, checkpointed, so a resumed run selects as the
uninterrupted one does.

Called as a loss, it receives the super-batch's features (with gradient) and backpropagates CLIP's loss through
the selected rows only; the encoders' backward still runs over the whole super-batch (with zero gradients for the
rest). To save that, a training loop can call `select` on features from a no-grad forward, re-encode the selected
samples with gradient, and apply `self.clip` (CLIP's loss with OpenCLIP's semantics, `clip.py`) to them.
"""
import torch
from torch import nn

from .base import (WINDOW_NOT_OPENED, LastCallMetrics, ReferenceFeatures, check_eval_call, fixed_within_window,
                   keyed_uniform, mix64)
from .clip import ClipLoss
from .collectives import gather_batch
from .distill import ReferenceLogitScale
from .precision import at_least_float32, autocast_disabled


# a draw's key packs (selection count, chunk, row): distinct for every draw of a run on one rank
ROW_BITS, CHUNK_BITS = 24, 6
MAX_CHUNKS = 1 << CHUNK_BITS


class JESTLoss(ReferenceFeatures, LastCallMetrics, nn.Module):

    def __init__(self, selection_ratio: float = 0.2, num_chunks: int = 2, topk: bool = False,
                 reference_logit_scale='auto', local_loss: bool = True, gather_with_grad: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1):
        super().__init__()
        if not 0 < selection_ratio <= 1:
            raise ValueError(f"JEST's selection_ratio must be in (0, 1], got {selection_ratio}")
        if not 1 <= num_chunks <= MAX_CHUNKS:
            raise ValueError(f"JEST's num_chunks must be 1 to {MAX_CHUNKS}, got {num_chunks}")
        self.selection_ratio = selection_ratio
        self.num_chunks = num_chunks
        self.topk = topk
        self.reference_logit_scale = ReferenceLogitScale(reference_logit_scale, world_size)
        self.world_size = world_size
        self.clip = ClipLoss(local_loss=local_loss, gather_with_grad=gather_with_grad, rank=rank,
                             world_size=world_size)
        # the selections made so far, a key of every draw's noise; the seed and rank key this run's and rank's
        self.register_buffer('selections', torch.zeros((), dtype=torch.int64))
        self._stream = mix64(torch.tensor(((seed % (1 << 31)) << 32) + rank)).item()
        self._window = None  # the accumulation window's selection
        self._last = {}

    def chunk_sizes(self, super_batch: int) -> list:
        """This rank's draws per chunk."""
        if super_batch > 1 << ROW_BITS:  # the rows a draw's key holds
            raise ValueError(f"JEST draws among at most {1 << ROW_BITS} rows per rank, got a super-batch of "
                             f"{super_batch}")
        selected = round(super_batch * self.selection_ratio)
        if selected < max(self.num_chunks, 2):
            raise ValueError(f"JEST keeps {selected} of a super-batch of {super_batch} per rank, fewer than "
                             f"{max(self.num_chunks, 2)}: raise --batch-size or selection_ratio, or lower num_chunks")
        return [len(c) for c in torch.arange(selected).tensor_split(self.num_chunks)]

    def _gumbel(self, scores, chunk: int):
        """Gumbel noise for this rank's rows in `chunk` of the current selection (at most 2^ROW_BITS rows:
        `chunk_sizes`)."""
        rows = torch.arange(len(scores), device=scores.device)
        keys = (self.selections << (ROW_BITS + CHUNK_BITS)) + (chunk << ROW_BITS) + rows + self._stream
        uniform = keyed_uniform(keys) + 2.0 ** -53  # in (0, 1): both logs finite
        return -torch.log(-torch.log(uniform)).to(scores.dtype)

    @torch.no_grad()
    def select(self, image_features, text_features, logit_scale, ref_image_features, ref_text_features):
        """This rank's rows of the sub-batch (a [b · selection_ratio] index into its super-batch rows)."""
        with autocast_disabled(image_features.device):  # the scores in float32, not in autocast's 16-bit products
            features = [at_least_float32(f) for f in
                        (image_features, text_features, ref_image_features, ref_text_features)]
            image, text, ref_image, ref_text = features
            s = at_least_float32(torch.as_tensor(logit_scale)).detach()
            t = self.reference_logit_scale(ref_image, ref_text).to(image.dtype)
            diagonal = t * (ref_image * ref_text).sum(1) - s * (image * text).sum(1)
            # log Σ_{j∈S} exp of: learner image→text, learner text→image, reference image→text, reference
            # text→image
            lse = torch.full((4, image.shape[0]), float('-inf'), dtype=image.dtype, device=image.device)
            available = torch.ones(image.shape[0], dtype=torch.bool, device=image.device)
            sizes = self.chunk_sizes(image.shape[0])
            picks = []
            for chunk, size in enumerate(sizes):
                scores = diagonal if chunk == 0 else diagonal + (lse[0] - lse[2] + lse[1] - lse[3]) / 2
                if chunk == 0 or not self.topk:
                    scores = scores + self._gumbel(scores, chunk)
                pick = scores.masked_fill(~available, float('-inf')).topk(size).indices
                picks.append(pick)
                if chunk + 1 < len(sizes):
                    # not `available[pick] = False`: torch makes that False on the host, and copying it to an
                    # accelerator waits for the device
                    available.index_fill_(0, pick, False)
                    # the chunk just drawn, on every rank, joins the set the next chunks are conditioned on
                    dims = [f.shape[1] for f in features]
                    new = gather_batch(torch.cat([f[pick] for f in features], dim=1), self.world_size, with_grad=False,
                                       device=image.device)
                    new_image, new_text, new_ref_image, new_ref_text = new.split(dims, dim=1)
                    lse = torch.logaddexp(lse, torch.stack([
                        (s * image @ new_text.T).logsumexp(1), (s * text @ new_image.T).logsumexp(1),
                        (t * ref_image @ new_ref_text.T).logsumexp(1), (t * ref_text @ new_ref_image.T).logsumexp(1)]))
            selected = torch.cat(picks)
            self.selections += 1
            # for metrics(): the fraction kept, the learner's extra forward compute relative to a step on the kept
            # sub-batch alone (b_super/b_sub − 1), and the mean first-chunk learnability of all and of the kept
            self._last = {'selection_rate': len(selected) / image.shape[0],
                          'extra_forward_fraction': image.shape[0] / len(selected) - 1,
                          'learnability_mean': diagonal.mean(), 'learnability_selected_mean': diagonal[selected].mean()}
            return selected

    def forward(self, image_features, text_features, logit_scale, ref_image_features=None, ref_text_features=None,
                accum_step=None, output_dict=False, **_):
        check_eval_call(self, accum_step)
        if not self.training:
            # selection is how JEST trains, like dropout: evaluation scores the whole batch with CLIP's loss and
            # draws nothing (the selection count, a key of the draws, stays where training left it)
            return self.clip(image_features, text_features, logit_scale, output_dict=output_dict)
        self.require_reference(ref_image_features, ref_text_features, "scores learnability with the reference model")
        if accum_step:
            # a later call on the same window: its first call's selection; logit_scale's gradient, which depends
            # only on the window's feature values, came whole with that call
            if self._window is None:
                raise RuntimeError(WINDOW_NOT_OPENED)
            selected, logit_scale = self._window, fixed_within_window(logit_scale, accum_step)
        else:
            selected = self.select(image_features, text_features, logit_scale, ref_image_features, ref_text_features)
            self._window = selected if accum_step is not None else None
        return self.clip(image_features[selected], text_features[selected], logit_scale, output_dict=output_dict)
