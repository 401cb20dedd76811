"""`drrho-openclip-features import`: a verified reference-feature store from features computed with any model.

    drrho-openclip-features import feats/ --train-data 'shards/{00000..00099}.tar' --output ref/ \
        [--dtype float16|float32|int8] [--normalize] [--model 'SigLIP ViT-B/16, webli'] [--overwrite]

For a reference model that is not an OpenCLIP model (a Hugging Face SigLIP or EVA-CLIP, a timm backbone with a text
tower, features computed earlier): compute its image and text embeddings of the training samples yourself, one input
per data shard (per CSV file), named after the shard (its file name without its data extension: `00042.tar` ->
`00042`, `train.000.tar` -> `train.000`; `00042.tar.npz` names shard `00042` too):

    <shard>.npz            arrays image_features [n, d], text_features [n, d] and, optionally, keys [n] (strings)
    <shard>.safetensors    tensors image_features, text_features; optionally the keys as a JSON list in the
                           metadata: save_file(tensors, path, metadata={'keys': json.dumps(keys)})
    <shard>.parquet        columns image_features, text_features (a list of d floats per row), optionally keys
                           (needs pyarrow: pip install 'drrho-openclip[parquet]')
    <shard>.image_features.npy, <shard>.text_features.npy and, optionally, <shard>.keys.npy

Keys are the samples' WebDataset `__key__`s, or for a CSV its image paths (--csv-img-key column); without keys, the
rows are taken to be the shard's image-text samples in file order (a CSV's rows; for a CSV that repeats an image's
path, one row per caption as COCO's, rows without keys are the only unambiguous form). A sample whose image cannot be
decoded may lack features: precompute and OpenCLIP's training leave it out too. The store holds each shard's rows in
the data's order, so it gives every sample the same dense index as a precomputed store (except after a sample whose
image cannot be decoded and that the input has a row for: the store keeps that row, which training never reads, where
precompute leaves the sample out).

Nothing is written unless every check passes, each error naming the input file, shard and sample key: an input for
every shard of --train-data and none for other shards; image and text features of one [n, d] shape, d the same in
every shard; as many rows as keys (or, without keys, as the shard's samples); unique keys, each a sample of the data,
and every decodable sample of the data present; finite, unit-norm rows (`--normalize` L2-normalises them first). The
store is written into `<output>.partial/` and moved to `<output>` only when complete; `verify` accepts it.
"""
import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .features import (DTYPES, MANIFEST, FeatureStore, FeatureStoreError, FeatureStoreWriter, check_rows,
                       first_duplicate, partial_dir, shard_name)
from .data import (UnreadableShard, add_data_args, caption_digests, data_keys, image_sizes, local_file_sizes,
                   missing_local_file, read_csv, resolve_dataset_type, sources, undecodable_keys)

ARRAYS = ('image_features', 'text_features', 'keys')  # the names of an input's arrays (keys optional)
NPY_SUFFIXES = tuple(f'.{name}.npy' for name in ARRAYS)
FORMATS = ('.npz', '.safetensors', '.parquet', '.npy')
READER_PACKAGES = {'.safetensors': 'safetensors', '.parquet': 'pyarrow'}


def input_shard(file: Path) -> str:
    """The data shard an input file holds the features of: its name without the input format's suffix, read as a
    data file's name (`train.000.npz`, `train.000.tar.npz` and `train.000.image_features.npy`: `train.000`)."""
    suffix = next((s for s in NPY_SUFFIXES if file.name.endswith(s)), file.suffix)
    return shard_name(file.name[:-len(suffix)])


def input_files(paths) -> dict:
    """{shard name: [files]} of the input files and directories (a directory: every file in it of a known format)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(f for f in path.iterdir() if f.suffix in FORMATS)
        elif path.is_file():
            files.append(path)
        else:
            raise FeatureStoreError(f"input '{path}' does not exist")
    shards = {}
    for file in files:
        if file.suffix not in FORMATS or (file.suffix == '.npy' and not file.name.endswith(NPY_SUFFIXES)):
            raise FeatureStoreError(f"input '{file}': not a feature file (<shard>.npz, .safetensors, .parquet or "
                                    f"<shard>.{{image_features,text_features,keys}}.npy)")
        shards.setdefault(input_shard(file), []).append(file)
    for name, group in shards.items():
        kinds = {f.suffix for f in group}
        if len(kinds) > 1 or (kinds != {'.npy'} and len(group) > 1):
            raise FeatureStoreError(f"shard '{name}' has features in several inputs: "
                                    f"{', '.join(str(f) for f in group)}")
    return shards


def _missing_reader(file: Path, error: ImportError):
    package = READER_PACKAGES[file.suffix]
    return FeatureStoreError(f"input '{file}': reading {file.suffix} files needs {package} "
                             f"(pip install {package}): {error}")


def _require(file: Path, arrays: dict, names=ARRAYS[:2]):
    missing = [name for name in names if name not in arrays]
    if missing:
        raise FeatureStoreError(f"input '{file}': no {' or '.join(missing)} (it holds: "
                                f"{', '.join(sorted(arrays)) or 'nothing'})")


def read_features(files) -> tuple:
    """(keys or None, image features, text features) of one shard's input file(s), as read from disk; a file that
    cannot be read (truncated, corrupt, keys saved as Python objects) is an error naming it."""
    files = [Path(f) for f in files]
    file = files[0]
    if file.suffix == '.npy':
        file = file.with_name(input_shard(file) + '.{image_features,text_features}.npy')
    try:
        arrays = _read_arrays(files)
    except FeatureStoreError:
        raise
    except Exception as e:  # noqa: BLE001 - each reader (numpy, zipfile, safetensors, pyarrow) raises its own
        hint = (' (save keys as strings: np.array(keys, dtype=str))' if 'allow_pickle' in str(e) else
                ' (is it complete? a truncated or corrupt file reads so)')
        raise FeatureStoreError(f"input '{file}' cannot be read: {type(e).__name__}: {e}{hint}") from None
    _require(file, arrays)
    keys = arrays.get('keys')
    return (None if keys is None else [_key(k) for k in keys]), arrays['image_features'], arrays['text_features']


def _read_arrays(files) -> dict:
    file = files[0]
    if file.suffix == '.npy':
        return {next(a for a in ARRAYS if f.name.endswith(f'.{a}.npy')): np.load(f, allow_pickle=False) for f in files}
    if file.suffix == '.npz':
        with np.load(file, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    if file.suffix == '.safetensors':
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise _missing_reader(file, e) from e
        with safe_open(file, framework='pt') as tensors:  # torch: reads bfloat16 too
            arrays = {name: tensors.get_tensor(name).float().numpy() for name in tensors.keys()}
            metadata = tensors.metadata() or {}
        if 'keys' in metadata:
            arrays['keys'] = np.array(json.loads(metadata['keys']), dtype=str)
        return arrays
    import pandas as pd
    try:
        frame = pd.read_parquet(file)
    except ImportError as e:
        raise _missing_reader(file, e) from e
    arrays = {name: frame[name].to_numpy() for name in frame.columns}
    for name in ARRAYS[:2]:
        if name in arrays:  # one list of d floats per row
            arrays[name] = np.stack(arrays[name]) if len(arrays[name]) else np.zeros((0, 0))
    return arrays


def _key(key) -> str:
    """A key as the data spells it: bytes (numpy's 'S' arrays, h5py strings) are UTF-8, not "b'...'"."""
    return key.decode('utf-8') if isinstance(key, (bytes, np.bytes_)) else str(key)


def in_data_order(name: str, file, keys, image, text, data_keys, undecodable=None, rows_are_index=False):
    """(image rows, text rows, their keys) in the order of the shard's samples `data_keys`; every mismatch between
    the input's keys (None: the rows are in data order) and the data is an error naming the file, shard and key.
    `undecodable(name, keys)`, the subset of a WebDataset shard's samples whose image cannot be decoded: precompute
    and training leave them out, so an input may lack them. With `rows_are_index` (a CSV, whose image paths repeat for
    an image with several captions) keys may repeat, and keyed rows must then come in the CSV's order."""
    image, text = np.asarray(image, dtype=np.float32), np.asarray(text, dtype=np.float32)
    where = f"input '{file}', shard '{name}'"
    for what, array in (('image', image), ('text', text)):
        if array.ndim != 2:
            raise FeatureStoreError(f"{where}: {what} features of shape {array.shape}, expected [samples, dim]")
    repeated = rows_are_index and first_duplicate(data_keys) is not None
    if keys is None or (repeated and list(keys) == list(data_keys)):
        if len(image) == len(text) == len(data_keys):
            return image, text, list(data_keys)
        left_out = undecodable(name, data_keys) if undecodable and len(image) < len(data_keys) else set()
        decodable = [k for k in data_keys if k not in left_out]
        if left_out and len(image) == len(text) == len(decodable):
            _warn_left_out(where, left_out)
            return image, text, decodable
        raise FeatureStoreError(f"{where}: {len(image)} image and {len(text)} text feature rows, the data has "
                                f"{len(data_keys)} samples" + (f" ({len(left_out)} of them cannot be decoded)"
                                                               if left_out else "")
                                + " (without keys, row i is the data's sample i)")
    if repeated:
        raise FeatureStoreError(f"{where}: the CSV repeats image paths (an image with several captions), so its rows "
                                f"cannot be found by key, e.g. '{first_duplicate(data_keys)}': give the features "
                                f"without keys, one row per CSV row in its order")
    if len(image) != len(keys) or len(text) != len(keys):
        raise FeatureStoreError(f"{where}: {len(keys)} keys, {len(image)} image and {len(text)} text feature rows")
    row_of = {}
    for row, key in enumerate(keys):
        if key in row_of:
            raise FeatureStoreError(f"{where}: sample key '{key}' appears more than once (rows {row_of[key]}, {row})")
        row_of[key] = row
    wanted = set(data_keys)
    foreign = [k for k in keys if k not in wanted]
    if foreign:
        raise FeatureStoreError(f"{where}: {len(foreign)} of its keys are not samples of the data, e.g. "
                                f"'{foreign[0]}' (the data's keys are like '{data_keys[0]}')")
    absent = [k for k in data_keys if k not in row_of]
    left_out = undecodable(name, absent) if absent and undecodable else set()
    absent = [k for k in absent if k not in left_out]
    if absent:
        raise FeatureStoreError(f"{where}: {len(absent)} samples of the data have no features, e.g. '{absent[0]}'")
    if left_out:
        _warn_left_out(where, left_out)
    kept = [k for k in data_keys if k in row_of]
    order = np.array([row_of[k] for k in kept], dtype=np.int64)
    return image[order], text[order], kept


def _warn_left_out(where: str, left_out: set):
    logging.warning(f"{where}: {len(left_out)} samples whose image cannot be decoded have no features, e.g. "
                    f"'{sorted(left_out)[0]}'; left out of the store, as precompute and OpenCLIP's training leave "
                    f"them out")


def normalized(name: str, keys, features: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    if (norms == 0).any():
        row = int(np.argmax(norms[:, 0] == 0))
        raise FeatureStoreError(f"shard '{name}', sample '{keys[row]}' (row {row}): a zero vector cannot be "
                                f"normalised")
    return features / norms


def import_store(inputs, data_keys: dict, output, *, dtype='float16', model='imported', normalize=False,
                 overwrite=False, progress=True, source_bytes: dict = None, captions_sha256: dict = None,
                 image_bytes: dict = None, undecodable=None, rows_are_index=False) -> FeatureStore:
    """Write the store `output` from the feature files and directories `inputs`, one per shard of the data, whose
    samples `data_keys` lists ({shard name: keys in data order}); see the module's docstring for the files and the
    checks; `source_bytes` the sizes of the shards' local files (`data.local_file_sizes`), `captions_sha256` a
    CSV's captions (`data.caption_digests`) and `image_bytes` some of its images' sizes (`data.image_sizes`),
    recorded for training to check; `undecodable(shard,
    keys)` those of a shard's samples that cannot be decoded (left out, as precompute leaves them); `rows_are_index`
    for a CSV (its image paths may repeat). Returns the store; raises a FeatureStoreError, with nothing written, if
    any check fails."""
    output = Path(output)
    if (output / MANIFEST).exists() and not overwrite:
        raise FeatureStoreError(f"'{output}' already holds a reference-feature store; pass --overwrite to replace it")
    partial = partial_dir(output)
    if partial.exists():
        raise FeatureStoreError(f"'{partial}' exists: a store is being written there (delete it if no process is)")
    inputs = input_files(inputs)
    missing = [name for name in data_keys if name not in inputs]
    if missing:
        raise FeatureStoreError(f"shard '{missing[0]}' of the data has no input ({len(missing)} such shards; "
                                f"expected e.g. '{missing[0]}.npz')")
    foreign = [name for name in inputs if name not in data_keys]
    if foreign:
        raise FeatureStoreError(f"input '{inputs[foreign[0]][0]}': '{foreign[0]}' is not a shard of the data "
                                f"(its shards are e.g. '{next(iter(data_keys))}')")
    writer = FeatureStoreWriter(output, model, '', dtype=dtype, shards=list(data_keys), source_bytes=source_bytes,
                                captions_sha256=captions_sha256, image_bytes=image_bytes)
    dim = None
    try:
        for name, keys in tqdm(data_keys.items(), unit='shard', desc='import', disable=not progress):
            files = inputs[name]
            file_keys, image, text = read_features(files)
            image, text, keys = in_data_order(name, files[0], file_keys, image, text, keys, undecodable=undecodable,
                                              rows_are_index=rows_are_index)
            if normalize:
                image, text = normalized(name, keys, image), normalized(name, keys, text)
            if dim is not None and image.shape[1] != dim:
                raise FeatureStoreError(f"input '{files[0]}', shard '{name}': features of dimension "
                                        f"{image.shape[1]}, the other shards' are of dimension {dim}")
            try:
                check_rows(name, keys, image, text,
                           normalize_hint='L2-normalise every row, or import with --normalize')
            except FeatureStoreError as e:
                raise FeatureStoreError(f"input '{files[0]}', {e}") from None
            dim = image.shape[1]
            writer.add_shard(name, keys, image, text, rows_are_index=rows_are_index)
        writer.close()
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # ours: nothing half-written is left to resume
        raise
    return FeatureStore.open(output)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='drrho-openclip-features import', allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('inputs', nargs='+', help='feature files, or directories of them: one input per data shard')
    add_data_args(p, required=True)
    p.add_argument('--output', required=True, help='directory of the feature store to write')
    p.add_argument('--dtype', choices=list(DTYPES), default='float16',
                   help='storage dtype (default: %(default)s; int8: a quarter of float32, plus a scale per vector)')
    p.add_argument('--normalize', action='store_true', help='L2-normalise every row before the checks')
    p.add_argument('--model', default='imported', help='what computed the features, shown by verify '
                                                       '(default: %(default)s)')
    p.add_argument('--overwrite', action='store_true', help='replace an existing store in --output')
    return resolve_dataset_type(p.parse_args(argv))


def main(argv=None) -> int:
    args = parse_args(argv)
    csv = args.dataset_type == 'csv'
    urls = dict(sources(args))
    missing = missing_local_file(urls.items())
    if missing:
        raise SystemExit(f"import: --train-data: no such file '{missing}'")
    try:
        frame = read_csv(args) if csv else None  # read once for its keys, captions and image sizes
        store = import_store(args.inputs, data_keys(args, frame), args.output, dtype=args.dtype, model=args.model,
                             normalize=args.normalize, overwrite=args.overwrite,
                             source_bytes=None if csv else local_file_sizes(urls.items()),
                             captions_sha256=caption_digests(args, frame), image_bytes=image_sizes(args, frame),
                             rows_are_index=csv,
                             undecodable=None if csv else lambda shard, keys: undecodable_keys(urls[shard], keys))
    except (FeatureStoreError, UnreadableShard) as e:
        raise SystemExit(f"import: {e}")
    print(f"wrote reference features of {store.num_samples} samples ({len(store.shards)} shards, dim {store.dim}, "
          f"{store.dtype}) to {store.root}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
