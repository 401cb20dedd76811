"""The training loaders' per-sample extras (`BatchExtras`): each sample's dense index, and each batch's reference
features once it is collated. WebDataset input keeps OpenCLIP's own pipeline (the plugin adds the extras through
the patch's wds_sample_extras hook); map-style input (CSV, synthetic) gets a loader of its own here. Once the
training loader exists, the loss is also told how many optimiser steps the run has.

The training loop receives batches `(images, texts, extras)` and passes the extras on to the loss as keywords. Only
the index travels with each sample; the reference features are looked up once per batch, after collation
(`CollateWithReferenceFeatures`): one read of each shard the batch touches, one decode and one finiteness check,
instead of all three per sample."""
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from ..data import input_kind, shard_urls
from ..features import FeatureStore, shard_name
from ..losses.collectives import run_log
from . import BatchExtras
from .run import Run

SEED_RANGE = 1 << 64  # torch's generators take seeds in [0, 2^64)


def wds_sample_extras(run: Run, args):
    """(sample -> its index, the collation adding the batch's reference features), or None when the loss reads
    neither: OpenCLIP's own batches."""
    if run.plain_clip or run.index_store is None:
        return None
    collate = default_collate if run.reference_store is None else CollateWithReferenceFeatures(run.reference_store)
    return SampleIndexFromKey(run.index_store), collate


def wrap_data(run: Run, data: dict, args) -> dict:
    """OpenCLIP's CSV/synthetic training loader replaced by one that attaches the extras; and the loss told the
    run's number of optimiser steps, counted as OpenCLIP's learning-rate schedule counts them."""
    if 'train' not in data or run.plain_clip:
        return data
    _check_every_webdataset_worker_forms_a_batch(run, args)
    data = _with_sample_extras(run, data, args)
    batches = data['train'].dataloader.num_batches
    steps = batches // args.accum_freq * args.epochs
    if steps < 1:
        raise SystemExit(f"drrho-openclip: this run has no optimiser step: {batches} training batches per epoch "
                         f"// --accum-freq {args.accum_freq} × --epochs {args.epochs} = 0; give more training "
                         f"data, a smaller --batch-size or --accum-freq, or more --epochs")
    if hasattr(run.loss, 'set_total_steps'):
        lr_tau = run.loss.set_total_steps(steps)
        if lr_tau is not None:
            run_log.info(f"drrho-openclip: the run has {steps} optimiser steps, so --lr-tau auto is "
                         f"1/{steps} = {lr_tau:.3g}")
    return data


def _check_every_webdataset_worker_forms_a_batch(run: Run, args):
    """OpenCLIP's WebDataset loader (without --dataset-resampled) has each of its world size × workers readers pass
    over its share of the shards again and again until it has its epoch's batches, forming batches within one pass:
    a reader whose shards hold fewer samples than a batch never forms one, and the run waits at its first step
    forever. A reader gets at least (shards // readers) of the shards, shuffled anew each epoch, so the fewest samples
    one can have are those of that many of the smallest shards (the store's counts: the samples that decode)."""
    webdataset = input_kind(args.train_data, args.dataset_type) == 'webdataset'
    if run.index_store is None or args.dataset_resampled or not webdataset:
        return
    urls = shard_urls(args.train_data)
    counts = sorted(run.index_store.shard(shard_name(url)).count for url in urls)
    readers = args.world_size * max(1, args.workers)
    fewest = sum(counts[:len(urls) // readers])
    if fewest < args.batch_size:
        remedies = ['fewer --workers'] * (args.workers > 1) + ['a smaller --batch-size', '--dataset-resampled']
        raise SystemExit(f"drrho-openclip: OpenCLIP's WebDataset loader would wait forever for a first batch: its "
                         f"{readers} readers ({args.world_size} rank(s) × {max(1, args.workers)} worker(s)) each pass "
                         f"over {len(urls) // readers} or more of the {len(urls)} shards, which can hold as few as "
                         f"{fewest} samples, fewer than --batch-size {args.batch_size}, and a batch forms within one "
                         f"pass; give {', '.join(remedies[:-1])} or {remedies[-1]}")


def _with_sample_extras(run: Run, data: dict, args) -> dict:
    from open_clip_train.data import CsvDataset, DataInfo, SyntheticDataset
    info = data['train']
    dataset = getattr(info.dataloader, 'dataset', None)  # WebDataset's WebLoader has none
    if not isinstance(dataset, (CsvDataset, SyntheticDataset)):
        return data
    store = run.reference_store  # checked against the data at start-up (flags.py)
    sampler = GlobalBatchSampler(dataset, args.world_size, args.rank, args.seed, args.batch_size * args.accum_freq)
    loader = DataLoader(WithSampleExtras(dataset, sampler, args.seed), batch_size=args.batch_size,
                        num_workers=args.workers, pin_memory=info.dataloader.pin_memory, sampler=sampler,
                        drop_last=True, collate_fn=None if store is None else CollateWithReferenceFeatures(store))
    loader.num_samples, loader.num_batches = info.dataloader.num_samples, len(loader)
    data['train'] = DataInfo(loader, sampler)
    return data


class GlobalBatchSampler(DistributedSampler):
    """Each epoch's order is a function of (seed, epoch), for exact resume (also with one process), and every step's
    global batch holds the same samples in the same order at any world size: the epoch's permutation is cut into
    windows of W blocks of `rows` (batch × accum_freq), and rank r takes the r-th block of each, so the global batch
    gathered in rank order is the one process's batch. DistributedSampler deals the permutation round-robin
    instead: the same samples per step, in another order, which changed what is chosen from the first anchors of
    the first batch ('auto' τ and teacher scale above batch 512), and padded the epoch with repeated samples to a
    multiple of W (a step more than one process where N mod (W × batch) > W × (batch − 1)). A last incomplete window
    is left out, as one process leaves out its last incomplete batch."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, rows: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.rows = rows
        self.num_samples = len(dataset) // (rows * num_replicas) * rows
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
        order = torch.randperm(len(self.dataset), generator=generator)[:self.total_size]
        return iter(order.view(-1, self.num_replicas, self.rows)[:, self.rank].reshape(-1).tolist())


class WithSampleExtras(Dataset):
    """A map-style dataset (OpenCLIP's CSV or synthetic) whose row number is the sample index.

    Its random augmentation is seeded by (seed, epoch, index), so a sample looks the same whichever rank, loader
    worker or process draws it: a resumed run, or one with another world size, sees exactly the same batches.
    The epoch is read from the (distributed) sampler, which OpenCLIP sets before every epoch.
    """

    def __init__(self, dataset, sampler, seed: int):
        self.dataset = dataset
        self.sampler = sampler
        self.seed = seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        # the product passes torch's seed range from --seed 8590 on
        seed = ((self.seed * 1_000_003 + self.sampler.epoch) * 2_147_483_647 + index) % SEED_RANGE
        python_state, numpy_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also queue the seeding of every accelerator, per sample
            torch.default_generator.manual_seed(seed)
            # and Python's and numpy's, which timm's augmentations (--aug-cfg use_timm=True) draw from
            random.seed(seed)
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
            try:
                image, text = self.dataset[index]
            finally:  # the caller's own draws go on as if this had not run, as fork_rng leaves torch's
                random.setstate(python_state)
                np.random.set_state(numpy_state)
        return image, text, BatchExtras(index=index)  # a plain int: collation makes the batch's int64 tensor


class SampleIndexFromKey:
    """A WebDataset sample's extras: its dense index, looked up by (shard file name, `__key__`) in a store (with
    features or keys only)."""

    def __init__(self, store: FeatureStore):
        self.store = store

    def __call__(self, sample: dict) -> BatchExtras:
        return BatchExtras(index=self.store.index_of(shard_name(sample['__url__']), sample['__key__']))


class CollateWithReferenceFeatures:
    """Collates `(image, text, {'index': i})` samples as `default_collate` does, then adds the reference features of
    the batch's index from the store. A DataLoader's `collate_fn` or `wds.batched`'s `collation_fn`: it runs in the
    loader workers."""

    def __init__(self, store: FeatureStore):
        self.store = store

    def __call__(self, samples):
        batch = default_collate(samples)
        extras: BatchExtras = batch[2]
        extras['ref_image_features'], extras['ref_text_features'] = self.store.batch_features(extras['index'])
        return batch
