"""Per-sample state: the tables of one value per training sample (SogCLR's u, iSogCLR's τ_i and its Adam moments),
where their rows live across ranks, and how a training step reads and writes the rows of its batch.

Every table is a registered buffer of the module that keeps it, so `loss.to(device)` moves all of them; a step
reads and writes them on the features' device, where the batch's sample index is moved first (O(batch) traffic).
With the sharded layout, every rank saves its block in a file of its own next to the checkpoint (below).
"""
import functools
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Tuple

import torch
import torch.distributed as dist
from torch import nn

from .base import KeepsStatePrecision
from .collectives import all_reduce, broadcast_object, check_device, gather_batch, ranks_where

STATE_LAYOUTS = ('auto', 'replicated', 'sharded')
# `--state-layout auto` shards the per-sample tables from this many samples on (with more than one rank).
# From `benchmarks/state_memory.py` (2-core shared CPU, gloo, N = 1e6, global batch 1024; three runs): the sharded
# u update took 3.5–5.1 ms per step vs 1.0–1.3 ms replicated (two more collectives; 1–2% of the loss step;
# independent of N), while its tables take 1/W of the memory per rank. Below 2^22 samples a replicated table is
# ≤ 16 MiB per rank (u: 32 MiB, isogclr's eight: 128 MiB), not worth the extra collectives, a second file set per
# checkpoint, and a coverage metric of rank 0's block only; above, memory grows with N and sharding it pays.
AUTO_SHARD_FROM_SAMPLES = 1 << 22


def check_index_shape(index, batch_rows: int):
    """A batch's sample index: a 1-D integer tensor, one entry per row of the batch (its dtype and shape only: no
    device read). A boolean mask would index the tables as 0s and 1s, a float one be cut to integers."""
    if not isinstance(index, torch.Tensor) or index.dtype == torch.bool or index.is_floating_point() \
            or index.is_complex() or index.dim() != 1 or index.shape[0] != batch_rows:
        what = (f"{index.dtype} of shape {tuple(index.shape)}" if isinstance(index, torch.Tensor)
                else type(index).__name__)
        raise ValueError(f"the sample index must be a 1-D integer tensor with one entry per row of the batch "
                         f"({batch_rows}), got {what}")


def check_index(index: torch.Tensor, num_rows: int):
    """Every sample index must have a row. Exact, with a Python error, on the CPU; on an accelerator an exact check
    would wait for the device every step, so there it is a device-side assertion that fails the step."""
    message = f"a sample index is outside the per-sample state of size {num_rows}"
    if index.device.type == 'cpu':
        if index.numel() and index.min() < 0:
            raise IndexError(f"{message}: index {int(index.min())} (sample indices start at 0)")
        if index.numel() and index.max() >= num_rows:
            raise IndexError(f"{message}: index {int(index.max())} (the dataset is larger than the one the state "
                             f"was sized for)")
    else:
        torch._assert_async(((index >= 0) & (index < num_rows)).all(), message)


def check_same_window(window_index: torch.Tensor, index: torch.Tensor):
    """A later call of a gradient-accumulation window carries the samples of its first (u was updated there). Exact
    on the CPU; on an accelerator a device-side assertion, as `check_index`'s: an exact check would wait for the
    device at every call of the window."""
    message = "the samples of a gradient-accumulation window changed between its calls (accum_step > 0)"
    if window_index.shape != index.shape:
        raise RuntimeError(f"{message}: {window_index.numel()} then {index.numel()}")
    if index.device.type == 'cpu':
        if not torch.equal(window_index, index):
            raise RuntimeError(message)
    else:
        torch._assert_async(torch.eq(window_index, index).all(), message)


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
      (index, rows) of the global batch on every rank: one all-gather per write, N floats per table per rank, so
      that rank 0's checkpoint holds the whole state.
    - 'sharded': rank r holds the contiguous block `shard_block(N, r, W)` (⌈N/W⌉ rows). A step all-gathers the
      global batch's sample indices (once per step, shared by every table that reads them); each owner puts the
      rows it holds into a [B, k] buffer of zeros that is all-reduced, so every rank gets the old rows of its
      anchors; the new rows are all-gathered and each owner writes those it holds. Memory O(N/W + B) per rank,
      collectives of O(B) elements.

    With one rank both layouts are one block of N rows and no collectives. The modules that keep per-sample tables
    (MovingAverageState, PerSampleTemperature) allocate them with `table()` and list them in `per_sample_tables`;
    one SampleSharding may be shared by several of them. Reads and writes happen on the device of the rows the
    step computes (the features'), where the tables must be.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, layout: str = 'replicated'):
        if num_samples <= 0:
            raise ValueError(f"per-sample state needs the dataset size, got num_samples={num_samples}")
        if layout not in ('replicated', 'sharded'):
            raise ValueError(f"the per-sample state layout is 'replicated' or 'sharded', got '{layout}'")
        self.num_samples, self.rank, self.world_size, self.layout = num_samples, rank, world_size, layout
        self.sharded = layout == 'sharded' and world_size > 1
        self.start, self.stop = shard_block(num_samples, rank, world_size) if self.sharded else (0, num_samples)
        self._batch = None  # (the caller's last index tensor, its version, it on the device, the global index)

    @property
    def size(self) -> int:
        """Rows this rank holds."""
        return self.stop - self.start

    def table(self, fill: float) -> torch.Tensor:
        return torch.full((self.size,), float(fill))

    def new_call(self):
        """Forget the last call's index: a tensor reused from call to call can have been rewritten where torch counts
        no version (through numpy or shared memory), and would read and write the last call's rows."""
        self._batch = None

    def _batch_index(self, index: torch.Tensor, device: torch.device):
        """This rank's sample index on `device` and, when sharded, the global batch's. The state and the temperature
        of one step read the same index tensor: moved, checked and gathered once (again if it changed in place)."""
        if self._batch is None or self._batch[0] is not index or self._batch[1] != index._version:
            local = index.to(device=device, dtype=torch.int64, non_blocking=True)
            check_index(local, self.num_samples)
            everyone = gather_batch(local, self.world_size, with_grad=False, device=device) if self.sharded else None
            self._batch = (index, index._version, local, everyone)
        return self._batch[2], self._batch[3]

    def _owned(self, all_index: torch.Tensor):
        owned = (all_index >= self.start) & (all_index < self.stop)
        return owned, (all_index - self.start).clamp(0, max(self.size - 1, 0))

    @staticmethod
    def _check_tables(tables, device):
        for table in tables:
            check_device(table, device, 'a per-sample table')

    @torch.no_grad()
    def read(self, tables, index: torch.Tensor, device: torch.device):
        """The rows of `tables` at this rank's sample `index`, one [b] tensor per table on `device`. Collective when
        sharded: every rank calls it with its own index."""
        self._check_tables(tables, device)
        index, all_index = self._batch_index(index, device)
        if not self.sharded:
            return [table[index] for table in tables]
        owned, local = self._owned(all_index)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tables])
        if self.size:
            rows = torch.stack([table[local].to(dtype) for table in tables], dim=1)
            buffer = torch.where(owned[:, None], rows, torch.zeros((), dtype=dtype, device=device))
        else:
            buffer = torch.zeros(all_index.shape[0], len(tables), dtype=dtype, device=device)
        all_reduce(buffer, self.world_size, device)  # one owner per row, zeros elsewhere: the owner's row (NaN too)
        mine = buffer[self.rank * index.shape[0]:(self.rank + 1) * index.shape[0]]
        return [mine[:, k].to(table.dtype) for k, table in enumerate(tables)]

    @staticmethod
    def _as_last_occurrence(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`values` ([n, k], one row per entry of `index`) with every entry of a repeated index given the value of its
        last occurrence. A sample can come twice in a global batch (--dataset-resampled); CUDA writes repeated indices
        in an undefined order, so each rank's replicated table could keep another of them; the CPU keeps the last.
        A stable sort and a reversed running minimum: no wait for the device."""
        order = torch.argsort(index, stable=True)
        ordered = index[order]
        positions = torch.arange(len(index), device=index.device)
        ends_run = torch.ones_like(ordered, dtype=torch.bool)
        ends_run[:-1] = ordered[1:] != ordered[:-1]
        run_end = torch.where(ends_run, positions, len(index)).flip(0).cummin(0).values.flip(0)
        out = torch.empty_like(values)
        out[order] = values[order[run_end]]
        return out

    @torch.no_grad()
    def write(self, tables, index: torch.Tensor, rows):
        """tables[k][i] = rows[k] for the samples i of every rank's `index` (collective with several ranks)."""
        device = rows[0].device
        self._check_tables(tables, device)
        index, all_index = self._batch_index(index, device)
        if not self.sharded:
            # one collective for index and values; float64 holds indices exactly up to 2**53
            packed = torch.stack([index.double()] + [r.double() for r in rows], dim=1)
            packed = gather_batch(packed, self.world_size, with_grad=False, device=device)
            all_index = packed[:, 0].long()
            values = self._as_last_occurrence(all_index, packed[:, 1:])
            for k, table in enumerate(tables):
                table[all_index] = values[:, k].to(table.dtype)
            return
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tables])
        packed = gather_batch(torch.stack([r.to(dtype) for r in rows], dim=1), self.world_size, with_grad=False,
                              device=device)
        if not self.size:  # a rank with no rows (fewer samples than ranks)
            return
        packed = self._as_last_occurrence(all_index, packed)
        owned, local = self._owned(all_index)
        # Without selecting the owned rows, whose count would wait for the device: every entry writes, the others to
        # the row of the batch's first owned entry with that entry's value, or, where this rank owns none, a row's
        # own value back. Each row then receives one value, whatever order the writes land in.
        first = owned.int().argmax().view(1)  # 0 where none is owned; [1], as an index tensor (a 0-d one is an int)
        target = torch.where(owned, local, local[first])
        for k, table in enumerate(tables):
            other = torch.where(owned[first], packed[first, k].to(table.dtype), table[local[first]])
            table[target] = torch.where(owned, packed[:, k].to(table.dtype), other)


def missing_state_message(missing, where: str = '') -> str:
    """Why a resume without some of the loss's per-sample tables (`missing`, their state keys) stops. They are the
    tables of the loss and options in force (isogclr keeps its τ tables at γ = 1 too), which a checkpoint of another
    loss or other options lacks."""
    return (f"the checkpoint holds no per-sample state ({', '.join(missing)}) for this loss{where}, so resuming would "
            f"silently restart its per-sample estimates (the SogCLR estimators u, per-sample temperatures and their "
            f"moments); resume from a checkpoint written with the same --loss and options")


def per_sample_tables(module: nn.Module) -> dict:
    """{state_dict key: (the module holding it, its SampleSharding)} of every per-sample table in `module`."""
    found = {}
    for prefix, sub in module.named_modules():
        for name in getattr(sub, 'per_sample_tables', ()):
            found[f'{prefix}.{name}' if prefix else name] = (sub, sub.sharding)
    return found


def gamma_at_epoch(epoch: int, gamma_min: float, decay_epochs: int) -> float:
    """SogCLR's inner learning rate: 1 in epoch 0 (u starts at the mini-batch estimate), then a cosine
    from 1 down to gamma_min over `decay_epochs` epochs, then gamma_min."""
    if epoch == 0:
        return 1.0
    if epoch >= decay_epochs:
        return gamma_min
    return gamma_min + 0.5 * (1 + math.cos(math.pi * epoch / decay_epochs)) * (1 - gamma_min)


class MovingAverageState(KeepsStatePrecision, nn.Module):
    """SogCLR's per-sample estimators u (one table per direction), kept in log space.

    At τ = 0.01 the shifted loss reaches ±4, so exp(ℓ̂/τ) overflows float32 by far: log u does not.
    NaN marks a sample that has not been seen yet; its first estimate is taken as is.
    The tables follow `sharding` (replicated on every rank, or a block per rank: see SampleSharding).
    """

    per_sample_tables = ('log_u_image', 'log_u_text')

    def __init__(self, gamma: float, gamma_decay_epochs: int, sharding: SampleSharding):
        super().__init__()
        if not gamma_decay_epochs >= 1:
            raise ValueError(f"gamma_decay_epochs must be ≥ 1 (γ is 1 in epoch 0 and reaches gamma from epoch "
                             f"gamma_decay_epochs on), got {gamma_decay_epochs}")
        self.sharding = sharding
        self.gamma_min = gamma
        self.gamma_decay_epochs = gamma_decay_epochs
        self.gamma = 1.0
        self.register_buffer('log_u_image', sharding.table(float('nan')))
        self.register_buffer('log_u_text', sharding.table(float('nan')))

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
        old_image, old_text = self.sharding.read(tables, index, log_g_image.device)
        new_image = self._moving_average(old_image.to(log_g_image), log_g_image)
        new_text = self._moving_average(old_text.to(log_g_text), log_g_text)
        self.sharding.write(tables, index, [new_image, new_text])
        return new_image, new_text

    def coverage(self) -> float:
        """Fraction of the samples whose u has been set (of this rank's block when sharded)."""
        return (~torch.isnan(self.log_u_image)).float().mean().item() if self.log_u_image.numel() else float('nan')


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint files of the sharded layout
#
# A shard set is a directory with one file per rank of the run that wrote it,
#
#     <directory>/rank-0-of-W.shard, ..., rank-(W-1)-of-W.shard
#
# file r holding the rows `shard_block(N, r, W)` of every per-sample table of the loss, with the set's metadata
# (save id, N, W, r, the table names). A rank that reads the set takes the rows of its own block (or all rows,
# replicated) from the files that overlap it, memory-mapped: a different world size re-shards on load. The set is
# written into `<directory>.tmp-<save id>/` and renamed into place once every rank's file is complete; the manifest
# `save_state_shards` returns (the checkpoint stores it) names the set's save id, which every file must carry, so a
# set overwritten by another save, or incomplete, is an error naming the file, never a silent restart. The files'
# suffix is not `.pt`, so a glob for checkpoints (`--resume latest`) never picks them.

FORMAT = 'drrho-openclip per-sample state shard'
VERSION = 1
SUFFIX = '.shard'


def shard_file_name(rank: int, world_size: int) -> str:
    return f'rank-{rank}-of-{world_size}{SUFFIX}'


def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_ok(ok: bool, what: str, world_size: int, device: torch.device, error: Exception = None):
    """Raise on every rank if any rank failed (a bare barrier would leave the others waiting forever)."""
    failed = ranks_where(not ok, world_size, device) if _distributed(world_size) else int(not ok)
    if failed:
        raise RuntimeError(f"{what} failed on {failed} rank(s)" + (f": {error}" if error is not None else "")) \
            from error


def save_state_shards(loss, directory) -> dict:
    """Write this rank's block of every per-sample table of `loss` into the shard set `directory` (replacing one
    that is there). Collective: every rank of the loss's world calls it. Returns the set's manifest."""
    tables = per_sample_tables(loss)
    if not tables:
        raise ValueError("this loss keeps no per-sample tables")
    module, sharding = next(iter(tables.values()))
    device = getattr(module, module.per_sample_tables[0]).device  # where the loss communicates
    rank, world_size, num_samples = sharding.rank, sharding.world_size, sharding.num_samples
    directory = Path(directory)
    save_id = uuid.uuid4().hex if rank == 0 else None
    if _distributed(world_size):
        save_id = broadcast_object(save_id, world_size, device)
    staging = directory.parent / f'{directory.name}.tmp-{save_id}'
    start, stop = shard_block(num_samples, rank, world_size)
    error = None
    try:
        staging.mkdir(parents=True, exist_ok=True)
        rows = {key: getattr(holder, key.rsplit('.', 1)[-1])[start - s.start:stop - s.start].detach().cpu().clone()
                for key, (holder, s) in tables.items()}
        payload = dict(format=FORMAT, version=VERSION, save_id=save_id, rank=rank, world_size=world_size,
                       num_samples=num_samples, start=start, stop=stop, tables=rows)
        path = staging / shard_file_name(rank, world_size)
        torch.save(payload, f'{path}.tmp')
        os.replace(f'{path}.tmp', path)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    _all_ok(error is None, f"writing the per-sample state shards to '{staging}'", world_size, device, error)
    if rank == 0:
        try:
            written = sorted(p.name for p in staging.iterdir())
            expected = sorted(shard_file_name(r, world_size) for r in range(world_size))
            if written != expected:
                raise RuntimeError(f"'{staging}' holds {written}, expected {expected} (every rank must see the "
                                   f"checkpoint directory: a shared file system)")
            # a set saved again for the same epoch is moved aside, not deleted, until the new one is in place
            previous = directory.parent / f'{directory.name}.old-{save_id}'
            if directory.exists():
                os.replace(directory, previous)
            os.replace(staging, directory)
            shutil.rmtree(previous, ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            error = e
    _all_ok(error is None, f"completing the per-sample state shard set '{directory}'", world_size, device, error)
    return dict(format=FORMAT, version=VERSION, directory=directory.name, save_id=save_id, world_size=world_size,
                num_samples=num_samples, tables=sorted(tables))


def _open(path: Path) -> dict:
    try:
        return torch.load(path, map_location='cpu', mmap=True, weights_only=True)
    except Exception as e:
        raise RuntimeError(f"the per-sample state shard '{path}' cannot be read ({type(e).__name__}: {e}); the "
                           f"shard set is damaged") from e


def load_state_shards(loss, directory, manifest: dict) -> dict:
    """The rows this rank holds of every per-sample table of `loss` ({state_dict key: tensor}, for
    `loss.load_state_dict` together with the loss's other entries), read from the shard set `directory` written by
    `save_state_shards` with any world size. `manifest` (the one the save returned) pins the set's save id.
    Every file of the set must be there and belong to it: otherwise a RuntimeError names the file. No collectives."""
    tables = per_sample_tables(loss)
    if not tables:
        raise RuntimeError("the checkpoint holds per-sample state shards, but this loss keeps no per-sample state")
    directory = Path(directory)
    if not directory.is_dir():
        raise RuntimeError(f"the per-sample state shard directory '{directory}' is missing (it belongs next to "
                           f"the checkpoint)")
    if manifest.get('format') != FORMAT or manifest.get('version') != VERSION:
        raise RuntimeError(f"unknown per-sample state manifest {manifest.get('format')!r} version "
                           f"{manifest.get('version')!r}")
    sharding = next(iter(tables.values()))[1]
    saved_world, num_samples = manifest['world_size'], manifest['num_samples']
    if num_samples != sharding.num_samples:
        raise RuntimeError(f"the checkpoint's per-sample state covers {num_samples} samples, this run's data "
                           f"{sharding.num_samples}: resume with the same training data")
    missing = sorted(set(tables) - set(manifest['tables']))
    if missing:
        raise RuntimeError(missing_state_message(missing, f" in '{directory}'"))
    paths = [directory / shard_file_name(r, saved_world) for r in range(saved_world)]
    absent = [p for p in paths if not p.is_file()]
    if absent:
        raise RuntimeError(f"the per-sample state shard '{absent[0]}' is missing ({len(absent)} of the "
                           f"{saved_world} files of the set): resuming needs every file of '{directory}'")
    out = {key: torch.empty(s.size, dtype=getattr(module, key.rsplit('.', 1)[-1]).dtype)
           for key, (module, s) in tables.items()}
    for r, path in enumerate(paths):
        shard = _open(path)
        start, stop = shard_block(num_samples, r, saved_world)
        header = {k: shard.get(k) for k in ('format', 'version', 'save_id', 'rank', 'world_size', 'num_samples',
                                            'start', 'stop')}
        expected = dict(format=FORMAT, version=VERSION, save_id=manifest['save_id'], rank=r, world_size=saved_world,
                        num_samples=num_samples, start=start, stop=stop)
        if header != expected:
            wrong = ', '.join(f"{k} {header[k]!r} (expected {v!r})" for k, v in expected.items() if header[k] != v)
            raise RuntimeError(f"the per-sample state shard '{path}' does not belong to this checkpoint: {wrong}; "
                               f"it was written by another save (a run that overwrote the directory?)")
        lo, hi = max(start, sharding.start), min(stop, sharding.stop)
        for key in tables:
            rows = shard['tables'].get(key)
            if rows is None or rows.numel() != stop - start:
                raise RuntimeError(f"the per-sample state shard '{path}' lacks the rows of '{key}'")
            if lo < hi:
                out[key][lo - sharding.start:hi - sharding.start] = rows[lo - start:hi - start]
        del shard
    return out
