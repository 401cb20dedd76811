"""Reference-feature store: precomputed, L2-normalised reference-model embeddings, one file per data shard.

Layout of a store directory:

    manifest.json              model, pretrained, dim, dtype and the ordered list of shards with their sample counts
                               and, where written from local tar files, their sizes in bytes (`source_bytes`: training
                               warns when its shards differ), or from a CSV, the sha256 of its captions
                               (`captions_sha256`: training stops when they differ) and some of its images' sizes
                               (`image_bytes`), each shard's keys digest (`keys_sha256`), and the rule its shards
                               are named by (`shard_names`; none in stores of earlier versions, which cut a name at
                               its first dot) (a keys-only store: dtype null, dim 0, model and pretrained null)
    <shard>.features.npy       [n, 2, dim] array: [:, 0] image features, [:, 1] text features, in the store's dtype:
                               float16 (default), float32, or int8 (then scaled by the next file)
    <shard>.scales.npy         int8 stores only: [n, 2] float32, one scale per feature vector (feature = int8 * scale)
    <shard>.keys.npy           the n sample keys of the shard: WebDataset `__key__`s, or a CSV's image paths, as
                               UTF-8 bytes; keys that are consecutive zero-padded numbers (img2dataset's '000120',
                               '000121', …) as one (first, count, width) record instead: no bytes per sample

A sample's dense index (the slot of its per-sample state) is its shard's offset plus its row in the shard, so it
never depends on how keys are spelt. Readers always get float32.

A keys-only store (precompute's `--keys-only`) holds the keys files alone: the dense index of WebDataset input for
the losses that keep per-sample state but read no reference features (training's `--sample-index`).

A store is written into `<root>.partial/`, where `partial.json` records the settings and the planned shards, so that
several processes can write disjoint shards (precompute's `--num-parts`) and a killed run can resume. Every file is
written under a temporary name (`*.tmp`) and renamed when complete, a shard's keys file last: a shard whose files
are all there, with matching row counts, is finished. The manifest is written once every shard is, and only then is
the directory moved to `root`: an interrupted precompute leaves no store that looks finished.

Writing a store from Python (what `drrho-openclip-features import` does with arrays from any model):

    import os
    from drrho_openclip.features import FeatureStoreWriter, check_rows, shard_name

    tars = ['shards/00000.tar', 'shards/00001.tar']
    writer = FeatureStoreWriter('ref/', model='my SigLIP', pretrained='', dtype='float16',
                                source_bytes={shard_name(t): os.path.getsize(t) for t in tars})  # optional
    for tar in tars:
        keys, image, text = ...            # the shard's __key__s, [n, d] and [n, d] L2-normalised features
        check_rows(shard_name(tar), keys, image, text)
        writer.add_shard(shard_name(tar), keys, image, text)
    writer.close()                         # the store appears in ref/ only now, complete

A shard is named after its data file (`shard_name`: the file name without its data extension, `train.000.tar` ->
`train.000`; a CSV file is one shard whose
keys are its image paths, row by row, as training checks them). Training reads every feature as given: `check_rows`
raises a `FeatureStoreError` naming the shard and the sample key of a row that is not finite and unit-norm.
"""
import hashlib
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from stat import S_ISREG
from typing import Dict, List, Optional, Sequence, Tuple
from urllib.parse import parse_qsl, urlparse

import numpy as np
import torch

MANIFEST = 'manifest.json'
PLAN = 'partial.json'
LOCK = 'finalize.lock'
FORMAT_VERSION = 1
DTYPES = {'float16': np.float16, 'float32': np.float32, 'int8': np.int8}
UNIT_NORM_TOLERANCE = 0.02  # float16 and int8 rounding move a norm by < 1e-2
KEY_SLICE = 1 << 16  # keys compared at a time by `first_other_key`
NPY_HEADER_BYTES = 64  # the least header of a .npy file (numpy pads it to a multiple of 64 bytes)
# A data file's extension (.tar, .tar.gz, .csv, ...), where the shard name ends: the first one in the file name, so
# that what follows it (a compression suffix, a `pipe:` command's further arguments, a URL's query) is cut too
DATA_EXTENSION = re.compile(r'\.(tar|tgz|tbz2?|txz|csv|tsv)(?![A-Za-z0-9])', re.IGNORECASE)
# The manifest entry of stores whose shards are named so; stores written before it named a shard up to the first dot
# of its file name, which reading them still resolves (`FeatureStore.stored_name`)
SHARD_NAMES = 'file name without its data extension'


def _npy_shape(path: Path) -> Optional[tuple]:
    """The shape a .npy file's header declares, or None where it has no readable header."""
    try:
        with open(path, 'rb') as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            return tuple(read_header(f)[0])
    except (OSError, ValueError):
        return None


class FeatureStoreError(ValueError):
    """A reference-feature store that cannot be used as it is; the message names the file, shard or key."""


@dataclass(frozen=True)
class Shard:
    name: str
    count: int
    offset: int
    source_bytes: Optional[int] = None  # the size of the data file it was written from, where that was a local file
    captions_sha256: Optional[str] = None  # a CSV's: the fingerprint of the captions its text features are of
    image_bytes: Optional[Dict[str, int]] = None  # a CSV's: {row: size} of some of the images it was written from
    keys_sha256: Optional[str] = None  # its keys in order (which sample each row is); None in stores written before


def shard_name(source: str) -> str:
    """The store name of a data shard or CSV file: its file name up to its data extension (the whole name where it
    has none), so that `train.000.tar` and `train.001.tar` are two shards. A URL's file name is its path's, or that
    of a query value with a data extension (`https://h/get?f=00042.tar&sig=...`: `00042`); a `pipe:` command's, that
    of its last argument with a data extension (`pipe:aws s3 cp s3://b/00042.tar /dev/stdout`: `00042`)."""
    source = str(source)
    if source.startswith('pipe:'):
        source = next((arg for arg in reversed(source[len('pipe:'):].split())
                       if DATA_EXTENSION.search(os.path.basename(arg))), source)
    elif '://' in source:  # its path's, or a query value's that names the file (not a token's or signature's)
        url = urlparse(source)
        source = next((value for value in [url.path, *(v for _, v in parse_qsl(url.query))]
                       if DATA_EXTENSION.search(os.path.basename(value))), source)
    base = os.path.basename(source.rstrip('/'))
    extension = DATA_EXTENSION.search(base)
    return base[:extension.start()] if extension is not None and extension.start() > 0 else base


def first_dot_name(name: str) -> str:
    """The name a store written before `SHARD_NAMES` gave the shard that `shard_name` now names `name`."""
    return name.split('.')[0] if not name.startswith('.') else name


def shard_files(name: str, dtype: Optional[str]) -> List[str]:
    """The files of a shard, in the order they are written (the keys file last); dtype None: a keys-only store."""
    features = [] if dtype is None else [name + '.features.npy'] + ([name + '.scales.npy'] if dtype == 'int8' else [])
    return features + [name + '.keys.npy']


# The keys file of a shard whose keys are f'{first + i:0{width}d}' for i < count
KEY_RUN = np.dtype([('first', '<i8'), ('count', '<i8'), ('width', '<i8')])


def encode_keys(keys: Sequence[str]) -> np.ndarray:
    """The array a shard's keys file holds: a KEY_RUN record for consecutive zero-padded numbers, else UTF-8 bytes."""
    keys = [str(k) for k in keys]
    width = len(keys[0]) if keys else 0
    if keys and all(len(k) == width and k.isascii() and k.isdecimal() for k in keys):
        first = int(keys[0])
        if first + len(keys) <= np.iinfo(np.int64).max and all(int(k) == first + i for i, k in enumerate(keys)):
            return np.array((first, len(keys), width), dtype=KEY_RUN)
    return np.array([k.encode() for k in keys], dtype=bytes)


class KeyRun:
    """The keys f'{first + i:0{width}d}' for i < count of a KEY_RUN record, whose rows are found by arithmetic: a dict
    of its keys would hold each as a Python string."""

    def __init__(self, record: np.ndarray):
        self.first, self.count, self.width = (int(record[field]) for field in KEY_RUN.names)

    def __len__(self):
        return self.count

    def keys(self) -> np.ndarray:
        return np.array([f'{self.first + i:0{self.width}d}' for i in range(self.count)], dtype=str)

    def get(self, key: str) -> Optional[int]:
        if len(key) != self.width or not (key.isascii() and key.isdecimal()):
            return None
        row = int(key) - self.first
        return row if 0 <= row < self.count else None


def decode_keys(stored: np.ndarray) -> np.ndarray:
    """The keys, as a [n] array of str, of what `encode_keys` wrote."""
    if stored.dtype == KEY_RUN:
        return KeyRun(stored).keys()
    if stored.dtype.kind == 'S':
        return np.char.decode(stored, 'utf-8')
    return stored  # str: stores written before keys were encoded


def encode(features: np.ndarray, dtype: str):
    """[n, 2, dim] features → (array to store, [n, 2] float32 scales for int8 or None)."""
    if dtype != 'int8':
        return features.astype(DTYPES[dtype]), None
    # symmetric per vector: its largest |component| maps to ±127, whatever the vector's spread. A vector with a
    # NaN or inf keeps it in its scale (its int8 values are 0), so that reading it back finds it non-finite
    peak = np.abs(features).max(axis=-1)
    finite = np.isfinite(peak)
    scales = (np.where(peak == 0, 1, np.where(finite, peak, np.nan)) / 127).astype(np.float32)
    quantised = np.rint(features / np.where(finite, scales, 1)[..., None]).clip(-127, 127)
    return np.where(finite[..., None], quantised, 0).astype(np.int8), scales


def decode(stored: np.ndarray, scales: Optional[np.ndarray] = None) -> np.ndarray:
    array = np.array(stored, dtype=np.float32)  # a copy: never a view of a read-only memory map
    return array if scales is None else array * np.asarray(scales, dtype=np.float32)[..., None]


def first_duplicate(keys: Sequence[str]) -> Optional[str]:
    """The first key that occurs a second time, or None."""
    seen = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    return None


def check_rows(shard: str, keys: Sequence[str], image_features: np.ndarray, text_features: np.ndarray,
               normalize_hint: str = 'L2-normalise every row'):
    """Check one shard's rows before they are written, as training will read them: one key per row (that keys are
    unique is `FeatureStoreWriter.add_shard`'s check), image and text features of the same [n, dim] shape,
    every value finite and every row unit-norm (within UNIT_NORM_TOLERANCE; `normalize_hint` says how to make them
    so). Raises a FeatureStoreError naming the shard and the first sample key at fault."""
    keys = [str(k) for k in keys]
    image_features, text_features = np.asarray(image_features), np.asarray(text_features)
    for what, array in (('image', image_features), ('text', text_features)):
        if array.ndim != 2 or array.shape[0] != len(keys):
            raise FeatureStoreError(f"shard '{shard}': {what} features of shape {tuple(array.shape)} for "
                                    f"{len(keys)} keys (expected [{len(keys)}, dim])")
    if image_features.shape != text_features.shape:
        raise FeatureStoreError(f"shard '{shard}': image features of dimension {image_features.shape[1]}, text "
                                f"features of dimension {text_features.shape[1]}")
    for what, array in (('image', image_features), ('text', text_features)):
        values = array.astype(np.float64)
        finite = np.isfinite(values).all(axis=1)
        if not finite.all():
            row = int(np.argmin(finite))
            raise FeatureStoreError(f"shard '{shard}', sample '{keys[row]}' (row {row}): non-finite {what} features")
        norms = np.linalg.norm(values, axis=1)
        off = np.abs(norms - 1) > UNIT_NORM_TOLERANCE
        if off.any():
            row = int(np.argmax(off))
            raise FeatureStoreError(f"shard '{shard}', sample '{keys[row]}' (row {row}): {what} features of norm "
                                    f"{norms[row]:.4g}, not unit-norm ({normalize_hint})")


def _tmp_path(path: Path) -> Path:
    # a name of its own per process: two processes writing the same file (a part run twice) never share one
    return path.with_name(f'{path.name}.{socket.gethostname()}-{os.getpid()}.tmp')


def lock_holder(path: Path) -> Optional[Tuple[str, int]]:
    """(host, process id) of the process that took the finishing lock `path` (an unfinished store's LOCK), or None:
    no lock, or one that records neither (taken by an earlier version, or a moment ago)."""
    try:
        host, pid = path.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _holder_has_ended(holder: Tuple[str, int]) -> bool:
    """Whether the lock's holder is known to have ended: a process of this host that no longer runs (another host's
    cannot be checked from here)."""
    host, pid = holder
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)  # no signal: only whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that id: it runs
        return False
    return False


def _atomic_save(path: Path, array: np.ndarray):
    tmp = _tmp_path(path)
    with open(tmp, 'wb') as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def write_json(path: Path, value: dict):
    """`value` as JSON at `path`, whole or not at all: a write cut short never replaces the file there."""
    tmp = _tmp_path(Path(path))
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _describe(setting: str, value) -> str:
    """A setting of a store's plan, as a message names it."""
    if setting == 'shards':
        return 'another list of shards'
    if setting == 'source_bytes':
        return 'data files of other sizes'
    if setting == 'captions_sha256':
        return 'other captions'
    if setting == 'image_bytes':
        return 'other image files'
    if setting == 'dtype' and value is None:
        return 'keys only'
    return f"{setting} {value!r}"


class FeatureStore:
    """Read access to a store directory; arrays are memory-mapped and opened lazily (also in loader workers)."""

    def __init__(self, root, manifest: dict):
        self.root = Path(root)
        self.model = manifest.get('model')
        self.pretrained = manifest.get('pretrained')
        self.dim = int(manifest['dim'])
        self.dtype = manifest['dtype']
        self.keys_only = self.dtype is None
        self.shards: List[Shard] = []
        offset = 0
        for entry in manifest['shards']:
            self.shards.append(Shard(entry['name'], int(entry['count']), offset, entry.get('source_bytes'),
                                     entry.get('captions_sha256'), entry.get('image_bytes'),
                                     entry.get('keys_sha256')))
            offset += int(entry['count'])
        self.num_samples = offset
        self._first_dot_names = manifest.get('shard_names') != SHARD_NAMES
        self._by_name: Dict[str, Shard] = {s.name: s for s in self.shards}
        repeated = first_duplicate([s.name for s in self.shards])
        if repeated is not None:
            raise FeatureStoreError(f"'{self.root / MANIFEST}' lists shard '{repeated}' more than once")
        self._offsets = np.array([s.offset for s in self.shards], dtype=np.int64)

    @classmethod
    def open(cls, root, check_sizes: bool = True) -> 'FeatureStore':
        """The store at `root`, its manifest and files checked (with `check_sizes`, that no feature file is cut
        short; `verify` reports such a file per shard instead)."""
        root = Path(root)
        path = root / MANIFEST
        if root.is_file():
            raise FeatureStoreError(f"'{root}' is a file; a reference-feature store is a folder: pass the folder "
                                    f"that holds {MANIFEST}")
        if not root.is_dir():
            partial = partial_dir(root)
            raise FeatureStoreError(f"reference-feature directory '{root}' does not exist" + (
                f" ('{partial}' holds an unfinished one: run precompute again with the same settings, or --finalize "
                f"once every part has ended)" if partial.is_dir() else ''))
        if not path.is_file():
            raise FeatureStoreError(f"'{root}' is not a finished reference-feature store: '{path}' is missing "
                                    f"(write one with `drrho-openclip-features`)")
        try:
            manifest = json.loads(path.read_text())
            if manifest.get('format') != FORMAT_VERSION:
                raise FeatureStoreError(f"'{path}': unsupported format {manifest.get('format')!r}")
            if manifest['dtype'] is not None and manifest['dtype'] not in DTYPES:
                raise FeatureStoreError(f"'{path}': unsupported dtype {manifest['dtype']!r}")
            if (manifest['dtype'] is None) != (manifest['dim'] == 0):
                raise FeatureStoreError(f"'{path}': dtype {manifest['dtype']!r} with dim {manifest['dim']!r} (a "
                                        f"keys-only store has dtype null and dim 0, a feature store both set)")
            store = cls(root, manifest)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise FeatureStoreError(f"'{path}' is corrupt: {e!r}") from e
        # bytes per sample of the arrays whose size the manifest fixes (a keys file's depends on its keys)
        itemsize = 0 if store.keys_only else np.dtype(DTYPES[store.dtype]).itemsize
        row_bytes = {'.features.npy': 2 * store.dim * itemsize, '.scales.npy': 2 * 4}
        for shard in store.shards:
            for file in shard_files(shard.name, store.dtype):
                try:  # one stat per file: a store of 10^4 shards on a network file system opens at every start
                    stat = (root / file).stat()
                except FileNotFoundError:
                    stat = None
                if stat is None or not S_ISREG(stat.st_mode):
                    raise FeatureStoreError(f"shard '{shard.name}' of '{root}': file '{file}' is missing")
                # a copy cut short is found here, not at the first batch that reads the shard
                least = NPY_HEADER_BYTES + shard.count * row_bytes.get(file[len(shard.name):], 0)
                if check_sizes and stat.st_size < least:
                    stored = _npy_shape(root / file)
                    if stored is not None and stored[0] == shard.count and file.endswith('.features.npy') \
                            and stored != (shard.count, 2, store.dim):  # whole, of other features
                        raise FeatureStoreError(f"shard '{shard.name}' of '{root}': file '{file}' has shape {stored}, "
                                                f"the manifest says {(shard.count, 2, store.dim)}: features of "
                                                f"another reference?")
                    raise FeatureStoreError(f"shard '{shard.name}' of '{root}': file '{file}' is cut short "
                                            f"({stat.st_size} bytes, its {shard.count} samples need at least {least}): "
                                            f"an unfinished copy? `drrho-openclip-features verify` checks the store")
        return store

    def stored_name(self, name: str) -> str:
        """The name under which this store holds the shard a data file's `shard_name` names: itself, or in a store
        written before that rule, the name up to its first dot (`train.v2` of `train.v2.csv` was stored as `train`)."""
        if name not in self._by_name and self._first_dot_names and first_dot_name(name) in self._by_name:
            return first_dot_name(name)
        return name

    def shard(self, name: str) -> Shard:
        try:
            return self._by_name[self.stored_name(name)]
        except KeyError:
            holds = 'sample keys' if self.keys_only else 'reference features'
            raise FeatureStoreError(f"no {holds} for shard '{name}' in '{self.root}' "
                                    f"(it has {len(self.shards)} shards, e.g. '{self.shards[0].name}')") from None

    def _load(self, name: str, suffix: str, shape: tuple, dtype=None, mmap_mode='r', decode_with=None) -> np.ndarray:
        path = self.root / (name + suffix)
        try:
            array = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
            if decode_with is not None:
                array = decode_with(array)
        except Exception as e:  # numpy raises several types for truncated or foreign files
            raise FeatureStoreError(f"shard '{name}': '{path}' is corrupt ({e})") from e
        if shape is not None and array.shape != shape:
            raise FeatureStoreError(f"shard '{name}': '{path}' has shape {tuple(array.shape)}, the manifest says "
                                    f"{shape}")
        if dtype is not None and array.dtype != dtype:
            raise FeatureStoreError(f"shard '{name}': '{path}' holds {array.dtype}, not {np.dtype(dtype)}"
                                    f" (the manifest says {self.dtype})")
        return array

    def _require_features(self):
        if self.keys_only:
            raise FeatureStoreError(f"'{self.root}' is a keys-only store (a sample index, written with --keys-only): "
                                    f"it holds no reference features")

    @lru_cache(maxsize=64)
    def _features(self, name: str) -> np.ndarray:
        count = self.shard(name).count
        return self._load(name, '.features.npy', (count, 2, self.dim), DTYPES[self.dtype])

    @lru_cache(maxsize=64)
    def _scales(self, name: str) -> Optional[np.ndarray]:
        if self.dtype != 'int8':
            return None
        return self._load(name, '.scales.npy', (self.shard(name).count, 2), np.float32)

    def keys(self, name: str) -> np.ndarray:
        """A shard's keys in row order, read anew at each call (its callers read a shard's keys once; held, a CSV's
        millions of paths would stay in every rank)."""
        shard = self.shard(name)
        return self._load(shard.name, '.keys.npy', (shard.count,), mmap_mode=None, decode_with=decode_keys)

    def first_other_key(self, name: str, keys: Sequence[str]) -> Optional[int]:
        """The first row whose stored key is not the one `keys` (as many as the shard's samples) has there, or None.
        Read in slices of the memory-mapped keys file: every rank checks a CSV's paths at start-up, and its millions
        of paths, decoded whole, took gigabytes in each."""
        stored = self._load(self.shard(name).name, '.keys.npy', None)
        if stored.dtype == KEY_RUN:  # one record, not sliced
            stored = decode_keys(stored)
        for start in range(0, len(keys), KEY_SLICE):
            part = decode_keys(stored[start:start + KEY_SLICE]).tolist()
            for row, (key, other) in enumerate(zip(part, keys[start:start + KEY_SLICE]), start):
                if key != other:
                    return row
        return None

    # a loader worker reads a shard's samples together (WebDataset's shuffle buffer spans a few shards at most), so a
    # few shards' lookups are enough: 64 of 100k-sample shards held 2 GB per worker
    @lru_cache(maxsize=8)
    def _rows(self, name: str):
        """The row of each key of a shard, by `.get(key)`: arithmetic for consecutive numbered keys (a key run, as
        img2dataset writes them), else a dict of its keys."""
        stored = self._load(name, '.keys.npy', None, mmap_mode=None)
        if stored.dtype == KEY_RUN:
            rows = KeyRun(stored)
        else:
            rows = {key: i for i, key in enumerate(decode_keys(stored).tolist())}
        if len(rows) != self.shard(name).count:
            raise FeatureStoreError(f"shard '{name}': '{self.root / (name + '.keys.npy')}' holds {len(rows)} keys, "
                                    f"the manifest says {self.shard(name).count}")
        return rows

    def index_of(self, name: str, key: str) -> int:
        """Dense index of the sample `key` of shard `name`."""
        shard = self.shard(name)
        row = self._rows(shard.name).get(str(key))
        if row is None:
            raise FeatureStoreError(f"sample '{key}' of shard '{name}' is not in '{self.root}' (a shard changed since "
                                    f"the store was written, e.g. downloaded again? `drrho-openclip-features verify` "
                                    f"compares them; write the store for this data)")
        return shard.offset + row

    def shard_features(self, name: str) -> np.ndarray:
        """All [n, 2, dim] features of a shard, as float32."""
        self._require_features()
        name = self.shard(name).name
        return decode(self._features(name), self._scales(name))

    def batch_features(self, index: torch.Tensor):
        """(image, text) reference features of a batch of dense indices ([n] integers): two [n, dim] float32 tensors.
        Each shard the batch touches is read once (one fancy index of its memory map), then all are decoded at once."""
        self._require_features()
        index = np.asarray(index, dtype=np.int64)
        outside = (index < 0) | (index >= self.num_samples)
        if outside.any():
            raise FeatureStoreError(f"index {index[outside][0]} is outside '{self.root}' ({self.num_samples} samples)")
        shard_of = np.searchsorted(self._offsets, index, side='right') - 1
        rows = index - self._offsets[shard_of]
        # [2, n, dim]: the image features and the text features each come out as one contiguous tensor
        stored = np.empty((2, len(index), self.dim), DTYPES[self.dtype])
        scales = np.empty((2, len(index)), np.float32) if self.dtype == 'int8' else None
        for s in np.unique(shard_of):
            name, at = self.shards[s].name, np.flatnonzero(shard_of == s)
            stored[:, at] = self._features(name)[rows[at]].transpose(1, 0, 2)
            if scales is not None:
                scales[:, at] = self._scales(name)[rows[at]].T
        features = decode(stored, scales)
        finite = np.isfinite(features).all(axis=(0, 2))
        if not finite.all():
            bad = int(np.argmin(finite))
            raise FeatureStoreError(f"shard '{self.shards[shard_of[bad]].name}', row {rows[bad]}: non-finite features")
        features = torch.from_numpy(features)
        return features[0], features[1]


def _check_replaceable(final: Path):
    """A store is written to a path that is free, an empty folder, or a store (which it replaces): never over a
    folder or file of anything else, which the swap into place would delete."""
    if final.is_symlink():
        raise FeatureStoreError(f"'{final}' is a symbolic link: write the store to the folder it points to")
    if not final.exists() or final.is_dir() and ((final / MANIFEST).is_file() or not any(final.iterdir())):
        return
    raise FeatureStoreError(f"'{final}' exists and is not a reference-feature store (it has no {MANIFEST}): a store "
                            f"written there would replace what it holds; choose another output")


# what a store was written from, where its writer knew it
SOURCE_KEYS = ('source_bytes', 'captions_sha256', 'image_bytes')


def _differences(found: dict, wanted: dict) -> List[str]:
    """The settings of a writer's plan `wanted` that `found` (another writer's plan, or a finished store's) has
    otherwise, described; what the data was only where both know it (a writer may not: the Python API)."""
    compared = [k for k in wanted if k not in SOURCE_KEYS or (found.get(k) and wanted[k])]
    return [_describe(k, found.get(k)) for k in compared if found.get(k) != wanted[k]]


def finished_store_differences(root, model: Optional[str], pretrained: Optional[str], dtype: Optional[str],
                               shards: Sequence[str], source_bytes: Dict[str, int] = None,
                               captions_sha256: Dict[str, str] = None,
                               image_bytes: Dict[str, Dict[str, int]] = None) -> List[str]:
    """How the finished store in `root` differs from the one a writer with these settings would write (the
    `FeatureStoreWriter` arguments): [] when it is that store, so that a rerun has nothing left to do."""
    path = _named(root) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        stored = manifest['shards']
        found = {key: manifest.get(key) for key in ('format', 'model', 'pretrained', 'dtype')}
        found['shards'] = [shard['name'] for shard in stored]
        found.update({key: {shard['name']: shard[key] for shard in stored if key in shard} for key in SOURCE_KEYS})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FeatureStoreError(f"'{path}' is not a store's manifest ({type(e).__name__}: {e})") from None
    named = (lambda name: name) if manifest.get('shard_names') == SHARD_NAMES else first_dot_name  # as it was written
    wanted = dict(format=FORMAT_VERSION, model=model, pretrained=pretrained, dtype=dtype,
                  shards=[named(name) for name in shards],
                  **{key: {named(name): value for name, value in (of_shard or {}).items()}
                     for key, of_shard in zip(SOURCE_KEYS, (source_bytes, captions_sha256, image_bytes))})
    return _differences(found, wanted)


def _named(root) -> Path:
    return Path(root) if Path(root).name else Path(root).resolve()  # '.' has no name to append to


def partial_dir(root) -> Path:
    """Where the unfinished store of `root` is written (`ref/` and `ref` alike: `ref.partial`)."""
    final = _named(root)
    return final.with_name(final.name + '.partial')


class FeatureStoreWriter:
    """Writes a store shard by shard into `<root>.partial/`; `close()` writes the manifest and only then moves the
    finished store to `root` (replacing a previous one), so `root` always holds a complete store or none.

    `model` and `pretrained` describe the reference model (free text, shown by `verify`); `dim`, when given, is
    checked against every shard's features; `dtype` is the storage dtype (float16, float32 or int8, see the module's
    docstring). `add_shard` writes a shard's files atomically; run the rows through `check_rows` first when they
    do not come straight from a model's normalised output.

    `source_bytes` ({shard: size of its local data file}), `captions_sha256` ({shard: `data.sha256_of` the
    captions of a CSV}) and `image_bytes` ({shard: `data.image_sizes` of a CSV}) describe what the store was written
    from, for training to check (all optional).

    `shards`, the names of all shards of the store in order, lets several writers (processes) share the work:
    each adds some, and any of them can `close()` once all are `finished` (without it, the store is the shards this
    writer added). Writers of one `.partial` directory must agree on the settings and the shards.

    dtype None writes a keys-only store: `add_shard` then takes keys alone, and model and pretrained are None."""

    def __init__(self, root, model: Optional[str], pretrained: Optional[str], dim: int = None,
                 dtype: Optional[str] = 'float16', shards: Sequence[str] = None,
                 source_bytes: Dict[str, int] = None, captions_sha256: Dict[str, str] = None,
                 image_bytes: Dict[str, Dict[str, int]] = None):
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or None: keys only), got {dtype!r}")
        if dtype is None and (model is not None or pretrained is not None or dim is not None):
            raise ValueError("a keys-only store (dtype None) has no model, pretrained weights or dimension")
        self.final = _named(root)
        _check_replaceable(self.final)
        self.root = partial_dir(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only or full file system: named, not a traceback
            raise FeatureStoreError(f"cannot write the store's folder '{self.root}' ({e.strerror})") from None
        self.dim = dim
        self.meta = dict(format=FORMAT_VERSION, model=model, pretrained=pretrained, dtype=dtype)
        self.plan = None if shards is None else list(shards)
        self.sources = {'source_bytes': dict(source_bytes or {}), 'captions_sha256': dict(captions_sha256 or {}),
                        'image_bytes': dict(image_bytes or {})}
        self.shards: List[str] = []  # the ones this writer added
        plan = {**self.meta, 'shards': self.plan, **self.sources}
        path = self.root / PLAN
        self.shard_names = SHARD_NAMES  # the rule of this writer's names (resume() reads an earlier version's)
        if path.is_file():
            found = json.loads(path.read_text())
            # a plan of an earlier version names shards up to their first dot: resumed where its names are today's
            if found.get('shard_names') != SHARD_NAMES and found.get('shards') != plan['shards']:
                raise FeatureStoreError(f"'{self.root}' holds an unfinished store started by an earlier version, "
                                        f"which named shards up to the first dot of their file names: finish it with "
                                        f"that version, or delete it to start afresh")
            resized = self._with_new_sizes_of_unfinished_shards(found)
            differ = _differences(resized, plan)
            if differ:
                raise FeatureStoreError(f"'{self.root}' holds an unfinished store written with {', '.join(differ)}: "
                                        f"resume it with the same settings, or delete it to start afresh")
            if resized != found:
                write_json(path, resized)
        else:
            write_json(path, {**plan, 'shard_names': SHARD_NAMES})

    def _with_new_sizes_of_unfinished_shards(self, found: dict) -> dict:
        """The plan `found`, where a data file was replaced before its shard was written (one that stopped
        precompute, downloaded again), with its new size: the run goes on with the shards already written."""
        planned, given = found.get('source_bytes') or {}, self.sources['source_bytes']
        replaced = {name: size for name, size in given.items()
                    if name in planned and planned[name] != size and not self.finished(name)}
        if not replaced or found.get('shards') != self.plan:
            return found
        return {**found, 'source_bytes': {**planned, **replaced}}

    @classmethod
    def resume(cls, root) -> 'FeatureStoreWriter':
        """A writer for the unfinished store of `root`, with the settings and shards it was started with."""
        path = partial_dir(root) / PLAN
        if not path.is_file():
            raise FeatureStoreError(f"'{path}' is missing: there is no unfinished store for '{root}'")
        plan = json.loads(path.read_text())
        writer = cls(root, plan['model'], plan['pretrained'], dtype=plan['dtype'], shards=plan['shards'],
                     source_bytes=plan.get('source_bytes'), captions_sha256=plan.get('captions_sha256'),
                     image_bytes=plan.get('image_bytes'))
        if plan.get('shard_names') != SHARD_NAMES and not any('.' in name for name in plan['shards']
                                                               if not name.startswith('.')):
            # an earlier version's plan, whose names may have been cut at a first dot: stored as such (a name with
            # a dot is today's, which that rule never gave but to a name starting with one, which it kept whole)
            writer.shard_names = None
        return writer

    def add_shard(self, name: str, keys: Sequence[str], image_features: np.ndarray = None,
                  text_features: np.ndarray = None, rows_are_index: bool = False):
        """Write a shard: its keys and, unless the store is keys-only, their image and text features. Keys are
        unique, as training looks a tar shard's samples up by key, except with `rows_are_index`: a CSV's rows are its
        index, and an image with several captions (COCO, Flickr30k) repeats its path."""
        dtype = self.meta['dtype']
        if self.plan is not None and name not in self.plan:
            raise ValueError(f"shard '{name}' is not one of the {len(self.plan)} shards of '{self.final}'")
        if name in self.shards:
            raise ValueError(f"shard '{name}' was added already: a store holds each shard once (shard_name: its data "
                             f"file's name)")
        if (image_features is None or text_features is None) != (dtype is None):
            raise ValueError(f"shard '{name}': " + ("a keys-only store takes keys alone" if dtype is None else
                                                    "a feature store needs image and text features"))
        duplicate = None if rows_are_index else first_duplicate(keys)
        if duplicate is not None:
            raise FeatureStoreError(f"shard '{name}': sample key '{duplicate}' appears more than once")
        arrays = [encode_keys(keys)]
        if dtype is not None:
            if len(keys) != len(image_features) or len(keys) != len(text_features):
                raise ValueError(f"shard '{name}': {len(keys)} keys, {len(image_features)} image and "
                                 f"{len(text_features)} text features")
            if self.dim is not None and image_features.shape[1] != self.dim:
                raise ValueError(f"shard '{name}': features of dimension {image_features.shape[1]}, not {self.dim}")
            stored, scales = encode(np.stack([image_features, text_features], axis=1), dtype)
            arrays = [stored] + ([scales] if scales is not None else []) + arrays
        for file, array in zip(shard_files(name, dtype), arrays):
            _atomic_save(self.root / file, array)
        self.shards.append(name)

    def _finished(self, name: str):
        """(count, dim) of a shard whose files are all on disk and agree (dim 0: keys only), else None."""
        dtype = self.meta['dtype']
        try:
            arrays = [np.load(self.root / f, mmap_mode='r', allow_pickle=False) for f in shard_files(name, dtype)]
        except (OSError, ValueError):  # missing, or not a whole .npy file
            return None
        keys = arrays[-1]
        if keys.dtype == KEY_RUN and keys.shape == ():
            n = int(keys['count'])
        elif keys.ndim == 1:
            n = len(keys)
        else:
            return None
        if dtype is None:
            return n, 0
        features = arrays[0]
        if (features.dtype != DTYPES[dtype] or features.ndim != 3 or features.shape[:2] != (n, 2)
                or (len(arrays) == 3 and arrays[1].shape != (n, 2))):
            return None
        return n, features.shape[2]

    def _keys_digest(self, name: str) -> str:
        """A fingerprint of a written shard's keys in order: which sample each of its rows is."""
        keys = np.load(self.root / shard_files(name, self.meta['dtype'])[-1], allow_pickle=False)
        return hashlib.sha256(np.ascontiguousarray(keys).tobytes()).hexdigest()

    def finished(self, name: str) -> bool:
        return self._finished(name) is not None

    def missing(self) -> List[str]:
        """The planned shards that are not finished yet."""
        return [name for name in (self.plan or []) if not self.finished(name)]

    def take_over_ended_lock(self) -> Optional[int]:
        """Remove the finishing lock where its holder is a process of this host that has ended, and return that
        process's id (None: no such lock). The lock is first moved aside, which one process alone can do, and put back
        if what was moved is not the ended holder's: another process may have taken it over meanwhile and hold a
        fresh one."""
        lock = self.root / LOCK
        holder = lock_holder(lock)
        if holder is None or not _holder_has_ended(holder):
            return None
        aside = lock.with_name(f'{LOCK}.{socket.gethostname()}-{os.getpid()}.ended')
        try:
            os.rename(lock, aside)
        except FileNotFoundError:  # taken over, or the store finished, by another process: close() says which
            return None
        if lock_holder(aside) == holder:
            aside.unlink()
            return holder[1]
        try:  # another's fresh lock: back in place, unless a third process has taken the lock since
            os.link(aside, lock)
        except FileExistsError:
            pass
        aside.unlink()
        return None

    def close(self) -> bool:
        """Write the manifest and move the store in place. False (and nothing done) when another process holds the
        finishing lock or has already moved the store: parts that end together must not both swap directories."""
        names = self.plan if self.plan is not None else self.shards
        if not names:
            raise FeatureStoreError(f"'{self.root}': a store needs at least one shard")
        # the lock comes before the shard check: a part that saw every shard finished may reach here after another
        # part has moved the store away, and must then step aside rather than report the shards as missing
        try:
            lock = os.open(self.root / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except (FileExistsError, FileNotFoundError):
            return False
        with os.fdopen(lock, 'w') as holder:  # who holds it, for the one that finds it left by a killed process
            holder.write(f'{socket.gethostname()} {os.getpid()}\n')
        try:
            found = {name: self._finished(name) for name in names}
            missing = [name for name, info in found.items() if info is None]
            if missing:
                raise FeatureStoreError(f"'{self.root}': {len(missing)} of {len(names)} shards are not finished, "
                                        f"e.g. '{missing[0]}'")
            dims = sorted({dim for _, dim in found.values()})
            if len(dims) > 1:
                raise FeatureStoreError(f"'{self.root}': shards of different dimensions {dims}")
            _check_replaceable(self.final)  # again: something may have been put there while the shards were written
        except FeatureStoreError:
            (self.root / LOCK).unlink()  # nothing moved: the next attempt must be able to take the lock
            raise
        for tmp in self.root.glob('*.tmp'):  # left by killed writers
            tmp.unlink()
        # the data the plan records now: another part may have taken a replaced file's size since this one started
        plan = json.loads((self.root / PLAN).read_text())
        sources = {key: plan.get(key) or {} for key in SOURCE_KEYS}
        shards = [dict(name=name, count=found[name][0], keys_sha256=self._keys_digest(name),
                       **{key: of_shard[name] for key, of_shard in sources.items() if name in of_shard})
                  for name in names]
        naming = {'shard_names': self.shard_names} if self.shard_names else {}  # none: an earlier version's plan
        manifest = {**self.meta, 'dim': dims[0], **naming, 'shards': shards}
        (self.root / MANIFEST).write_text(json.dumps(manifest, indent=1))
        previous = self.final.with_name(self.final.name + '.previous')
        if previous.exists():  # the store a killed close() was replacing: this one replaces it as well
            shutil.rmtree(previous)
        replacing = self.final.exists()
        if replacing:
            os.replace(self.final, previous)
        try:
            os.replace(self.root, self.final)
        except BaseException:  # stopped (Ctrl-C) between the two moves: the old store back in place
            if replacing:
                os.replace(previous, self.final)
            raise
        (self.final / PLAN).unlink()  # only now: a close() killed before the move is finished by --finalize
        (self.final / LOCK).unlink()
        if replacing:
            shutil.rmtree(previous)
        return True
