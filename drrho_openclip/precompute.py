"""Precompute reference-model features for a training set (CSV or WebDataset shards), and check a store.

    drrho-openclip-features --model ViT-B-32 --pretrained openai --train-data 'shards/{00000..00099}.tar' --output ref/
    python -m drrho_openclip.precompute --model local-dir:./ref_model --pretrained ./ref/epoch_5.pt \
        --train-data train.csv --csv-img-key filepath --csv-caption-key title --output ref/
    drrho-openclip-features --keys-only --train-data 'shards/{00000..00099}.tar' --output index/
    drrho-openclip-features verify ref/ [--train-data 'shards/{00000..00099}.tar']
    drrho-openclip-features import feats/ --train-data 'shards/{00000..00099}.tar' --output ref/   # any model's
    drrho-openclip-features check ref/ --batch-size 4096          # is the reference good enough for this batch?

Images go through the reference model's own evaluation transform (no augmentation) and texts through its own
tokenizer, so the features do not depend on the learner's preprocessing.

`--keys-only` writes a store of sample keys alone, no model and no features: the sample index of WebDataset shards
for training's `--sample-index` (losses that keep per-sample state without reading reference features). It reads
the shards' keys exactly as a feature store does (tar members grouped by `__key__`, image-text samples only, in file
order, nothing decoded), so both kinds of store give every sample the same index, except after a sample whose image
cannot be decoded: a feature store leaves it out, a keys-only store (which decodes nothing) keeps its slot.

Many processes: `--num-parts P --part I` computes the I-th of P contiguous slices of the shard list (by default from
torchrun's RANK/WORLD_SIZE, a SLURM job array's task id and count, or the tasks of an `srun -n N`). Every part writes
into `<output>.partial/`; the part that finds every shard there finishes the store (or `--finalize --output DIR`
does). Finished shards are skipped, so running the same command again resumes a killed run.
"""
import argparse
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Tuple

import numpy as np
import pandas as pd
import torch
from PIL import Image
from tqdm import tqdm

from .data import (UnreadableShard, add_data_args, caption_digests, caption_mismatch, data_keys, image_sizes,
                   local_file_sizes, local_path, missing_local_file, moved_folders, read_csv, resolve_dataset_type,
                   shard_keys, shard_samples, sources, undecodable_keys)
from .features import (DTYPES, LOCK, MANIFEST, UNIT_NORM_TOLERANCE, FeatureStore, FeatureStoreError,
                       FeatureStoreWriter, check_rows, finished_store_differences, lock_holder,
                       partial_dir, shard_files, shard_name)
from .openclip.reference import built_model, create_model, pretrained_problem

# How long a part that finds the store being finished by another waits to see it done (the move takes a moment;
# longer means that process died holding the lock)
FINISH_WAIT_S = 60


def _env_part():
    """(part, number of parts) of this process under torchrun, in a SLURM job array, as one of the tasks `srun -n N`
    starts, or in an array task's srun (its N parts of the task's), else (0, 1)."""
    env = os.environ
    if 'WORLD_SIZE' in env:
        return int(env.get('RANK', 0)), int(env['WORLD_SIZE'])
    part, num_parts = 0, 1
    if 'SLURM_ARRAY_TASK_COUNT' in env:
        task = int(env['SLURM_ARRAY_TASK_ID']) - int(env['SLURM_ARRAY_TASK_MIN'])
        part, num_parts = task // int(env.get('SLURM_ARRAY_TASK_STEP', 1)), int(env['SLURM_ARRAY_TASK_COUNT'])
    # srun's own step: SLURM_NTASKS would not do, as a batch script itself sees the job's task count with PROCID 0,
    # and would compute one part of several alone
    if 'SLURM_STEP_NUM_TASKS' in env and 'SLURM_PROCID' in env:
        tasks = int(env['SLURM_STEP_NUM_TASKS'])
        part, num_parts = part * tasks + int(env['SLURM_PROCID']), num_parts * tasks
    return part, num_parts


def default_workers() -> int:
    """Loader workers per process: the CPU cores this process may use (its share of them when torchrun starts several
    per node), less one for the encode loop, at most 8. Measured on 2 cores (benchmarks/precompute_throughput.py):
    one worker beside the model reaches 0.90x the bare model, two competing with it for both cores 0.77x."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()  # Linux / others
    cores = usable // max(1, int(os.environ.get('LOCAL_WORLD_SIZE', 1)))
    return max(1, min(8, cores - 1))


def part_slice(count: int, part: int, num_parts: int) -> slice:
    """The contiguous slice of `count` shards computed by part `part` of `num_parts` (sizes differ by at most 1)."""
    return slice(part * count // num_parts, (part + 1) * count // num_parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='drrho-openclip-features', description=__doc__.split('\n')[0],
                                epilog='Check a store: drrho-openclip-features verify DIR [--train-data ...]. Judge '
                                       'its reference model: drrho-openclip-features check DIR --batch-size BATCH. '
                                       'Features of any other model: drrho-openclip-features import --help',
                                allow_abbrev=False)
    p.add_argument('--model', help='OpenCLIP model name or local-dir:PATH')
    p.add_argument('--pretrained', default=None, help='pretrained tag or local checkpoint file')
    add_data_args(p, required=False)
    p.add_argument('--output', required=True, help='directory of the feature store to write')
    p.add_argument('--overwrite', action='store_true', help='replace an existing store in --output')
    p.add_argument('--keys-only', action='store_true',
                   help='write only the sample keys of WebDataset shards (no model, no features): the sample index '
                        "for training's --sample-index")
    p.add_argument('--dtype', choices=list(DTYPES), default=None,
                   help='storage dtype (default: float16, half the bytes of float32; int8: a quarter, plus a '
                        'float32 scale per vector)')
    part, num_parts = _env_part()
    p.add_argument('--num-parts', type=int, default=num_parts,
                   help='split the shards into this many contiguous parts, one per process (default: WORLD_SIZE '
                        'under torchrun, SLURM_ARRAY_TASK_COUNT in a job array, times the tasks of an srun step, '
                        'else 1)')
    p.add_argument('--part', type=int, default=part,
                   help='the part to compute, from 0 (default: RANK, or the array task index and srun task, '
                        'from 0)')
    p.add_argument('--finalize', action='store_true',
                   help='only finish the store in <output>.partial/ once all its shards are written (needs only '
                        '--output; the last part to end does this by itself)')
    p.add_argument('--batch-size', type=int, default=None, help='images per forward pass (default: 256)')
    p.add_argument('--workers', type=int, default=default_workers(),
                   help='data-loading processes, each reading whole shards (default: the cores of this process less '
                        'one, at most 8: %(default)s here)')
    default_device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else 'cpu'
    p.add_argument('--device', default=None, help=f'device of the model (default: {default_device})')
    args = resolve_dataset_type(p.parse_args(argv))
    if args.keys_only:
        unused = [flag for flag, value in (('--model', args.model), ('--pretrained', args.pretrained),
                                           ('--dtype', args.dtype), ('--batch-size', args.batch_size),
                                           ('--device', args.device)) if value is not None]
        if unused:
            p.error(f"{', '.join(unused)}: not used with --keys-only, which writes sample keys alone (no model, no "
                    f"features)")
        if args.finalize:
            p.error('--finalize reads the settings of the unfinished store in <output>.partial/: drop --keys-only')
        if args.dataset_type == 'csv':
            p.error('--keys-only is for WebDataset shards: the rows of a CSV are its sample index already')
    else:
        args.dtype = args.dtype or 'float16'
        args.batch_size = 256 if args.batch_size is None else args.batch_size
        if args.batch_size < 1:
            p.error(f'--batch-size must be at least 1, not {args.batch_size}')
        args.device = args.device or default_device
    if not args.finalize and args.train_data is None:
        p.error('--train-data is required (except with --finalize)')
    if not (args.finalize or args.keys_only) and args.model is None:
        p.error('--model is required (except with --keys-only or --finalize)')
    problem = args.model and pretrained_problem(args.model, args.pretrained)
    if problem:
        p.error(f"--pretrained: {problem}")
    if not 0 <= args.part < args.num_parts:
        p.error(f'--part must be in [0, --num-parts), got --part {args.part} --num-parts {args.num_parts}')
    return args


class UnreadableImage(ValueError):
    """An image of a CSV that cannot be decoded: precompute stops, naming it (`_stopping_at_unreadable`)."""


def _stopping_at_unreadable(batches):
    """`batches`, where an unreadable image or shard stops precompute with its one line: raised in a loader worker,
    torch raises it again with the worker's traceback in its message, whose last line is the error's."""
    try:
        yield from batches
        return
    except (UnreadableImage, UnreadableShard) as e:
        line = str(e).rstrip().splitlines()[-1].split(f'{type(e).__name__}: ', 1)[-1]
        # torch raises it again from a frame that holds it, a reference cycle through its traceback, whose frames
        # hold the loader's iterator: cleared, the iterator stops its worker processes now, not at the next garbage
        # collection (at exit, one interrupted while it joins them)
        traceback.clear_frames(e.__traceback__)
    raise SystemExit(line)  # outside the handler: the error is not its context


class _CsvImages(torch.utils.data.Dataset):
    def __init__(self, paths, captions, transform, tokenizer):
        self.paths, self.captions, self.transform, self.tokenizer = paths, captions, transform, tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        try:  # OpenCLIP's CsvDataset stops at such an image too: name it
            image = self.transform(Image.open(str(self.paths[i])))
        except (OSError, ValueError) as e:
            raise UnreadableImage(f"CSV row {i} (from 0, the header not counted): image '{self.paths[i]}' cannot "
                                  f"be read ({type(e).__name__}: {e})") from e
        return image, self.tokenizer([str(self.captions[i])])[0]


class _ShardBatches(torch.utils.data.IterableDataset):
    """(shard name, keys, images, texts) batches, each from one shard in file order, then (name, None, None, None)
    at the shard's end. A loader worker reads whole shards, so a shard's batches, and hence its features, are the
    same whatever the number of workers or parts."""

    def __init__(self, shards, preprocess, tokenizer, batch_size):
        self.shards, self.preprocess, self.tokenizer, self.batch_size = shards, preprocess, tokenizer, batch_size

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        for name, url in self.shards if worker is None else self.shards[worker.id::worker.num_workers]:
            batch = []
            for sample in shard_samples(url):
                batch.append(sample)
                if len(batch) == self.batch_size:
                    yield self._collate(name, batch)
                    batch = []
            if batch:
                yield self._collate(name, batch)
            yield name, None, None, None

    def _collate(self, name, batch):
        return (name, [k for k, _, _ in batch], torch.stack([self.preprocess(image) for _, image, _ in batch]),
                self.tokenizer([str(text) for _, _, text in batch]))


class _ShardKeys(torch.utils.data.IterableDataset):
    """(shard name, keys of its image-text samples) for each shard; a loader worker reads whole shards."""

    def __init__(self, shards):
        self.shards = shards

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        for name, url in self.shards if worker is None else self.shards[worker.id::worker.num_workers]:
            yield name, shard_keys(url)


def _csv_batches(args, df, preprocess, tokenizer):
    """The same stream as _ShardBatches for the one shard of a CSV file (its rows `df`)."""
    dataset = _CsvImages(df[args.csv_img_key].tolist(), df[args.csv_caption_key].tolist(), preprocess, tokenizer)
    name, start = shard_name(args.train_data), 0
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                         pin_memory=_is_cuda(args.device))
    for images, texts in loader:
        yield name, dataset.paths[start:start + len(images)], images, texts
        start += len(images)
    yield name, None, None, None


def _is_cuda(device) -> bool:
    """Where pinned batches, non-blocking copies and one wait per shard apply."""
    return torch.device(device).type == 'cuda'


@torch.no_grad()
def _encode(model, images, texts, device):
    """The batch's features, their copy to the host queued without waiting for it: waiting per batch would keep the
    host from queuing the next batch while the device works on this one. `_fetch` waits, once per shard."""
    image_features = model.encode_image(images.to(device, non_blocking=True), normalize=True)
    text_features = model.encode_text(texts.to(device, non_blocking=True), normalize=True)
    # from a CUDA device, a non-blocking copy to the host lands in pinned memory and returns at once (`_fetch`
    # waits for CUDA only, so other devices copy as before)
    cuda = _is_cuda(device)
    return (image_features.float().to('cpu', non_blocking=cuda), text_features.float().to('cpu', non_blocking=cuda))


def _fetch(parts, device) -> Tuple[np.ndarray, np.ndarray]:
    """One shard's (image, text) features from its `_encode` parts (keys, image, text), once their copies to the
    host have landed: one wait for the whole shard."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)
    return torch.cat([p[1] for p in parts]).numpy(), torch.cat([p[2] for p in parts]).numpy()


def _reference_flags(args) -> str:
    """The reference model as the command line names it, for messages."""
    return f"--model {args.model}" + (f" --pretrained {args.pretrained}" if args.pretrained else '')


def _load_encoder(args):
    """(model, preprocess, tokenizer) of the reference; a model that cannot be loaded stops precompute naming it."""
    from .openclip.evaluation import tokenizer_of
    try:
        model, preprocess = create_model(args.model, args.pretrained, args.device)
        return model, preprocess, tokenizer_of(args.model)
    except (RuntimeError, ValueError, OSError) as e:
        raise SystemExit(f"cannot load the reference model {_reference_flags(args)} on --device {args.device}: "
                         f"{e}") from None


def _compute(args, shards, writer, encoder):
    """Encode `shards` ([(name, source)]) with `encoder` (`_load_encoder`), writing each one as soon as its last
    batch is encoded; returns (samples, seconds of encoding)."""
    model, preprocess, tokenizer = encoder
    total = None  # samples to encode, where known without reading the data: a CSV's rows (an ETA)
    if args.dataset_type == 'csv':
        df = read_csv(args)
        batches, total = _csv_batches(args, df, preprocess, tokenizer), len(df)
    else:
        batches = torch.utils.data.DataLoader(_ShardBatches(shards, preprocess, tokenizer, args.batch_size),
                                              batch_size=None, num_workers=args.workers,
                                              pin_memory=_is_cuda(args.device))
    encoded = {}  # shard name -> its (keys, image features, text features) batches so far
    url_of, empty, dim = dict(shards), [], None
    samples, start = 0, time.perf_counter()
    # closed however the loop ends: a stop at a bad sample left the bar to print itself at interpreter exit
    with tqdm(total=total, unit='sample', desc=f'part {args.part}/{args.num_parts}',  # samples/s, ETA
              dynamic_ncols=True) as progress:
        for name, keys, images, texts in _stopping_at_unreadable(batches):
            if keys is not None:
                encoded.setdefault(name, []).append((keys, *_encode(model, images, texts, args.device)))
                samples += len(keys)  # counted here: a disabled progress bar counts nothing
                progress.update(len(keys))
                continue
            parts = encoded.pop(name, None)
            csv = args.dataset_type == 'csv'
            if not parts and csv:
                raise SystemExit(f"--train-data '{url_of[name]}' holds no image-text samples")
            if not parts:  # img2dataset's shard where every download failed: written once the features' size is known
                empty.append(name)
                continue
            keys, (image, text) = [k for p in parts for k in p[0]], _fetch(parts, args.device)
            dim = image.shape[1]
            try:  # a reference with a NaN in its weights (or a zero feature) is found at its first shard, not at verify
                check_rows(name, keys, image, text, normalize_hint='the encoders normalise theirs')
            except FeatureStoreError as e:
                raise SystemExit(f"the reference {_reference_flags(args)} gives features that cannot be stored: {e}; "
                                 f"nothing of the shard was written")
            _add_shard(writer, url_of[name], name, keys, image, text, rows_are_index=csv)
            progress.set_postfix(shards=f'{len(writer.shards)}/{len(shards)}')
    for name in empty:
        dim = dim or writer.dim or _feature_dim(encoder, args.device)
        none = np.zeros((0, dim), np.float32)
        _add_shard(writer, url_of[name], name, [], none, none)
    return samples, time.perf_counter() - start


def _feature_dim(encoder, device) -> int:
    """The size of the encoder's features, from one blank image (for a store whose shards hold no sample yet)."""
    model, preprocess, tokenizer = encoder
    with torch.no_grad():
        return _encode(model, preprocess(Image.new('RGB', (8, 8)))[None], tokenizer(['']), device)[0].shape[1]


def _write_keys(args, shards, writer) -> int:
    """Write the keys of `shards` ([(name, url)]), each shard as soon as it is read; returns the number of samples."""
    samples, url_of = 0, dict(shards)
    keys_of_shards = torch.utils.data.DataLoader(_ShardKeys(shards), batch_size=None, num_workers=args.workers)
    for name, keys in tqdm(_stopping_at_unreadable(keys_of_shards), total=len(shards), unit='shard',
                           desc=f'part {args.part}/{args.num_parts}', dynamic_ncols=True):
        _add_shard(writer, url_of[name], name, keys)  # none: img2dataset's shard where every download failed
        samples += len(keys)
    return samples


def _add_shard(writer, url, name, keys, *features, rows_are_index=False):
    """`writer.add_shard`, whose only FeatureStoreError is a key the data file repeats: training finds a tar
    sample's features by its key, so the data, not the reference, is at fault."""
    try:
        writer.add_shard(name, keys, *features, rows_are_index=rows_are_index)
    except FeatureStoreError as e:
        raise SystemExit(f"--train-data '{url}': {e}; nothing of the shard was written") from None


def _finalize(writer, explicit: bool) -> int:
    ended = writer.take_over_ended_lock() if explicit else None
    if ended is not None:
        logging.warning(f"'{writer.root / LOCK}' was left by process {ended} of this host, which has ended while "
                        f"finishing the store: finishing it in its place")
    try:
        done = writer.close()
    except FeatureStoreError as e:
        raise SystemExit(str(e))
    if done:
        store = FeatureStore.open(writer.final)
        what, kind = ('the keys', 'keys only') if store.keys_only else ('reference features', store.dtype)
        logging.info(f"wrote {what} of {store.num_samples} samples ({len(store.shards)} shards, {kind}) to "
                     f"{writer.final}")
        return 0
    if not explicit:  # parts that end together: the one holding the lock takes a moment to move the store
        deadline = time.monotonic() + FINISH_WAIT_S
        while writer.root.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    if not writer.root.exists():
        logging.info(f"another process finished the store in {writer.final}")
        return 0
    holder = lock_holder(writer.root / LOCK)
    by = f", taken by process {holder[1]} on {holder[0]}" if holder is not None else ''
    message = (f"'{writer.root / LOCK}' exists{by}: another process is finishing the store (or died doing so: if it "
               f"no longer runs, delete that file and run --finalize; on that host --finalize finds it ended itself)")
    if explicit:
        raise SystemExit(message)
    # no store at --output: a job chain must not count this part as the end of a finished precompute
    logging.error(f"{message}; no store was written to {writer.final} yet")
    return 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ['verify']:
        return verify(argv[1:])
    if argv[:1] == ['import']:
        from .store_import import main as import_features
        return import_features(argv[1:])
    if argv[:1] == ['check']:
        from .reference_check import main as check
        return check(argv[1:])
    if argv and not argv[0].startswith('-'):  # precompute takes flags only: a mistyped command
        raise SystemExit(f"drrho-openclip-features: no command '{argv[0]}' (the commands: verify, check, import; "
                         f"precompute has none, only flags: see --help)")
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    try:
        if args.finalize:
            return _finalize(FeatureStoreWriter.resume(args.output), explicit=True)
        shards = sources(args)
        missing = missing_local_file(shards)
        if missing:
            raise SystemExit(f"--train-data: no such file '{missing}'")
        # a CSV is read here, once, before a .partial store is started
        frame = read_csv(args) if args.dataset_type == 'csv' else None
        captions = caption_digests(args, frame)
        images = image_sizes(args, frame)
        names = [name for name, _ in shards]
        sizes = None if args.dataset_type == 'csv' else local_file_sizes(shards)  # a CSV is checked row by row
        # the model as built: a store of an earlier version, which built GELU where the tag needs QuickGELU, differs
        settings = (None, None, None) if args.keys_only else (built_model(args.model, args.pretrained),
                                                              args.pretrained or '', args.dtype)
        if args.keys_only:
            captions = images = None  # a keys-only store holds no features to check
        if (Path(args.output) / MANIFEST).exists() and not args.overwrite:
            differ = finished_store_differences(args.output, *settings, names, sizes, captions, images)
            if differ:
                raise SystemExit(f"{args.output} already holds a reference-feature store, written with "
                                 f"{', '.join(differ)}; pass --overwrite to replace it")
            # a rerun (a resubmitted array task, a part that started after the last one finished): nothing to do
            logging.info(f"{args.output} already holds the finished store of these {len(names)} shards with these "
                         f"settings: nothing to do (--overwrite computes it again)")
            return 0
        # the model too: a mistyped --model must not leave a .partial store planned with it. A part that joins a
        # planned store loads it once it knows shards are left to encode: a rerun of a finished part needs none
        joining = partial_dir(args.output).exists()
        encoder = None if args.keys_only or joining else _load_encoder(args)
        model, pretrained, dtype = settings
        writer = FeatureStoreWriter(args.output, model, pretrained, dtype=dtype, shards=names, source_bytes=sizes,
                                    captions_sha256=captions, image_bytes=images)
    except FeatureStoreError as e:
        raise SystemExit(str(e))
    mine = shards[part_slice(len(shards), args.part, args.num_parts)]
    todo = [(name, source) for name, source in mine if not writer.finished(name)]
    where = f"part {args.part}/{args.num_parts}"
    logging.info(f"{where}: {len(mine)} of {len(shards)} shards"
                 + (f" ('{mine[0][0]}' to '{mine[-1][0]}')" if mine else '')
                 + f", {len(mine) - len(todo)} already finished in {writer.root}")
    if todo and args.keys_only:
        samples = _write_keys(args, todo, writer)
        logging.info(f"{where}: read the keys of {samples} samples of {len(todo)} shards")
    elif todo:
        samples, seconds = _compute(args, todo, writer, encoder or _load_encoder(args))
        logging.info(f"{where}: encoded {samples} samples of {len(todo)} shards in {seconds:.1f} s "
                     f"({samples / max(seconds, 1e-9):.1f} samples/s)")
    missing = writer.missing()
    if missing and writer.root.exists():  # else another part has just finished the store: _finalize says so
        logging.info(f"{where} done; {len(missing)} shards of other parts are not finished yet (the last part to "
                     f"end finishes the store)")
        return 0
    return _finalize(writer, explicit=False)


# ---- verify ------------------------------------------------------------------------------------------------------

def _check_shard(store, shard, expected_keys=None, url=None, csv=False):
    """(one-line report, problems) of one shard; every problem names the shard and the file at fault. With the
    data's keys, those missing from the store are read again from the shard `url` (WebDataset), and the samples that
    cannot be decoded are no problem: precompute leaves them out, and training never reads them. A `csv` shard's
    keys are its image paths row by row, which repeat where an image has several captions; a shard that records its
    captions is a CSV's."""
    name = shard.name
    csv = csv or shard.captions_sha256 is not None
    try:
        keys = store.keys(name).tolist()
        features = None if store.keys_only else store.shard_features(name)
    except FeatureStoreError as e:
        return f"{name}: unreadable", [str(e)]
    files = shard_files(name, store.dtype)
    keys_file = files[-1]
    problems = []
    counts = pd.Series(keys).value_counts()
    unique = len(counts) == len(keys)
    if not unique and not csv:
        problems.append(f"shard '{name}', file '{keys_file}': {int((counts > 1).sum())} keys appear more than "
                        f"once, e.g. '{counts.index[0]}' {counts.iloc[0]} times"
                        + (" (a CSV's store repeats the path of an image with several captions: check it with "
                           "--train-data CSV)" if expected_keys is None else ''))
    if features is None:
        values = 'keys only'
    else:
        values_file = files[1] if store.dtype == 'int8' else files[0]  # int8 values are finite: a NaN is in a scale
        finite = np.isfinite(features)
        if not finite.all():
            row = int(np.argwhere(~finite)[0][0])
            problems.append(f"shard '{name}', file '{values_file}': {int((~finite).sum())} non-finite values (first "
                            f"in row {row})")
        off = np.abs(np.linalg.norm(features, axis=-1) - 1) > UNIT_NORM_TOLERANCE  # NaN rows are counted above
        if off.any():
            problems.append(f"shard '{name}', file '{values_file}': {int(off.any(axis=1).sum())} samples whose "
                            f"features are not unit-norm (first in row {int(np.argwhere(off)[0][0])})")
        values = f"dim {features.shape[-1]}, {store.dtype}, {int((~finite).sum())} non-finite"
    coverage = ''
    if expected_keys is not None and csv:
        differ = next((row for row, (a, b) in enumerate(zip(keys, expected_keys)) if str(a) != str(b)), None)
        coverage = f", {len(expected_keys)} rows in the CSV"
        if len(keys) != len(expected_keys):
            problems.append(f"shard '{name}', file '{keys_file}': {len(keys)} rows, the CSV has {len(expected_keys)}")
        elif differ is not None:
            moved = moved_folders(keys, expected_keys)
            if moved:
                coverage += (f", the same files below '{moved[1]}' (written below '{moved[0]}': a moved dataset, "
                             f"which training reads)")
            else:
                problems.append(f"shard '{name}', file '{keys_file}': row {differ} is '{keys[differ]}' in the store "
                                f"and '{expected_keys[differ]}' in the CSV")
    elif expected_keys is not None:
        stored, wanted = set(keys), set(expected_keys)
        left_out = undecodable_keys(url, wanted - stored) if url and wanted - stored else set()
        coverage = f", {len(wanted & stored)}/{len(wanted)} data keys present" + (
            f" ({len(left_out)} left out: their images cannot be decoded, e.g. '{min(left_out)}')" if left_out else '')
        for what, extra in (('samples of the data have no features', wanted - stored - left_out),
                            ('keys are not samples of the data', stored - wanted)):
            if extra:
                problems.append(f"shard '{name}', file '{keys_file}': {len(extra)} {what}, e.g. '{min(extra)}'")
    keys_said = 'unique' if unique else 'repeated (image paths of several rows)' if csv else 'NOT unique'
    report = f"{name}: {len(keys)} samples, keys {keys_said}, {values}{coverage}"
    return report, problems


def _size_warning(shard, url) -> str:
    """A warning where the local tar `url` differs in size from the file `shard` was written from (training warns
    alike at start-up), else ''."""
    local = local_path(url) if url else None
    if shard.source_bytes is None or local is None or not os.path.isfile(local):
        return ''
    size = os.path.getsize(local)
    if size == shard.source_bytes:
        return ''
    return (f"shard '{shard.name}': '{url}' has {size} bytes, the file the store was written from "
            f"{shard.source_bytes}: a shard filtered since is read rightly, another dataset's shard of the same name and keys would read "
            f"other samples' features")


def verify(argv=None) -> int:
    """`drrho-openclip-features verify DIR`: a line per shard, then every problem; exit status 1 if any."""
    p = argparse.ArgumentParser(prog='drrho-openclip-features verify', allow_abbrev=False,
                                description='Check a reference-feature store: per shard its sample count, unique '
                                            'keys, dimension, dtype, finite unit-norm features (none in a keys-only '
                                            'store), and with --train-data that its keys are exactly the samples of '
                                            'the data (and a warning where a local shard differs in size from the '
                                            'file the store was written from; for a CSV, that its captions are '
                                            'those the store was written from).')
    p.add_argument('store', help='the store directory')
    add_data_args(p, required=False)
    args = resolve_dataset_type(p.parse_args(argv))
    try:
        store = FeatureStore.open(args.store, check_sizes=False)  # a file cut short: a problem of its shard, below
    except FeatureStoreError as e:
        print(f"PROBLEM: {e}")
        return 1
    try:  # by the store's names of the data's shards; a CSV read once
        frame = read_csv(args) if args.train_data and args.dataset_type == 'csv' else None
        data = {store.stored_name(name): keys
                for name, keys in (data_keys(args, frame) if args.train_data else {}).items()}
        captions = {store.stored_name(name): digest
                    for name, digest in (caption_digests(args, frame) if args.train_data else {}).items()}
    except OSError as e:  # a shard or CSV of --train-data that cannot be read
        print(f"PROBLEM: --train-data: {e}")
        return 1
    if store.keys_only:
        contents = 'keys only (a sample index, no features)'
    else:
        contents = f"dim {store.dim}, {store.dtype}, model {store.model}" + (
            f" ({store.pretrained})" if store.pretrained else '')
    print(f"{store.root}: {len(store.shards)} shards, {store.num_samples} samples, {contents}")
    problems = [f"shard '{name}' of --train-data has no {'keys' if store.keys_only else 'features'} in '{store.root}'"
                for name in data if name not in {s.name for s in store.shards}]
    csv = args.dataset_type == 'csv'
    urls = {store.stored_name(name): url for name, url in sources(args)} if args.train_data and not csv else {}
    warnings = []
    for shard in store.shards:
        if args.train_data and not csv and shard.name not in data:
            # training accepts a store of more shards than it reads: their keys have nothing to be compared with
            report, found = _check_shard(store, shard)
            report += ', not a shard of --train-data'
        else:
            report, found = _check_shard(store, shard, data.get(shard.name, []) if args.train_data else None,
                                         urls.get(shard.name), csv=csv)
        mismatch = caption_mismatch(shard, captions[shard.name], args) if shard.name in captions else None
        found += [mismatch] if mismatch else []
        if shard.name in captions and shard.captions_sha256 is None:
            warnings.append(f"shard '{shard.name}' records no captions (a store written before stores did, or by "
                            f"the Python API without them): its text features cannot be checked against column "
                            f"'{args.csv_caption_key}'; write the store again to have them checked")
        warning = _size_warning(shard, urls.get(shard.name))
        print(report + (' -- PROBLEM' if found else '') + (' -- size differs' if warning else ''))
        problems += found
        warnings += [warning] if warning else []
    for warning in warnings:
        print(f"WARNING: {warning}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(f"{len(problems)} problem{'s' * (len(problems) > 1)}" if problems else 'OK')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
