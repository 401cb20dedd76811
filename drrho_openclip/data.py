"""Training data: the kind of input, and each batch's extras (`drrho_openclip.openclip.BatchExtras`): each sample's
dense index and, when a feature store is given, the batch's reference features.

The training loop receives batches `(images, texts, extras)` and passes the extras on to the loss as keywords. Only
the index travels with each sample; the reference features are looked up once per batch, after collation
(`CollateWithReferenceFeatures`): one read of each shard the batch touches, one decode and one finiteness check,
instead of all three per sample.
"""
import torch
from torch.utils.data import Dataset, default_collate

from .features import FeatureStore, shard_name
from .openclip import BatchExtras


def input_kind(train_data, dataset_type: str = 'auto') -> str:
    """'csv', 'synthetic' or 'webdataset': `dataset_type`, or for 'auto' what OpenCLIP makes of `train_data` (a
    .csv/.tsv file is a CSV, anything else WebDataset shards; several sources joined by '::')."""
    if dataset_type != 'auto':
        return dataset_type
    extension = str(train_data or '').split('::')[0].rsplit('.', 1)[-1].lower()
    return 'csv' if extension in ('csv', 'tsv') else 'webdataset'


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
