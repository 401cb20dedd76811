"""The k-step balanced CLIP loss (Liu, Mehta, Pal, Harchaoui, NeurIPS 2024; balancing.md §1.4, §4).

CLIP's loss is one Sinkhorn half-step (a KL projection onto a uniform marginal) of the batch's model coupling
exp(Λ), Λ = S/τ, in each of two orders, read at the positives. k half-steps alternate rows and columns:

    P-branch: A_0 = Λ,  A_t = log_softmax(A_{t−1}) over the texts (t odd) or over the images (t even)
    Q-branch: the same starting with the images
    L^(k) = −(1/N) Σ_i ½ (A_k[i,i] + B_k[i,i])

k = 1 is CLIP's loss exactly; k = 2 is the paper's "doubly centered" loss. Gradients flow through every step.
With reference features, Λ = (S − S^ref)/τ: balancing of the RHO-shifted logits (DRRho-CLIP's ℓ̂ up to terms
constant along the rows).

How it spends its time. A half-step subtracts a normaliser from every row or every column, so after any number of
them A_t = Λ − R_i − C_j, R and C the sums of the row and column normalisers so far: a branch is k log-sum-exp
reductions over Λ, and its state two vectors. Forward keeps the one b×N matrix S − S^ref and the k normaliser
vectors; backward recomputes each step's softmax from them, last step first (∂A_{t+1}/∂A_t subtracts the softmax
of A_t times the sums of the incoming gradient along that step's direction). Each pass over the matrix is a call
compiled on CUDA like the DRO core's (`passes.fused`), instead of autograd keeping a float32 b×N matrix per step.
When one process holds the whole batch, the text rows' matrix is the image rows' transposed: both branches run over
the one matrix, the text branch normalising its columns first, and their gradients are summed in place.

With `distill_weight` λ > 0: (1 − λ) L^(k) + λ KD, MobileCLIP's distillation from the reference model
(`distill.py`) with the student at the loss's own scale 1/τ, as `clip` with λ does (not in the balancing paper).

Distributed: rows are this rank's anchors, columns the global batch (the features gathered with gradient); a
column step's log-sum-exp runs over all ranks' rows, so its normaliser is combined over ranks in forward and the
sums that backward subtracts along it are summed over ranks: value and gradients equal the global loss's.
"""
import torch
from torch import nn

from . import passes
from .base import LastCallMetrics, ReferenceFeatures, check_eval_call, fixed_within_window
from .collectives import all_reduce, gather_batch
from .distill import ReferenceLogitScale, check_distill_weight, distill_from_reference
from .precision import autocast_disabled, pairwise_dtype, product, similarities, without_autocast

# the dimension a half-step's log-sum-exp runs over: along each row (a row's normaliser), down each column
ROWS, COLUMNS = 1, 0


def _directions(first, steps):
    """The direction of each half-step of a branch that normalises along `first` first."""
    return [first if step % 2 == 0 else 1 - first for step in range(steps)]


def _folded(dim, rows, columns, normaliser):
    """(R, C) with a half-step's normaliser added to the side it normalises."""
    return (rows + normaliser, columns) if dim == ROWS else (rows, columns + normaliser)


def _no_normalisers(d):
    """(R, C) before the first half-step: zeros (made without reading d)."""
    return (torch.zeros(d.shape[0], dtype=d.dtype, device=d.device),
            torch.zeros(d.shape[1], dtype=d.dtype, device=d.device))


def _logits(d, inv_tau, rows, columns):
    """A = d·inv_tau − R_i − C_j."""
    if torch.compiler.is_compiling():
        return d * inv_tau - rows[:, None] - columns
    return torch.addcmul(-rows[:, None], d, inv_tau).sub_(columns)


def _normaliser(d, inv_tau, rows, columns, dim):
    """A half-step's normaliser: the log-sum-exp of A along `dim` (eager: one b×N temporary, worked in place)."""
    if torch.compiler.is_compiling():
        return torch.logsumexp(_logits(d, inv_tau, rows, columns), dim=dim)
    logits = _logits(d, inv_tau, rows, columns)
    largest = logits.amax(dim=dim, keepdim=True)
    return logits.sub_(largest).exp_().sum(dim=dim).log_().add_(largest.squeeze(dim))


def _sums(grad, sum_dim):
    """(grad, its sums along `sum_dim` for the step before; None for the first step, which has none before it)."""
    return grad, None if sum_dim is None else grad.sum(dim=sum_dim)


def _last_step_back(d, inv_tau, rows, columns, dim, weight, upstream, offset, sum_dim):
    """The last half-step's gradient: the upstream at the positives (column offset + i of row i) minus
    softmax_dim(A) · weight (broadcast along `dim`), and `_sums`. The step's normaliser is folded into R or C, so its
    softmax is exp(A)."""
    weight = weight[:, None] if dim == ROWS else weight
    if torch.compiler.is_compiling():
        grad = -torch.exp(_logits(d, inv_tau, rows, columns)) * weight
    else:
        grad = _logits(d, inv_tau, rows, columns).exp_().mul_(-weight)
    return _sums(passes.set_positives(grad, offset, grad.diagonal(offset) + upstream), sum_dim)


def _step_back(grad, d, inv_tau, rows, columns, dim, weight, sum_dim):
    """grad − softmax_dim(A) · weight, in place, and `_sums` (as `_last_step_back`)."""
    weight = weight[:, None] if dim == ROWS else weight
    if torch.compiler.is_compiling():
        return _sums(grad.sub_(torch.exp(_logits(d, inv_tau, rows, columns)) * weight), sum_dim)
    softmax = _logits(d, inv_tau, rows, columns).exp_()
    grad.addcmul_(softmax, weight, value=-1)
    del softmax  # before the sums: no second b×N temporary beside the gradient
    return _sums(grad, sum_dim)


def _summed_product(grad, d, rows=256):
    """Σ grad ⊙ d, summed as a tree (a float32 dot product accumulates enough rounding over b×N terms to move τ's
    gradient in its fourth digit); eagerly by blocks of `rows` rows, so no b×N temporary."""
    if torch.compiler.is_compiling():
        return (grad * d).sum()
    return sum((block * d_block).sum() for block, d_block in zip(grad.split(rows), d.split(rows)))


def _forward_branch(d, inv_tau, steps, world_size, offset, first):
    """(A_k at the positives [b], the k normalisers) of one branch over this rank's b rows of d, anchor i's positive at
    (i, offset + i), A_0 = d·inv_tau, normalised along `first` first: ROWS for the rows' branch, COLUMNS for the
    columns' branch of a matrix that holds the whole batch (offset 0). A normaliser down the columns runs over every
    rank's rows. The last one is read at the positives only."""
    rows, columns = _no_normalisers(d)
    normalisers = []
    for step, dim in enumerate(_directions(first, steps)):
        normaliser = passes.fused(_normaliser, d)(d, inv_tau, rows, columns, dim)
        if dim == COLUMNS:
            normaliser = gather_batch(normaliser[None], world_size, with_grad=False, device=d.device).logsumexp(dim=0)
        normalisers.append(normaliser)
        if step < steps - 1:
            rows, columns = _folded(dim, rows, columns, normaliser)
    positions = offset + torch.arange(d.shape[0], device=d.device)
    last = normaliser if dim == ROWS else normaliser[positions]
    return d.diagonal(offset) * inv_tau - rows - columns[positions] - last, normalisers


def _backward_branch(d, inv_tau, normalisers, upstream, world_size, offset, first):
    """∂/∂Λ of Σ_i upstream_i A_k[i, offset + i], Λ = d·inv_tau, last step first."""
    directions = _directions(first, len(normalisers))
    # R and C before each step with that step's normaliser folded in: its softmax is then exp(A)
    states, (rows, columns) = [], _no_normalisers(d)
    for dim, normaliser in zip(directions, normalisers):
        rows, columns = _folded(dim, rows, columns, normaliser)
        states.append((rows, columns))
    weight = upstream
    if directions[-1] == COLUMNS:  # the last normaliser is a column's: it takes the upstream of its positive's rank
        weight = torch.zeros(d.shape[1], dtype=d.dtype, device=d.device).index_copy_(
            0, offset + torch.arange(d.shape[0], device=d.device), upstream)
        weight = all_reduce(weight, world_size, d.device)
    for step in reversed(range(len(directions))):
        before = directions[step - 1] if step > 0 else None
        if step == len(directions) - 1:  # one compiled variant per role and direction, for any k
            grad, weight = passes.fused(_last_step_back, d)(d, inv_tau, *states[step], directions[step], weight,
                                                            upstream, offset, before)
        else:
            grad, weight = passes.fused(_step_back, d)(grad, d, inv_tau, *states[step], directions[step], weight,
                                                       before)
        if before == COLUMNS:  # the sums down a column run over every rank's rows
            weight = all_reduce(weight, world_size, d.device)
    return grad


class _BalancedAtPositives(torch.autograd.Function):
    """(A_k at the positives [b], the first half-step's normalisers [b]) of the rows' branch of d, and with
    `transposed` also of its columns' branch (one process holds the whole batch: the text rows' matrix is the image
    rows' transposed, offset 0). Differentiable in d and inv_tau (0-dim)."""

    @staticmethod
    def forward(ctx, d, inv_tau, steps, world_size, offset, transposed):
        branches = (ROWS, COLUMNS) if transposed else (ROWS,)
        outputs, saved = [], []
        with autocast_disabled(d.device):
            for first in branches:
                value, normalisers = _forward_branch(d, inv_tau, steps, world_size, offset, first)
                outputs += [value, normalisers[0].clone()]
                saved += normalisers
        ctx.save_for_backward(d, inv_tau, *saved)
        ctx.world_size, ctx.offset, ctx.steps, ctx.branches = world_size, offset, steps, branches
        ctx.mark_non_differentiable(*outputs[1::2])
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, *upstreams):
        d, inv_tau, *normalisers = ctx.saved_tensors
        steps, grad = ctx.steps, None
        for n, first in enumerate(ctx.branches):
            branch = _backward_branch(d, inv_tau, normalisers[n * steps:(n + 1) * steps],
                                      upstreams[2 * n].contiguous(), ctx.world_size, ctx.offset, first)
            grad = branch if grad is None else grad.add_(branch)
            del branch
        # Λ = d·inv_tau
        grad_inv_tau = passes.fused(_summed_product, d)(grad, d) if ctx.needs_input_grad[1] else None
        return grad.mul_(inv_tau), grad_inv_tau, None, None, None, None


def balance_at_positives(d, inv_tau, steps, world_size=1, offset=0, transposed=False):
    """k = `steps` half-steps of the coupling exp(d·inv_tau) over this rank's rows of d [b, N] (the global batch's
    columns; anchor i's positive at column offset + i), read at the positives: (A_k at the positives [b], the first
    half-step's normalisers [b], not differentiable), the rows normalised first; with `transposed` (one process,
    offset 0) also the same two of the columns' branch, normalised down the columns first. Differentiable in d
    and inv_tau (a 0-dim tensor)."""
    return _BalancedAtPositives.apply(d, inv_tau, steps, world_size, offset, transposed)


class BalancedClipLoss(ReferenceFeatures, LastCallMetrics, nn.Module):

    compiles_passes = True  # its half-steps' passes, where `compiles_for` the device

    def __init__(self, temperature: nn.Module, steps: int = 2, reference_shift: bool = False,
                 distill_weight: float = 0.0, teacher_logit_scale='auto', rank: int = 0, world_size: int = 1):
        super().__init__()
        if steps < 1:
            raise ValueError(f"the balanced loss needs balance_steps ≥ 1 (1 = CLIP), got {steps}")
        self.temperature = temperature
        self.steps = steps
        self.reference_shift = reference_shift
        self.distill_weight = check_distill_weight(distill_weight)
        if distill_weight > 0:
            self.teacher_logit_scale = ReferenceLogitScale(teacher_logit_scale, world_size)
        self.rank = rank
        self.world_size = world_size
        self._last = {}

    def forward(self, image_features, text_features, logit_scale=None, ref_image_features=None,
                ref_text_features=None, accum_step=None, output_dict=False, **_):
        if self.reference_shift:
            self.require_reference(ref_image_features, ref_text_features, "shifts by the reference model")
        elif self.distill_weight > 0:
            self.require_reference(ref_image_features, ref_text_features, "distills from the reference model")
        check_eval_call(self, accum_step)
        device = image_features.device
        # the products in autocast's 16-bit dtype, or the features' own; everything elementwise in float32
        dtype = pairwise_dtype(image_features, text_features)
        with autocast_disabled(device):
            image, text = image_features.to(dtype), text_features.to(dtype)
            all_image = gather_batch(image, self.world_size, with_grad=True, device=device)
            all_text = gather_batch(text, self.world_size, with_grad=True, device=device)
            # one process holds the whole batch: the text rows' similarities are the image rows' transposed
            whole_batch = self.world_size == 1
            sim_image = similarities(image, all_text)
            sim_text = None if whole_batch else similarities(text, all_image)
            tau = fixed_within_window(self.temperature(logit_scale=logit_scale)[0].to(sim_image.dtype), accum_step)
            if self.reference_shift or self.distill_weight > 0:
                ref_image, ref_text = ref_image_features.to(dtype), ref_text_features.to(dtype)
                all_ref_image = gather_batch(ref_image, self.world_size, with_grad=False, device=device)
                all_ref_text = gather_batch(ref_text, self.world_size, with_grad=False, device=device)
            if self.reference_shift:
                sim_image = sim_image.sub_(product(ref_image, all_ref_text.T))
                if not whole_batch:
                    sim_text = sim_text.sub_(product(ref_text, all_ref_image.T))
            inv_tau = 1 / tau.reshape(())
            offset = self.rank * sim_image.shape[0]
            if whole_batch:
                p, lse_image, q, lse_text = balance_at_positives(sim_image, inv_tau, self.steps, transposed=True)
                sim_text = sim_image.T
            else:
                p, lse_image = balance_at_positives(sim_image, inv_tau, self.steps, self.world_size, offset)
                q, lse_text = balance_at_positives(sim_text, inv_tau, self.steps, self.world_size, offset)
            loss = -(p + q).mean() / 2
            if self.training:  # for metrics()
                with torch.no_grad():  # CLIP's loss (k = 1) alongside: k ≥ 2 collapsing towards 0 alone is the warning
                    # the first half-step's row normalisers are CLIP's log-softmax denominators
                    positives = (sim_image.diagonal(offset) + sim_text.diagonal(offset)) * inv_tau
                    clip = -(positives - lse_image - lse_text).mean() / 2
                self._last = {'clip_loss': clip, 'tau': tau.detach()}
            losses = {'contrastive_loss': loss}
            if self.distill_weight > 0:
                kd, teacher_scale = distill_from_reference(self.teacher_logit_scale,
                                                           (image, text, all_image, all_text),
                                                           (ref_image, ref_text, all_ref_image, all_ref_text), inv_tau)
                losses = {'contrastive_loss': (1 - self.distill_weight) * loss, 'distill_loss': self.distill_weight * kd}
                if self.training:
                    self._last.update(distill=kd.detach(), teacher_logit_scale=teacher_scale)
        return losses if output_dict else sum(losses.values())
