"""Reference-feature store: precomputed, L2-normalised reference-model embeddings, one file per data shard.

Layout of a store directory:

    manifest.json              model, pretrained, dim, dtype and the ordered list of shards with their sample counts
    <shard>.features.npy       [n, 2, dim] array: [:, 0] image features, [:, 1] text features (float16 by default)
    <shard>.keys.npy           the n sample keys of the shard: WebDataset `__key__`s, or a CSV's image paths

A sample's dense index (the slot of its per-sample state) is its shard's offset plus its row in the shard, so it
never depends on how keys are spelt. Every file is written under a temporary name and renamed when complete, and
the manifest is written last: an interrupted precompute leaves no store that looks finished.
"""
import bisect
import json
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch

MANIFEST = 'manifest.json'
FORMAT_VERSION = 1
DTYPES = {'float16': np.float16, 'float32': np.float32}


class FeatureStoreError(ValueError):
    """A reference-feature store that cannot be used as it is; the message names the file, shard or key."""


@dataclass(frozen=True)
class Shard:
    name: str
    count: int
    offset: int


def shard_name(source: str) -> str:
    """The store name of a data shard or CSV file: its file name without extension(s)."""
    base = os.path.basename(str(source).rstrip('/'))
    return base.split('.')[0] if not base.startswith('.') else base


def _atomic_save(path: Path, array: np.ndarray):
    tmp = path.with_name(path.name + '.tmp')
    with open(tmp, 'wb') as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


class FeatureStore:
    """Read access to a store directory; arrays are memory-mapped and opened lazily (also in loader workers)."""

    def __init__(self, root, manifest: dict):
        self.root = Path(root)
        self.model = manifest.get('model')
        self.pretrained = manifest.get('pretrained')
        self.dim = int(manifest['dim'])
        self.dtype = manifest['dtype']
        self.shards: List[Shard] = []
        offset = 0
        for entry in manifest['shards']:
            self.shards.append(Shard(entry['name'], int(entry['count']), offset))
            offset += int(entry['count'])
        self.num_samples = offset
        self._by_name: Dict[str, Shard] = {s.name: s for s in self.shards}
        self._offsets = [s.offset for s in self.shards]

    @classmethod
    def open(cls, root) -> 'FeatureStore':
        root = Path(root)
        path = root / MANIFEST
        if not root.is_dir():
            raise FeatureStoreError(f"reference-feature directory '{root}' does not exist")
        if not path.is_file():
            raise FeatureStoreError(f"'{root}' is not a finished reference-feature store: '{path}' is missing "
                                    f"(write one with `drrho-openclip-features`)")
        try:
            manifest = json.loads(path.read_text())
            if manifest.get('format') != FORMAT_VERSION:
                raise FeatureStoreError(f"'{path}': unsupported format {manifest.get('format')!r}")
            if manifest['dtype'] not in DTYPES:
                raise FeatureStoreError(f"'{path}': unsupported dtype {manifest['dtype']!r}")
            store = cls(root, manifest)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise FeatureStoreError(f"'{path}' is corrupt: {e!r}") from e
        for shard in store.shards:
            for suffix in ('.features.npy', '.keys.npy'):
                if not (root / (shard.name + suffix)).is_file():
                    raise FeatureStoreError(f"shard '{shard.name}' of '{root}': file '{shard.name + suffix}' is missing")
        return store

    def shard(self, name: str) -> Shard:
        try:
            return self._by_name[name]
        except KeyError:
            raise FeatureStoreError(f"no reference features for shard '{name}' in '{self.root}' "
                                    f"(it has {len(self.shards)} shards, e.g. '{self.shards[0].name}')") from None

    @lru_cache(maxsize=64)
    def _features(self, name: str) -> np.ndarray:
        shard = self.shard(name)
        path = self.root / (name + '.features.npy')
        try:
            array = np.load(path, mmap_mode='r', allow_pickle=False)
        except Exception as e:  # numpy raises several types for truncated or foreign files
            raise FeatureStoreError(f"shard '{name}': '{path}' is corrupt ({e})") from e
        if array.shape != (shard.count, 2, self.dim):
            raise FeatureStoreError(f"shard '{name}': '{path}' has shape {tuple(array.shape)}, the manifest says "
                                    f"({shard.count}, 2, {self.dim})")
        return array

    @lru_cache(maxsize=64)
    def keys(self, name: str) -> np.ndarray:
        shard = self.shard(name)
        path = self.root / (name + '.keys.npy')
        try:
            keys = np.load(path, allow_pickle=False)
        except Exception as e:
            raise FeatureStoreError(f"shard '{name}': '{path}' is corrupt ({e})") from e
        if len(keys) != shard.count:
            raise FeatureStoreError(f"shard '{name}': '{path}' has {len(keys)} keys, the manifest says {shard.count}")
        return keys

    @lru_cache(maxsize=64)
    def _rows(self, name: str) -> Dict[str, int]:
        return {str(k): i for i, k in enumerate(self.keys(name))}

    def index_of(self, name: str, key: str) -> int:
        """Dense index of the sample `key` of shard `name`."""
        row = self._rows(name).get(str(key))
        if row is None:
            raise FeatureStoreError(f"sample '{key}' of shard '{name}' has no reference features in '{self.root}'")
        return self.shard(name).offset + row

    def features(self, index: int):
        """(image, text) reference features of a dense index, as float32 tensors."""
        if not 0 <= index < self.num_samples:
            raise FeatureStoreError(f"index {index} is outside '{self.root}' ({self.num_samples} samples)")
        shard = self.shards[bisect.bisect_right(self._offsets, index) - 1]
        pair = np.asarray(self._features(shard.name)[index - shard.offset], dtype=np.float32)
        if not np.isfinite(pair).all():
            raise FeatureStoreError(f"shard '{shard.name}', row {index - shard.offset}: non-finite features")
        pair = torch.from_numpy(pair)
        return pair[0], pair[1]


class FeatureStoreWriter:
    """Writes a store shard by shard into `<root>.partial/`; `close()` writes the manifest and only then moves the
    finished store to `root` (replacing a previous one), so `root` always holds a complete store or none."""

    def __init__(self, root, model: str, pretrained: str, dim: int, dtype: str = 'float16'):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.final = Path(root)
        self.root = self.final.with_name(self.final.name + '.partial')
        self.root.mkdir(parents=True, exist_ok=True)
        self.meta = dict(format=FORMAT_VERSION, model=model, pretrained=pretrained, dim=int(dim), dtype=dtype)
        self.shards = []

    def add_shard(self, name: str, keys: Sequence[str], image_features: np.ndarray, text_features: np.ndarray):
        if len(keys) != len(image_features) or len(keys) != len(text_features):
            raise ValueError(f"shard '{name}': {len(keys)} keys, {len(image_features)} image and "
                             f"{len(text_features)} text features")
        if len(set(keys)) != len(keys):
            raise ValueError(f"shard '{name}': sample keys are not unique")
        array = np.stack([image_features, text_features], axis=1).astype(DTYPES[self.meta['dtype']])
        _atomic_save(self.root / (name + '.features.npy'), array)
        _atomic_save(self.root / (name + '.keys.npy'), np.asarray([str(k) for k in keys]))
        self.shards.append(dict(name=name, count=len(keys)))

    def close(self):
        (self.root / MANIFEST).write_text(json.dumps({**self.meta, 'shards': self.shards}, indent=1))
        if self.final.exists():
            previous = self.final.with_name(self.final.name + '.previous')
            os.replace(self.final, previous)
            os.replace(self.root, self.final)
            shutil.rmtree(previous)
        else:
            os.replace(self.root, self.final)
