"""Per-sample batch extras: each sample's dense index and, when a feature store is given, its reference features.

The training loop receives batches `(images, texts, extras)` where `extras` is a dict of batched tensors that is
passed on to the loss as keywords (`index`, `ref_image_features`, `ref_text_features`).
"""
import os

import torch
from torch.utils.data import Dataset

from .features import FeatureStore, shard_name


def _extras(index: int, store: FeatureStore = None) -> dict:
    extras = {'index': torch.tensor(index, dtype=torch.long)}
    if store is not None:
        extras['ref_image_features'], extras['ref_text_features'] = store.features(index)
    return extras


class WithSampleExtras(Dataset):
    """A map-style dataset (OpenCLIP's CSV or synthetic) whose row number is the sample index.

    Its random augmentation is seeded by (seed, epoch, index), so a sample looks the same whichever rank, loader
    worker or process draws it: a resumed run, or one with another world size, sees exactly the same batches.
    The epoch is read from the (distributed) sampler, which OpenCLIP sets before every epoch.
    """

    def __init__(self, dataset, sampler, seed: int, store: FeatureStore = None):
        if store is not None and store.num_samples != len(dataset):
            raise ValueError(f"'{store.root}' holds {store.num_samples} reference features, the dataset has "
                             f"{len(dataset)} samples")
        self.dataset = dataset
        self.sampler = sampler
        self.seed = seed
        self.store = store

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also queue the seeding of every accelerator, per sample
            torch.default_generator.manual_seed((self.seed * 1_000_003 + self.sampler.epoch) * 2_147_483_647 + index)
            image, text = self.dataset[index]
        return image, text, _extras(index, self.store)


class SampleExtrasFromKey:
    """WebDataset stage: look a sample up by (shard file name, `__key__`) in the store and attach its extras."""

    def __init__(self, store: FeatureStore = None):
        self.store = store

    def __call__(self, sample: dict) -> dict:
        if self.store is None:
            sample['extras'] = {}
        else:
            index = self.store.index_of(shard_name(os.path.basename(sample['__url__'])), sample['__key__'])
            sample['extras'] = _extras(index, self.store)
        return sample
