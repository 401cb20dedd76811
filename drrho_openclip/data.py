"""Batch extras: each sample's dense index and, when a feature store is given, the batch's reference features.

The training loop receives batches `(images, texts, extras)` where `extras` is a dict of batched tensors that is
passed on to the loss as keywords (`index`, `ref_image_features`, `ref_text_features`). Only the index travels with
each sample; the reference features are looked up once per batch, after collation (`CollateWithReferenceFeatures`):
one read of each shard the batch touches, one decode and one finiteness check, instead of all three per sample.
"""
import torch
from torch.utils.data import Dataset, default_collate

from .features import FeatureStore, shard_name


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
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also queue the seeding of every accelerator, per sample
            torch.default_generator.manual_seed((self.seed * 1_000_003 + self.sampler.epoch) * 2_147_483_647 + index)
            image, text = self.dataset[index]
        return image, text, {'index': index}  # a plain int: collation makes the batch's int64 tensor


class SampleIndexFromKey:
    """WebDataset stage: a sample's dense index, looked up by (shard file name, `__key__`) in a store (with features
    or keys only); without a store, no extras."""

    def __init__(self, store: FeatureStore = None):
        self.store = store

    def __call__(self, sample: dict) -> dict:
        if self.store is None:
            sample['extras'] = {}
        else:
            sample['extras'] = {'index': self.store.index_of(shard_name(sample['__url__']), sample['__key__'])}
        return sample


class CollateWithReferenceFeatures:
    """Collates `(image, text, {'index': i})` samples as `default_collate` does, then adds the reference features of
    the batch's index from the store. A DataLoader's `collate_fn` or `wds.batched`'s `collation_fn`: it runs in the
    loader workers."""

    def __init__(self, store: FeatureStore):
        self.store = store

    def __call__(self, samples):
        batch = default_collate(samples)
        extras = batch[2]
        extras['ref_image_features'], extras['ref_text_features'] = self.store.batch_features(extras['index'])
        return batch
