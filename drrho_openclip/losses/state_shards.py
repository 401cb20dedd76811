"""Per-rank files of the per-sample tables: written by W ranks, read back by any number of ranks.

A shard set is a directory with one file per rank of the run that wrote it,

    <directory>/rank-0-of-W.shard, ..., rank-(W-1)-of-W.shard

file r holding the rows `shard_block(N, r, W)` (a contiguous block of ⌈N/W⌉ rows) of every per-sample table of the
loss, with the set's metadata (save id, N, W, r, the table names). A rank that reads the set takes the rows of its
own block (or all rows, replicated) from the files that overlap it, memory-mapped: a different world size re-shards
on load. The set is written into `<directory>.tmp-<save id>/` and renamed into place once every rank's file is
complete; the manifest `save_state_shards` returns (the checkpoint stores it) names the set's save id, which every
file must carry, so a set overwritten by another save, or incomplete, is an error naming the file, never a silent
restart. The files' suffix is not `.pt`, so a glob for checkpoints (`--resume latest`) never picks them.

Only torch is needed here; `plugin.py` places the sets next to OpenCLIP's checkpoints.
"""
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from .core import per_sample_tables, shard_block

FORMAT = 'drrho-openclip per-sample state shard'
VERSION = 1
SUFFIX = '.shard'


def shard_file_name(rank: int, world_size: int) -> str:
    return f'rank-{rank}-of-{world_size}{SUFFIX}'


def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_ok(ok: bool, what: str, world_size: int, error: Exception = None):
    """Raise on every rank if any rank failed (a bare barrier would leave the others waiting forever)."""
    if _distributed(world_size):
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        if dist.get_backend() == 'nccl':
            flag = flag.cuda()
        dist.all_reduce(flag)
        failed = int(flag.item())
    else:
        failed = 0 if ok else 1
    if failed:
        raise RuntimeError(f"{what} failed on {failed} rank(s)" + (f": {error}" if error is not None else "")) \
            from error


def save_state_shards(loss, directory) -> dict:
    """Write this rank's block of every per-sample table of `loss` into the shard set `directory` (replacing one
    that is there). Collective: every rank of the loss's world calls it. Returns the set's manifest."""
    tables = per_sample_tables(loss)
    if not tables:
        raise ValueError("this loss keeps no per-sample tables")
    sharding = next(iter(tables.values()))[1]
    rank, world_size, num_samples = sharding.rank, sharding.world_size, sharding.num_samples
    directory = Path(directory)
    save_id = [uuid.uuid4().hex if rank == 0 else None]
    if _distributed(world_size):
        dist.broadcast_object_list(save_id, src=0)
    save_id = save_id[0]
    staging = directory.parent / f'{directory.name}.tmp-{save_id}'
    start, stop = shard_block(num_samples, rank, world_size)
    error = None
    try:
        staging.mkdir(parents=True, exist_ok=True)
        rows = {key: getattr(module, key.rsplit('.', 1)[-1])[start - s.start:stop - s.start].detach().cpu().clone()
                for key, (module, s) in tables.items()}
        payload = dict(format=FORMAT, version=VERSION, save_id=save_id, rank=rank, world_size=world_size,
                       num_samples=num_samples, start=start, stop=stop, tables=rows)
        path = staging / shard_file_name(rank, world_size)
        torch.save(payload, f'{path}.tmp')
        os.replace(f'{path}.tmp', path)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    _all_ok(error is None, f"writing the per-sample state shards to '{staging}'", world_size, error)
    if rank == 0:
        try:
            written = sorted(p.name for p in staging.iterdir())
            expected = sorted(shard_file_name(r, world_size) for r in range(world_size))
            if written != expected:
                raise RuntimeError(f"'{staging}' holds {written}, expected {expected} (every rank must see the "
                                   f"checkpoint directory: a shared file system)")
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(staging, directory)
        except Exception as e:  # noqa: BLE001
            error = e
    _all_ok(error is None, f"completing the per-sample state shard set '{directory}'", world_size, error)
    return dict(format=FORMAT, version=VERSION, directory=directory.name, save_id=save_id, world_size=world_size,
                num_samples=num_samples, tables=sorted(tables))


def read_shard_manifest(directory) -> dict:
    """The manifest of the shard set in `directory`, from its files (when the checkpoint's is not at hand)."""
    directory = Path(directory)
    files = sorted(directory.glob(f'rank-*-of-*{SUFFIX}')) if directory.is_dir() else []
    if not files:
        raise RuntimeError(f"'{directory}' holds no per-sample state shards")
    header = _open(files[0])
    return dict(format=FORMAT, version=VERSION, directory=directory.name, save_id=header['save_id'],
                world_size=header['world_size'], num_samples=header['num_samples'], tables=sorted(header['tables']))


def _open(path: Path) -> dict:
    try:
        return torch.load(path, map_location='cpu', mmap=True, weights_only=True)
    except Exception as e:
        raise RuntimeError(f"the per-sample state shard '{path}' cannot be read ({type(e).__name__}: {e}); the "
                           f"shard set is damaged") from e


def load_state_shards(loss, directory, manifest: dict = None) -> dict:
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
    if manifest is None:
        manifest = read_shard_manifest(directory)
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
        raise RuntimeError(f"the checkpoint holds no per-sample state ({', '.join(missing)}) for this loss in "
                           f"'{directory}': resume from a checkpoint written with the same --loss and --gamma < 1")
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
