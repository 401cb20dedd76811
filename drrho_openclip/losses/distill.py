"""The knowledge-distillation term of MobileCLIP (Vasu et al., 2024), as used by DRRho-CLIP (seed 001, Eq. 16).

KD = ½ [ mean_i CE(softmax(t·s^ref_i·), log_softmax(s·s_i·)) + the same over texts as anchors ], the teacher being
the reference model at its own logit scale t (the official code's default 100).

Normalisation: Eq. 16 prints 1/|B|² in front of each direction's double sum and adds the two directions. Its λ
values come from the official code, which (like MobileCLIP's and OpenCLIP's DistillClipLoss) averages over the
anchors (1/|B|) and over the two directions (½), so KD is on the scale of CLIP's loss in Eq. 12; we do the same.
λ is KD's share against CLIP's loss, MobileCLIP's (1 − λ)·CLIP + λ·KD, in every loss: a DRO loss, whose term sums n
τ-scaled cross-entropies (two directions; four with the column step), weighs KD by n·τ (core.py). The official code
adds λ_off·τ·KD to its two summed directions, without the 1 − λ: its λ_off is λ = λ_off / (2 + λ_off) here (the
paper's 0.25: 0.11).

The teacher's logit scale t: a number (a CLIP reference's own, e.g. 100), or 'auto' (`ReferenceLogitScale`): the t at
which the reference's own in-batch predictions are calibrated on the training data (`calibrated_logit_scale`). A
teacher's softmax is only as good as its scale: precomputed or imported features carry none, and a reference that is
right on 60 % of its batches but given CLIP's 100 asserts every answer with near certainty, so KD then teaches its
mistakes as hard labels. A CLIP model's learned logit_scale minimises this same in-batch loss on its own training
batches, so on web-scale data at a large batch 'auto' lands near that model's own scale.

Pure torch: anchors are this rank's rows, candidates the global batch, as in the DRO core.
"""
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import KeepsStatePrecision
from .collectives import check_device, gather_batch
from .precision import at_least_float32
from .registry import AUTO
from .temperatures import CHOICE_ANCHORS, first_anchor_similarities, log_bisection

# The loss-state entries of a reference logit scale (`ReferenceLogitScale`; an entry only when 'auto'): KD's teacher
# scale (the core's and MobileCLIP's `teacher_logit_scale`) and JEST's scoring scale (`reference_logit_scale`). It is
# chosen on the first batch, no state of the samples: a resume that adds KD or switches to 'auto' chooses it anew,
# one that drops KD or gives a number leaves it
REFERENCE_SCALE_STATE_KEYS = frozenset({'teacher_logit_scale.value', 'reference_logit_scale.value'})

# The range of an 'auto' teacher scale: CLIP's own bounds on its learned logit_scale (1 at τ = 1; 100, OpenCLIP's clamp)
TEACHER_SCALE_RANGE = (1.0, 100.0)


def check_distill_weight(weight: float) -> float:
    """λ of (1 − λ) · contrastive + λ · KD."""
    if not 0 <= weight <= 1:
        raise ValueError(f"distill_weight λ must be in [0, 1] (0: no distillation), got {weight}")
    return weight


def soft_cross_entropy(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean over rows of −Σ_j softmax(teacher)_ij · log softmax(student)_ij."""
    return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean()


def distillation_loss(anchors, candidates, ref_anchors, ref_candidates, logit_scale, teacher_logit_scale,
                      rows_per_chunk: int = 0):
    """KD of the local (image, text) anchors against the global (image, text) candidates, given as pairs; the
    reference pairs likewise. `logit_scale` is the student's (gradient flows to it), `teacher_logit_scale` a number or
    a 0-dim tensor. `rows_per_chunk` > 0 takes that many anchors at a time and recomputes each chunk's logits in
    backward: memory linear in the batch, as the tiled DRO core's, for the price of a second forward pass."""
    (image, text), (all_image, all_text) = anchors, candidates
    (ref_image, ref_text), (all_ref_image, all_ref_text) = ref_anchors, ref_candidates
    t, s = teacher_logit_scale, logit_scale

    def summed(ref_anchor, all_ref_candidate, anchor, all_candidate, s):  # Σ over the rows, not the mean
        return soft_cross_entropy(t * ref_anchor @ all_ref_candidate.T, s * anchor @ all_candidate.T) * len(anchor)

    def direction(ref_anchor, all_ref_candidate, anchor, all_candidate):
        if not rows_per_chunk or len(anchor) <= rows_per_chunk:
            return summed(ref_anchor, all_ref_candidate, anchor, all_candidate, s)
        return sum(checkpoint(summed, ref_anchor[i:i + rows_per_chunk], all_ref_candidate,
                              anchor[i:i + rows_per_chunk], all_candidate, s, use_reentrant=False)
                   for i in range(0, len(anchor), rows_per_chunk))

    rows = len(image)
    return (direction(ref_image, all_ref_text, image, all_text) + direction(ref_text, all_ref_image, text, all_image)
            ) / (2 * rows)


def distill_from_reference(teacher_logit_scale: nn.Module, features, reference, logit_scale, rows_per_chunk: int = 0):
    """(KD, the teacher's scale) of a loss that adds KD to its own term: `features` = (image, text, all_image,
    all_text), `reference` the same four of the reference model, the student at `logit_scale` (1/τ of the loss), the
    teacher at `teacher_logit_scale` (a `ReferenceLogitScale`). KD's softmaxes over the logits s·S need at least
    float32 products (s = 1/τ scales their rounding), whatever dtype the loss's own products take."""
    image, text, all_image, all_text = (at_least_float32(x) for x in features)
    ref_image, ref_text, all_ref_image, all_ref_text = (at_least_float32(x) for x in reference)
    teacher_scale = teacher_logit_scale(ref_image, ref_text)
    kd = distillation_loss((image, text), (all_image, all_text), (ref_image, ref_text), (all_ref_image, all_ref_text),
                           logit_scale, teacher_scale.to(ref_image.dtype), rows_per_chunk)
    return kd, teacher_scale


def calibrated_logit_scale(ref_image: torch.Tensor, ref_text: torch.Tensor, max_anchors: int = CHOICE_ANCHORS,
                           low: float = TEACHER_SCALE_RANGE[0], high: float = TEACHER_SCALE_RANGE[1],
                           iterations: int = 40) -> torch.Tensor:
    """The logit scale t in [low, high] that minimises the reference's own CLIP loss on this batch (its mean
    cross-entropy of the positive over both directions), as a 0-dim float64 tensor, without a host synchronisation.

    The loss is convex in t with derivative mean_i (E_{softmax(t·s_i·)}[s_ij] − s_ii), increasing in t: a bisection
    in log t on its sign. `high` when even it leaves the positives under-predicted (the reference ranks them first
    with room to spare), `low` when the reference is no better than chance."""
    rows, anchors = first_anchor_similarities(ref_image, ref_text, max_anchors)  # [2r, B]
    positives = torch.cat([rows[:anchors].diagonal(), rows[anchors:].diagonal()])

    def rising(t):  # past the minimum: the loss's derivative at t is positive
        return ((torch.softmax(t * rows, dim=1) * rows).sum(1) - positives).mean() > 0

    low_log, high_log = log_bisection(rising, low, high, rows.device, iterations)
    return ((low_log + high_log) / 2).exp()


class ReferenceLogitScale(KeepsStatePrecision, nn.Module):
    """The reference model's logit scale (KD's teacher scale, JEST's scores): a given number, or 'auto':
    `calibrated_logit_scale` of the first training call's global batch (every rank gathers the reference features
    once and computes the same t), kept from then on; a buffer, so checkpoints and resume carry the choice and
    `loss.to(device)` moves it."""

    def __init__(self, value, world_size: int = 1):
        super().__init__()
        self.world_size = world_size
        if value != AUTO and not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"reference_logit_scale must be a finite number > 0 or '{AUTO}', got {value!r}")
        auto = value == AUTO
        # only a chosen scale is the run's state; a given one is the configuration's (and older checkpoints of the
        # losses that take one hold no entry for it)
        self.register_buffer('value', torch.tensor(float('nan') if auto else float(value), dtype=torch.float64),
                             persistent=auto)
        self._chosen = not auto  # a host-side copy of "value is set": no device read per call

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._chosen = not torch.isnan(self.value).item()

    def forward(self, ref_image: torch.Tensor, ref_text: torch.Tensor) -> torch.Tensor:
        """t for this rank's reference features of the batch."""
        device = ref_image.device
        check_device(self.value, device, "the teacher's logit scale")
        if not self._chosen:
            with torch.no_grad():
                scale = calibrated_logit_scale(gather_batch(ref_image, self.world_size, False, device),
                                               gather_batch(ref_text, self.world_size, False, device))
            if not self.training:  # an evaluation before the first training call: this batch's scale, not kept
                return scale
            self.value.copy_(scale)
            self._chosen = True
        return self.value
