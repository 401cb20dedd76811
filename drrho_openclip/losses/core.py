"""The DRO contrastive core that every loss of the family is composed from.

A loss is four choices over the same computation, per anchor i and direction (image→text, text→image):

- pairwise loss:   ℓ_ij = s_ij − s_ii, optionally RHO-shifted by a reference model: ℓ̂_ij = ℓ_ij − (s^ref_ij − s^ref_ii)
- aggregation:     KL-DRO over the candidates j ≠ i:  F_i = τ_i · log(ε + g_i),  g_i = mean_{j≠i} exp(ℓ̂_ij / τ_i)
- temperature:     fixed, the model's learnable logit_scale, per sample, or predicted by a network
- per-sample state: SogCLR's moving average u_i ≈ g_i (inner learning rate γ), or none (u_i = the mini-batch g_i)

The gradient is the SogCLR estimator: ∇F_i ≈ τ_i ∇g_i / (ε + u_i), i.e. pair weights exp(ℓ̂_ij/τ_i)/(ε + u_i).
Anchors are this rank's samples, candidates are the global batch gathered *with* gradient (OpenCLIP's
`--local-loss --gather-with-grad` semantics); DDP's gradient averaging then yields the gradient of the global mean.

Only torch is needed here: nothing in this module knows about OpenCLIP's training loop.
"""
import functools
import math
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .distill import distillation_loss


def _all_gather(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient of the global batch and keeps this rank's slice: with
    DDP's averaging, the parameters then get the gradient of the mean loss over all ranks' anchors."""

    @staticmethod
    def forward(ctx, tensor, world_size):
        ctx.rows = tensor.shape[0]
        return _all_gather(tensor, world_size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows], None


def gather_batch(tensor: torch.Tensor, world_size: int, with_grad: bool) -> torch.Tensor:
    """Concatenate `tensor` from every rank in rank order (the global batch); equal sizes on all ranks."""
    if world_size == 1:
        return tensor
    if with_grad:
        return _GatherWithGrad.apply(tensor, world_size)
    return _all_gather(tensor, world_size)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 → float32 (ℓ̂/τ at τ = 0.01 spans hundreds); float32 and float64 are kept as they are."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def check_index(index: torch.Tensor, num_rows: int):
    if index.max() >= num_rows or index.min() < 0:
        raise IndexError(
            f"sample index {int(index.max())} is outside the per-sample state of size {num_rows}: "
            f"the dataset is larger than the one the state was sized for")


@torch.no_grad()
def write_rows(tables, index: torch.Tensor, rows, world_size: int):
    """tables[k][index] = rows[k] with the index and rows of every rank, so that replicated per-sample tables
    stay identical on all ranks (and rank 0's checkpoint holds the whole state)."""
    # one collective for index and values; float64 holds indices exactly up to 2**53
    packed = torch.stack([index.double()] + [r.double() for r in rows], dim=1)
    packed = gather_batch(packed, world_size, with_grad=False)
    all_index = packed[:, 0].long().to(tables[0].device)
    for k, table in enumerate(tables):
        table[all_index] = packed[:, k + 1].to(table)


STATE_LAYOUTS = ('auto', 'replicated', 'sharded')
# `--state-layout auto` shards the per-sample tables from this many samples on (with more than one rank).
# From `benchmarks/state_memory.py` (2-core shared CPU, gloo, N = 1e6, global batch 1024; three runs): the sharded
# u update took 3.5–5.1 ms per step vs 1.0–1.3 ms replicated (two more collectives; 1–2% of the loss step;
# independent of N), while its tables take 1/W of the memory per rank. Below 2^22 samples a replicated table is
# ≤ 16 MiB per rank (u: 32 MiB, isogclr's eight: 128 MiB), not worth the extra collectives, a second file set per
# checkpoint, and a coverage metric of rank 0's block only; above, memory grows with N and sharding it pays.
AUTO_SHARD_FROM_SAMPLES = 1 << 22


def resolve_state_layout(layout: str, num_samples: int, world_size: int) -> str:
    """'replicated' or 'sharded' for a layout option ('auto' decides from the size of the tables)."""
    if layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {', '.join(STATE_LAYOUTS)}, got '{layout}'")
    if layout == 'auto':
        return 'sharded' if world_size > 1 and num_samples >= AUTO_SHARD_FROM_SAMPLES else 'replicated'
    return layout


def shard_block(num_samples: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[start, stop) of the samples rank `rank` of `world_size` holds in the sharded layout: contiguous blocks of
    ⌈N/W⌉ rows in rank order (the last ones may be shorter, or empty when N < W)."""
    size = -(-num_samples // world_size)
    start = min(num_samples, rank * size)
    return start, min(num_samples, start + size)


class SampleSharding:
    """Where the rows of the per-sample tables live, and how a training step reads and writes them.

    - 'replicated': every rank holds all N rows. A step reads its anchors' rows locally and writes the all-gathered
      (index, rows) of the global batch on every rank: one all-gather per write, N floats per table per rank.
    - 'sharded': rank r holds the contiguous block `shard_block(N, r, W)` (⌈N/W⌉ rows). A step all-gathers the
      global batch's sample indices (once per step, shared by every table that reads them); each owner puts the
      rows it holds into a [B, k] buffer of zeros that is all-reduced, so every rank gets the old rows of its
      anchors; the new rows are all-gathered and each owner writes those it holds. Memory O(N/W + B) per rank,
      collectives of O(B) elements.

    With one rank both layouts are one block of N rows and no collectives. The modules that keep per-sample tables
    (MovingAverageState, PerSampleTemperature) allocate them with `table()` and list them in `per_sample_tables`;
    one SampleSharding may be shared by several of them.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, layout: str = 'replicated'):
        if num_samples <= 0:
            raise ValueError(f"per-sample state needs the dataset size, got num_samples={num_samples}")
        if layout not in ('replicated', 'sharded'):
            raise ValueError(f"the per-sample state layout is 'replicated' or 'sharded', got '{layout}'")
        self.num_samples, self.rank, self.world_size, self.layout = num_samples, rank, world_size, layout
        self.sharded = layout == 'sharded' and world_size > 1
        self.start, self.stop = shard_block(num_samples, rank, world_size) if self.sharded else (0, num_samples)
        self._batch = None  # (the last index tensor read, its version, its all-gathered global index)

    @property
    def size(self) -> int:
        """Rows this rank holds."""
        return self.stop - self.start

    def table(self, fill: float) -> torch.Tensor:
        return torch.full((self.size,), float(fill))

    def _global_index(self, index: torch.Tensor) -> torch.Tensor:
        # the state and the temperature of one step read the same index tensor: gather it once (again if the tensor
        # was changed in place since)
        if self._batch is None or self._batch[0] is not index or self._batch[1] != index._version:
            self._batch = (index, index._version, gather_batch(index.to(torch.int64), self.world_size, with_grad=False))
        return self._batch[2]

    def _owned(self, all_index: torch.Tensor):
        owned = (all_index >= self.start) & (all_index < self.stop)
        return owned, (all_index - self.start).clamp(0, max(self.size - 1, 0))

    @torch.no_grad()
    def read(self, tables, index: torch.Tensor):
        """The rows of `tables` at this rank's sample `index` (one [b] tensor per table). Collective when sharded:
        every rank calls it with its own index."""
        check_index(index, self.num_samples)
        index = index.to(tables[0].device)
        if not self.sharded:
            return [table[index] for table in tables]
        all_index = self._global_index(index)
        owned, local = self._owned(all_index)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tables])
        if self.size:
            rows = torch.stack([table[local].to(dtype) for table in tables], dim=1)
            buffer = torch.where(owned[:, None], rows, torch.zeros((), dtype=dtype, device=rows.device))
        else:
            buffer = torch.zeros(all_index.shape[0], len(tables), dtype=dtype, device=index.device)
        dist.all_reduce(buffer)  # one owner per row, zeros elsewhere: the sum is the owner's row (NaN included)
        mine = buffer[self.rank * index.shape[0]:(self.rank + 1) * index.shape[0]]
        return [mine[:, k].to(table.dtype) for k, table in enumerate(tables)]

    @torch.no_grad()
    def write(self, tables, index: torch.Tensor, rows):
        """tables[k][i] = rows[k] for the samples i of every rank's `index` (collective with several ranks)."""
        if not self.sharded:
            write_rows(tables, index, rows, self.world_size)
            return
        index = index.to(tables[0].device)
        all_index = self._global_index(index)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tables])
        packed = gather_batch(torch.stack([r.to(dtype) for r in rows], dim=1), self.world_size, with_grad=False)
        owned, local = self._owned(all_index)
        local, packed = local[owned], packed[owned]
        for k, table in enumerate(tables):
            table[local] = packed[:, k].to(table.dtype)


def per_sample_tables(module: nn.Module) -> dict:
    """{state_dict key: (the module holding it, its SampleSharding)} of every per-sample table in `module`."""
    found = {}
    for prefix, sub in module.named_modules():
        for name in getattr(sub, 'per_sample_tables', ()):
            found[f'{prefix}.{name}' if prefix else name] = (sub, sub.sharding)
    return found


def positive_mask(num_anchors: int, num_candidates: int, offset: int, device) -> torch.Tensor:
    """[b, B] boolean mask of each anchor's own pair, which sits at column offset + i."""
    rows = torch.arange(num_anchors, device=device)
    mask = torch.zeros(num_anchors, num_candidates, dtype=torch.bool, device=device)
    mask[rows, rows + offset] = True
    return mask


class _LogMeanExpRows(torch.autograd.Function):
    """log g_i = log mean_{j≠i} exp(ℓ̂_ij·inv_tau_i + log w_ij) from a [b, B] similarity block, with the gradient
    written out by hand: autograd's version of the same expression keeps four b×B matrices for backward (the shifted
    loss, the logits, the mask, the softmax), this keeps one (the logits) and builds the gradient in one more.

    ∂ log g_i/∂s_ij = inv_tau_i p_ij (j ≠ i) and −inv_tau_i Σ_j p_ij at the positive (ℓ̂ subtracts s_ii from every
    candidate), with p the softmax of row i over the negatives; the reference similarities get the negated gradient;
    ∂ log g_i/∂inv_tau_i = Σ_j p_ij ℓ̂_ij.
    """

    @staticmethod
    def forward(ctx, sim, ref_sim, inv_tau, log_w, offset):
        positive_sim = sim.diagonal(offset)[:, None]
        if ref_sim is None:
            logits = sim - positive_sim
        else:
            logits = (sim - ref_sim).sub_(positive_sim - ref_sim.diagonal(offset)[:, None])
        inv_tau_col = inv_tau.reshape(-1, 1) if inv_tau.dim() else inv_tau
        logits.mul_(inv_tau_col)
        if log_w is not None:
            logits.add_(log_w)
        positives = logits.diagonal(offset)
        positives.fill_(float('-inf'))
        lse = torch.logsumexp(logits, dim=1)
        positives.zero_()  # backward zeroes the positives' softmax weight; 0·(−inf) would give NaN in Σ_j p_ij·logit_ij
        ctx.save_for_backward(logits, inv_tau, log_w, lse)
        ctx.offset = offset
        return lse - math.log(sim.shape[1] - 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, inv_tau, log_w, lse = ctx.saved_tensors
        need_sim, need_ref, need_tau = ctx.needs_input_grad[:3]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[:, None]
        p = (logits - lse_safe).exp_()
        p.diagonal(ctx.offset).zero_()
        grad_tau = None
        if need_tau:
            # Σ_j p_ij ℓ̂_ij, with ℓ̂_ij = (logit_ij − log w_ij) / inv_tau_i
            slope = torch.einsum('ij,ij->i', p, logits)
            if log_w is not None:
                slope -= torch.einsum('ij,ij->i', p, log_w.expand_as(p))
            grad_rows = grad_out * slope / inv_tau
            grad_tau = grad_rows.sum().reshape(inv_tau.shape) if inv_tau.numel() == 1 else grad_rows
        if not (need_sim or need_ref):
            return None, None, grad_tau, None, None
        coef = (grad_out * inv_tau)[:, None]
        positive_weight = p.sum(dim=1, keepdim=True)
        grad_sim = p.mul_(coef)
        grad_sim.diagonal(ctx.offset).copy_((-coef * positive_weight).squeeze(1))
        return (grad_sim if need_sim else None, -grad_sim if need_ref else None, grad_tau, None, None)


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
    inv_tau = torch.as_tensor(inv_tau, dtype=sim.dtype, device=sim.device)
    log_w = None
    if negative_log_weight is not None:
        mask = positive_mask(sim.shape[0], sim.shape[1], offset, sim.device)
        log_w = negative_log_weight(sim.detach(), mask).detach().to(sim.dtype)
    return _LogMeanExpRows.apply(sim, ref_sim, inv_tau, log_w, offset)


def dense_aggregate(image, text, all_image, all_text, offset, inv_tau_image, inv_tau_text, reference=None,
                    negative_log_weight=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log g of the image anchors over the texts, log g of the text anchors over the images), holding b×B matrices.

    `reference` is (ref_image, ref_text, all_ref_image, all_ref_text) or None. When the anchors are the whole batch
    (one process) the text direction's similarities are the transpose of the image direction's: one matrix product
    serves both, and backward sums both directions' gradients into it before the two products with the features.
    """
    whole_batch = image is all_image and text is all_text
    sim_image = image @ all_text.T
    sim_text = sim_image.T if whole_batch else text @ all_image.T
    ref_sim_image = ref_sim_text = None
    if reference is not None:
        ref_image, ref_text, all_ref_image, all_ref_text = reference
        ref_sim_image = ref_image @ all_ref_text.T
        ref_sim_text = ref_sim_image.T if whole_batch else ref_text @ all_ref_image.T
    return (log_mean_exp_sim(sim_image, offset, inv_tau_image, ref_sim_image, negative_log_weight),
            log_mean_exp_sim(sim_text, offset, inv_tau_text, ref_sim_text, negative_log_weight))


def gamma_at_epoch(epoch: int, gamma_min: float, decay_epochs: int) -> float:
    """SogCLR's inner learning rate: 1 in epoch 0 (u starts at the mini-batch estimate), then a cosine
    from 1 down to gamma_min over `decay_epochs` epochs, then gamma_min."""
    if epoch == 0:
        return 1.0
    if epoch >= decay_epochs:
        return gamma_min
    return gamma_min + 0.5 * (1 + math.cos(math.pi * epoch / decay_epochs)) * (1 - gamma_min)


class MovingAverageState(nn.Module):
    """SogCLR's per-sample estimators u (one table per direction), kept in log space.

    At τ = 0.01 the shifted loss reaches ±4, so exp(ℓ̂/τ) overflows float32 by far: log u does not.
    NaN marks a sample that has not been seen yet; its first estimate is taken as is.
    The tables follow `sharding` (default: replicated on every rank and updated with the all-gathered rows of the
    step, so that rank 0's checkpoint holds the whole state; sharded: each rank holds a block, see SampleSharding).
    """

    per_sample_tables = ('log_u_image', 'log_u_text')

    def __init__(self, num_samples: int, gamma: float, gamma_decay_epochs: int, world_size: int = 1,
                 sharding: Optional[SampleSharding] = None):
        super().__init__()
        self.sharding = sharding if sharding is not None else SampleSharding(num_samples, world_size=world_size)
        if self.sharding.num_samples != num_samples:
            raise ValueError(f"the sharding covers {self.sharding.num_samples} samples, the state {num_samples}")
        self.gamma_min = gamma
        self.gamma_decay_epochs = gamma_decay_epochs
        self.world_size = self.sharding.world_size
        self.gamma = 1.0
        self.register_buffer('log_u_image', self.sharding.table(float('nan')))
        self.register_buffer('log_u_text', self.sharding.table(float('nan')))

    def set_epoch(self, epoch: int):
        self.gamma = gamma_at_epoch(epoch, self.gamma_min, self.gamma_decay_epochs)

    def _moving_average(self, log_u_old, log_g):
        if self.gamma == 1.0:
            return log_g
        new = torch.logaddexp(log_u_old + math.log(1 - self.gamma), log_g + math.log(self.gamma))
        return torch.where(torch.isnan(log_u_old), log_g, new)

    @torch.no_grad()
    def update(self, index: torch.Tensor, log_g_image: torch.Tensor, log_g_text: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """u_i ← (1−γ) u_i + γ g_i for this rank's rows; returns the new log u of those rows."""
        tables = [self.log_u_image, self.log_u_text]
        old_image, old_text = self.sharding.read(tables, index)
        new_image = self._moving_average(old_image.to(log_g_image), log_g_image)
        new_text = self._moving_average(old_text.to(log_g_text), log_g_text)
        self.sharding.write(tables, index, [new_image, new_text])
        return new_image, new_text

    def coverage(self) -> float:
        """Fraction of the samples whose u has been set (of this rank's block when sharded)."""
        return (~torch.isnan(self.log_u_image)).float().mean().item() if self.log_u_image.numel() else float('nan')


def sogclr_estimate(log_g: torch.Tensor, log_u: torch.Tensor, log_eps: float) -> torch.Tensor:
    """A per-anchor term whose value is log(ε + u_i) and whose gradient is ∇g_i / (ε + u_i).

    log(ε + g_i) carries the gradient ∇g_i / (ε + g_i); rescaling it by r_i = (ε + g_i)/(ε + u_i) gives the
    SogCLR estimator. The detached remainder only fixes the value (and the τ-derivative, which must see
    log(ε + u_i) rather than r_i·log(ε + g_i)). With u = g (γ = 1) this is exactly log(ε + g_i).
    """
    log_eps_g = torch.logaddexp(log_g, torch.full_like(log_g, log_eps))
    log_eps_u = torch.logaddexp(log_u, torch.full_like(log_u, log_eps))
    ratio = torch.exp(log_eps_g.detach() - log_eps_u)
    return ratio * log_eps_g + (log_eps_u - ratio * log_eps_g).detach()


class ReferenceFeatures:
    """Mixin of every loss that reads reference features: fills them from an online reference model."""

    # callable (images, texts) -> (ref_image_features, ref_text_features), set for an online reference model;
    # a plain attribute, not a submodule, so the reference weights never enter the loss's state_dict
    reference_encoder = None

    def prepare_batch(self, images, texts, extras: dict) -> dict:
        if self.reference_encoder is None:
            return extras
        ref_image, ref_text = self.reference_encoder(images, texts)
        return {**extras, 'ref_image_features': ref_image, 'ref_text_features': ref_text}


class DROContrastiveLoss(ReferenceFeatures, nn.Module):
    """Bimodal KL-DRO contrastive loss with an optional reference shift and per-sample state.

    Returns {'contrastive_loss': L} with L = mean_i [τ F_image_i + τ F_text_i] + ρ(τ_image + τ_text), where F uses
    u (so its value is the SogCLR estimate of the objective, exactly the mini-batch objective when γ = 1).

    `positive_in_denominator` replaces ε by 1/(B−1): the positive pair's own term exp(ℓ_ii/τ) = 1 joins the mean over
    the B − 1 candidates, so τ log(1/(B−1) + g_i) = τ [log(1 + Σ_{j≠i} exp(ℓ̂_ij/τ)) − log(B−1)], CLIP's
    softmax cross-entropy up to the factor τ and a constant.
    With `distill_weight` λ > 0 (a global τ only), the result is {'contrastive_loss': (1−λ) L,
    'distill_loss': λ τ KD} with KD the MobileCLIP distillation term (`distill.py`) at the student's logit scale 1/τ;
    the factor τ (detached) puts KD in the units of the τ-scaled DRO loss, as CLIP's cross-entropy is in KD's.

    A temperature source may learn outside the model's optimiser (per-sample τ): it then has a method
    `step(objective)`, called once per optimiser step with the per-anchor objective (whose τ-gradient it uses).
    """

    def __init__(
            self,
            temperature: nn.Module,
            epsilon: Optional[float],
            rho: float = 0.0,
            state: Optional[MovingAverageState] = None,
            use_reference: bool = False,
            negative_log_weight=None,
            rank: int = 0,
            world_size: int = 1,
            aggregate: Callable = dense_aggregate,
            positive_in_denominator: bool = False,
            distill_weight: float = 0.0,
            teacher_logit_scale: float = 100.0,
    ):
        super().__init__()
        if positive_in_denominator != (epsilon is None):
            raise ValueError("give epsilon > 0, or positive_in_denominator (which takes ε's place), not both")
        if epsilon is not None and epsilon <= 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        if not 0 <= distill_weight <= 1:
            raise ValueError(f"the distillation weight λ must be in [0, 1], got {distill_weight}")
        self.temperature = temperature
        self.log_eps = None if epsilon is None else math.log(epsilon)
        self.rho = rho
        self.state = state
        self.use_reference = use_reference
        self.negative_log_weight = negative_log_weight
        self.rank = rank
        self.world_size = world_size
        self.aggregate = aggregate
        self.positive_in_denominator = positive_in_denominator
        self.distill_weight = distill_weight
        self.teacher_logit_scale = teacher_logit_scale
        self._window = None  # (accumulation window's index, its log u) while --accum-freq replays a window
        self._window_tau = None  # the window's temperatures, from its first call
        self._last = {}

    def set_epoch(self, epoch: int):
        for part in (self.state, self.temperature):
            if hasattr(part, 'set_epoch'):
                part.set_epoch(epoch)

    @property
    def sharding(self) -> Optional[SampleSharding]:
        """The layout of this loss's per-sample tables (None when it keeps none)."""
        tables = per_sample_tables(self)
        return next(iter(tables.values()))[1] if tables else None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Also accepts the whole per-sample tables (N rows) in a sharded loss, which keeps its block of them."""
        tables = per_sample_tables(self)
        missing = [key for key in tables if key not in state_dict]
        if missing:
            raise RuntimeError(
                f"the checkpoint holds no per-sample state ({', '.join(missing)}) for this loss, so resuming would "
                f"silently restart the SogCLR estimators (u) or per-sample temperatures; resume from a checkpoint "
                f"written with the same --loss and --gamma < 1")
        state_dict = dict(state_dict)
        for key, (_, sharding) in tables.items():
            saved = state_dict[key].numel()
            if saved == sharding.num_samples:
                state_dict[key] = state_dict[key][sharding.start:sharding.stop]
            elif not (sharding.sharded and saved == sharding.size):  # else: this rank's block of a sharded loss
                raise RuntimeError(f"the checkpoint's per-sample state covers {saved} samples, this run's data "
                                   f"{sharding.num_samples}: resume with the same training data")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _state_rows(self, index, log_g_image, log_g_text, accum_step):
        if self.state is None:
            return log_g_image.detach(), log_g_text.detach()
        if index is None:
            raise ValueError("this loss keeps per-sample state and needs the batch's sample `index`")
        if accum_step:  # the same window again, with gradients through another chunk: u was updated at step 0
            window_index, log_u = self._window
            if not torch.equal(window_index, index):
                raise RuntimeError("gradient-accumulation window changed between accumulation steps")
            return log_u
        log_u = self.state.update(index, log_g_image.detach(), log_g_text.detach())
        self._window = (index, log_u) if accum_step is not None else None
        return log_u

    def _temperatures(self, logit_scale, index, image_features, text_features, accum_step):
        if accum_step:
            # a later call on the same window: the first call's τ, as constants. τ's gradient depends only on the
            # window's feature values, so the first call already carried all of it (and any per-sample τ step)
            return self._window_tau
        tau_image, tau_text = self.temperature(logit_scale=logit_scale, index=index, image_features=image_features,
                                               text_features=text_features)
        tau_image, tau_text = tau_image.to(image_features), tau_text.to(image_features)
        self._window_tau = (tau_image.detach(), tau_text.detach()) if accum_step is not None else None
        return tau_image, tau_text

    def forward(self, image_features, text_features, logit_scale=None, index=None,
                ref_image_features=None, ref_text_features=None, accum_step=None, output_dict=False):
        reads_reference = self.use_reference or self.distill_weight > 0
        if reads_reference and (ref_image_features is None or ref_text_features is None):
            raise ValueError("this loss " + ("shifts by" if self.use_reference else "distills from") +
                             " the reference model: the batch carries no reference features "
                             "(pass --ref-features DIR or --ref-model)")
        with torch.autocast(image_features.device.type, enabled=False):
            image_features, text_features = at_least_float32(image_features), at_least_float32(text_features)
            all_image = gather_batch(image_features, self.world_size, with_grad=True)
            all_text = gather_batch(text_features, self.world_size, with_grad=True)
            ref_image = ref_text = all_ref_image = all_ref_text = None
            if reads_reference:
                ref_image, ref_text = at_least_float32(ref_image_features), at_least_float32(ref_text_features)
                all_ref_image = gather_batch(ref_image, self.world_size, with_grad=False)
                all_ref_text = gather_batch(ref_text, self.world_size, with_grad=False)
            offset = self.rank * image_features.shape[0]
            log_eps = -math.log(all_text.shape[0] - 1) if self.positive_in_denominator else self.log_eps
            tau_image, tau_text = self._temperatures(logit_scale, index, image_features, text_features, accum_step)
            reference = (ref_image, ref_text, all_ref_image, all_ref_text) if self.use_reference else None
            log_g_image, log_g_text = self.aggregate(image_features, text_features, all_image, all_text, offset,
                                                     1.0 / tau_image, 1.0 / tau_text, reference,
                                                     self.negative_log_weight)
            log_u_image, log_u_text = self._state_rows(index, log_g_image, log_g_text, accum_step)
            per_anchor = (tau_image * sogclr_estimate(log_g_image, log_u_image, log_eps)
                          + tau_text * sogclr_estimate(log_g_text, log_u_text, log_eps)
                          + self.rho * (tau_image + tau_text))
            loss = per_anchor.mean()
            if not accum_step and hasattr(self.temperature, 'step'):
                self.temperature.step(per_anchor)
            losses = {'contrastive_loss': loss}
            self._last = dict(log_g_image=log_g_image.detach(), log_g_text=log_g_text.detach(),
                              log_u_image=log_u_image, log_u_text=log_u_text, log_eps=log_eps,
                              tau_image=tau_image.detach(), tau_text=tau_text.detach())
            if self.distill_weight > 0:
                if tau_image.dim():
                    raise ValueError("distillation needs a global temperature (its student logit scale is 1/τ)")
                kd = distillation_loss((image_features, text_features), (all_image, all_text),
                                       (ref_image, ref_text), (all_ref_image, all_ref_text),
                                       1.0 / tau_image, self.teacher_logit_scale)
                losses = {'contrastive_loss': (1 - self.distill_weight) * loss,
                          'distill_loss': self.distill_weight * tau_image.detach() * kd}
                self._last['distill'] = kd.detach()
        if output_dict:
            return losses
        return sum(losses.values())

    def objective(self) -> torch.Tensor:
        """The mini-batch value of the objective of the last call (not the surrogate): mean_i τF_i over both
        directions with the batch's own g_i, plus the ρ term."""
        last = self._last
        log_eps = torch.tensor(last['log_eps'])
        f_image = last['tau_image'] * torch.logaddexp(last['log_g_image'], log_eps.to(last['log_g_image']))
        f_text = last['tau_text'] * torch.logaddexp(last['log_g_text'], log_eps.to(last['log_g_text']))
        return (f_image + f_text).mean() + self.rho * (last['tau_image'] + last['tau_text']).mean()

    def metrics(self) -> dict:
        """Diagnostics of the last call, for OpenCLIP's logger (rank 0; no collectives)."""
        if not self._last:
            return {}
        last = self._last
        out = {
            'objective': self.objective().item(),
            'tau_image_mean': last['tau_image'].mean().item(),
            'tau_text_mean': last['tau_text'].mean().item(),
            'log_u_image_mean': last['log_u_image'].mean().item(),
            'log_u_text_mean': last['log_u_text'].mean().item(),
        }
        if 'distill' in last:
            out['distill'] = last['distill'].item()
        if self.state is not None:
            out['gamma'] = self.state.gamma
            out['state_coverage'] = self.state.coverage()
        return out


class FixedTemperature(nn.Module):
    """A constant τ (DRRho-CLIP's default 0.01); ignores the model's logit_scale."""

    def __init__(self, tau: float):
        super().__init__()
        if tau <= 0:
            raise ValueError(f"temperature must be > 0, got {tau}")
        self.tau = tau

    def forward(self, logit_scale=None, **_):
        t = torch.tensor(self.tau, dtype=torch.float64)  # the loss casts it to its compute dtype
        return t, t


class LogitScaleTemperature(nn.Module):
    """The model's learnable global τ = 1 / logit_scale (OpenCLIP's parameter, optimised with the model)."""

    def forward(self, logit_scale=None, **_):
        if logit_scale is None:
            raise ValueError("a learnable temperature needs the model's logit_scale")
        tau = 1.0 / at_least_float32(logit_scale)
        return tau, tau

