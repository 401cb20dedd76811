"""`drrho-openclip-features import`: a store from features computed elsewhere, every error naming what is at fault."""
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from drrho_openclip import precompute
from drrho_openclip.data import sha256_of, sources
from drrho_openclip.features import FeatureStore, FeatureStoreError
from drrho_openclip.store_import import import_store, input_shard

DIM = 8


def unit_rows(n, seed):
    rows = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture
def wds(shards):
    """The 4 WebDataset shards, each sample's key and made-up (image, text) features in data order."""
    store = FeatureStore.open(shards['ref'])
    keys = {s.name: store.keys(s.name).tolist() for s in store.shards}
    features = {name: (unit_rows(len(k), 2 * i), unit_rows(len(k), 2 * i + 1)) for i, (name, k) in
                enumerate(keys.items())}
    return dict(urls=shards['urls'], keys=keys, features=features, precomputed=store)


def write_inputs(folder, wds, fmt, shuffle=True, with_keys=True, bytes_keys=False):
    """One input per shard in format `fmt`, its rows in a shuffled order (with keys) or in data order; the keys as
    numpy's str or, with `bytes_keys`, its UTF-8 bytes."""
    from safetensors.numpy import save_file
    folder.mkdir()
    for s, (name, keys) in enumerate(wds['keys'].items()):
        order = np.random.default_rng(s).permutation(len(keys)) if shuffle else np.arange(len(keys))
        image, text = (f[order] for f in wds['features'][name])
        shuffled_keys = np.array(keys, dtype=str)[order]
        if bytes_keys:
            shuffled_keys = np.char.encode(shuffled_keys, 'utf-8')
        if fmt == 'npz':
            np.savez(folder / f'{name}.npz', image_features=image, text_features=text,
                     **({'keys': shuffled_keys} if with_keys else {}))
        elif fmt == 'npy':
            np.save(folder / f'{name}.image_features.npy', image)
            np.save(folder / f'{name}.text_features.npy', text)
            if with_keys:
                np.save(folder / f'{name}.keys.npy', shuffled_keys)
        elif fmt == 'safetensors':
            save_file({'image_features': image, 'text_features': text}, folder / f'{name}.safetensors',
                      metadata={'keys': json.dumps(shuffled_keys.tolist())} if with_keys else None)
        else:
            frame = pd.DataFrame({'image_features': list(image), 'text_features': list(text)})
            if with_keys:
                frame['keys'] = shuffled_keys
            frame.to_parquet(folder / f'{name}.parquet')
    return folder


def data_keys(wds):
    return {name: list(keys) for name, keys in wds['keys'].items()}


@pytest.mark.parametrize('fmt, with_keys', [('npz', True), ('npz', False), ('npy', True), ('safetensors', True),
                                            ('safetensors', False), ('parquet', True)])
def test_import_writes_the_rows_in_data_order_with_the_precomputed_index(wds, tmp_path, fmt, with_keys):
    inputs = write_inputs(tmp_path / 'feats', wds, fmt, shuffle=with_keys, with_keys=with_keys)
    store = import_store([inputs], data_keys(wds), tmp_path / 'ref', dtype='float32', progress=False)
    precomputed = wds['precomputed']
    assert [(s.name, s.count) for s in store.shards] == [(s.name, s.count) for s in precomputed.shards]
    for name, keys in wds['keys'].items():
        assert store.keys(name).tolist() == keys
        assert [store.index_of(name, k) for k in keys] == [precomputed.index_of(name, k) for k in keys]
        image, text = store.batch_features(torch.tensor([store.index_of(name, k) for k in keys]))
        assert np.array_equal(image.numpy(), wds['features'][name][0])
        assert np.array_equal(text.numpy(), wds['features'][name][1])
    assert not (tmp_path / 'ref.partial').exists()


@pytest.mark.parametrize('fmt', ['npz', 'npy'])
def test_keys_stored_as_bytes_are_read_as_text(wds, tmp_path, fmt):
    inputs = write_inputs(tmp_path / 'feats', wds, fmt, bytes_keys=True)
    store = import_store([inputs], data_keys(wds), tmp_path / 'ref', dtype='float32', progress=False)
    for name, keys in wds['keys'].items():
        assert store.keys(name).tolist() == keys


def test_the_command_writes_a_store_that_verify_accepts(wds, tmp_path, capsys):
    inputs = write_inputs(tmp_path / 'feats', wds, 'npz')
    assert precompute.main(['import', inputs, '--train-data', wds['urls'], '--output', tmp_path / 'ref',
                            '--model', 'timm resnet, random init']) == 0
    assert 'wrote reference features of 64 samples (4 shards, dim 8, float16)' in capsys.readouterr().out
    assert precompute.main(['verify', tmp_path / 'ref', '--train-data', wds['urls']]) == 0
    report = capsys.readouterr().out
    assert 'model timm resnet, random init' in report and report.strip().endswith('OK')
    # as precompute does, the store records the sizes of the shards it was written for (training compares them)
    urls = dict(sources(SimpleNamespace(train_data=wds['urls'], dataset_type='webdataset')))
    assert {s.name: s.source_bytes for s in FeatureStore.open(tmp_path / 'ref').shards} == {
        name: os.path.getsize(url) for name, url in urls.items()}


def test_a_csv_store_keys_the_image_paths_row_by_row(shapes, tmp_path):
    paths = pd.read_csv(shapes['csv'], sep='\t')['filepath'].tolist()
    (tmp_path / 'feats').mkdir()
    image, text = unit_rows(len(paths), 0), unit_rows(len(paths), 1)
    np.savez(tmp_path / 'feats' / 'train.npz', image_features=image[::-1], text_features=text[::-1],
             keys=np.array(paths[::-1]))
    assert precompute.main(['import', tmp_path / 'feats', '--train-data', shapes['csv'], '--output',
                            tmp_path / 'ref', '--dtype', 'int8']) == 0
    store = FeatureStore.open(tmp_path / 'ref')
    assert store.dtype == 'int8' and store.keys('train').tolist() == paths
    assert np.abs(store.shard_features('train')[:, 0] - image).max() < 1e-2
    assert precompute.main(['verify', tmp_path / 'ref', '--train-data', shapes['csv']]) == 0
    # the captions the features are of, recorded as precompute records them: another caption column fails verify
    assert store.shard('train').captions_sha256 == sha256_of(pd.read_csv(shapes['csv'], sep='\t')['title'])
    assert precompute.main(['verify', tmp_path / 'ref', '--train-data', shapes['csv'], '--csv-caption-key',
                            'label']) == 1


def test_a_csv_of_several_captions_per_image_imports_its_rows_in_order(shapes, tmp_path):
    """COCO-like: the CSV repeats an image's path once per caption, so its rows, not its keys, say which features
    are whose: rows without keys (or keyed in the CSV's order) import; keys in another order cannot be matched."""
    lines = shapes['csv'].read_text().splitlines()
    coco = tmp_path / 'coco.csv'
    coco.write_text('\n'.join([lines[0]] + [line for line in lines[1:9] for _ in range(2)]) + '\n')
    paths = pd.read_csv(coco, sep='\t')['filepath'].tolist()
    image, text = unit_rows(len(paths), 0), unit_rows(len(paths), 1)
    for name, extra in (('rows', {}), ('keyed', {'keys': np.array(paths)}),
                        ('shuffled', {'keys': np.array(paths[::-1])})):
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / 'coco.npz', image_features=image, text_features=text, **extra)
    for name in ('rows', 'keyed'):
        assert precompute.main(['import', tmp_path / name, '--train-data', coco, '--output', tmp_path / f'{name}_ref',
                                '--dtype', 'float32']) == 0
        store = FeatureStore.open(tmp_path / f'{name}_ref')
        assert store.keys('coco').tolist() == paths
        assert np.array_equal(store.shard_features('coco')[:, 1], text)
        assert precompute.main(['verify', tmp_path / f'{name}_ref', '--train-data', coco]) == 0
    with pytest.raises(SystemExit, match=r"the CSV repeats image paths \(an image with several captions\), so its "
                                         r"rows cannot be found by key, .*give the features without keys, one row "
                                         r"per CSV row in its order"):
        precompute.main(['import', tmp_path / 'shuffled', '--train-data', coco, '--output', tmp_path / 'no_ref'])
    assert not (tmp_path / 'no_ref').exists() and not (tmp_path / 'no_ref.partial').exists()


def corrupt(wds, fault):
    """The inputs of `wds` as {shard: (keys, image, text)} with one fault in shard 'part-2'."""
    inputs = {name: (list(keys), *(f.copy() for f in wds['features'][name])) for name, keys in wds['keys'].items()}
    keys, image, text = inputs['part-2']
    if fault == 'rows':
        inputs['part-2'] = (keys, image[:-1], text[:-1])
    elif fault == 'duplicate':
        keys[5] = keys[4]
    elif fault == 'foreign':
        keys[3] = 'not_a_sample'
    elif fault == 'missing':
        inputs['part-2'] = (keys[:-1], image[:-1], text[:-1])
    elif fault == 'nan':
        text[6, 2] = np.nan
    elif fault == 'norm':
        image[7] *= 3
    elif fault == 'dim':
        inputs['part-2'] = (keys, *(f[:, :4] / np.linalg.norm(f[:, :4], axis=1, keepdims=True) for f in (image, text)))
    return inputs


@pytest.mark.parametrize('fault, message', [
    ('rows', r"input '.*part-2.npz', shard 'part-2': 16 keys, 15 image and 15 text feature rows"),
    ('duplicate', r"input '.*part-2.npz', shard 'part-2': sample key 'sample_2_04_x' appears more than once "
                  r"\(rows 4, 5\)"),
    ('foreign', r"input '.*part-2.npz', shard 'part-2': 1 of its keys are not samples of the data, e.g. "
                r"'not_a_sample' \(the data's keys are like 'sample_2_00_x'\)"),
    ('missing', r"input '.*part-2.npz', shard 'part-2': 1 samples of the data have no features, e.g. "
                r"'sample_2_15_x'"),
    ('nan', r"input '.*part-2.npz', shard 'part-2', sample 'sample_2_06_x' \(row 6\): non-finite text features"),
    ('norm', r"input '.*part-2.npz', shard 'part-2', sample 'sample_2_07_x' \(row 7\): image features of norm 3, "
             r"not unit-norm \(L2-normalise every row, or import with --normalize\)"),
    ('dim', r"input '.*part-2.npz', shard 'part-2': features of dimension 4, the other shards' are of dimension 8"),
])
def test_a_faulty_input_names_the_shard_and_key_and_leaves_the_store_as_it_was(wds, tmp_path, fault, message):
    good = write_inputs(tmp_path / 'good', wds, 'npz')
    import_store([good], data_keys(wds), tmp_path / 'ref', progress=False)
    before = {f.name: f.read_bytes() for f in (tmp_path / 'ref').iterdir()}
    (tmp_path / 'bad').mkdir()
    for name, (keys, image, text) in corrupt(wds, fault).items():
        np.savez(tmp_path / 'bad' / f'{name}.npz', keys=np.array(keys), image_features=image, text_features=text)
    with pytest.raises(FeatureStoreError, match=message):
        import_store([tmp_path / 'bad'], data_keys(wds), tmp_path / 'ref', overwrite=True, progress=False)
    assert {f.name: f.read_bytes() for f in (tmp_path / 'ref').iterdir()} == before
    assert not (tmp_path / 'ref.partial').exists()


def test_an_import_stopped_while_it_replaces_a_store_leaves_the_old_one_in_place(wds, tmp_path, monkeypatch):
    """Ctrl-C between the move of the old store aside and of the new one into place left neither at the output."""
    import os
    good = write_inputs(tmp_path / 'good', wds, 'npz')
    import_store([good], data_keys(wds), tmp_path / 'ref', progress=False)
    before = {f.name: f.read_bytes() for f in (tmp_path / 'ref').iterdir()}
    real = os.replace

    def interrupted(source, target):
        if str(source).endswith('.partial'):  # the new store into place, after the old one was moved aside
            raise KeyboardInterrupt
        return real(source, target)
    monkeypatch.setattr(os, 'replace', interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_store([good], data_keys(wds), tmp_path / 'ref', overwrite=True, progress=False)
    monkeypatch.setattr(os, 'replace', real)
    assert {f.name: f.read_bytes() for f in (tmp_path / 'ref').iterdir()} == before
    assert not (tmp_path / 'ref.partial').exists() and not (tmp_path / 'ref.previous').exists()


def test_normalize_scales_the_rows_to_unit_norm(wds, tmp_path):
    inputs = write_inputs(tmp_path / 'feats', wds, 'npz', shuffle=False, with_keys=False)
    scaled = tmp_path / 'scaled'
    scaled.mkdir()
    for file in inputs.iterdir():
        arrays = dict(np.load(file))
        np.savez(scaled / file.name, image_features=arrays['image_features'] * 7,
                 text_features=arrays['text_features'] * 0.5)
    with pytest.raises(FeatureStoreError, match=r"shard 'part-0', sample 'sample_0_00_x' \(row 0\): image features "
                                                r"of norm 7, not unit-norm"):
        import_store([scaled], data_keys(wds), tmp_path / 'ref', progress=False)
    store = import_store([scaled], data_keys(wds), tmp_path / 'ref', dtype='float32', normalize=True,
                         progress=False)
    assert np.allclose(store.shard_features('part-1')[:, 1], wds['features']['part-1'][1], atol=1e-6)


def test_inputs_must_match_the_shards_of_the_data(wds, tmp_path):
    inputs = write_inputs(tmp_path / 'feats', wds, 'npz')
    (inputs / 'part-3.npz').rename(inputs / 'part-7.npz')
    with pytest.raises(FeatureStoreError, match=r"shard 'part-3' of the data has no input \(1 such shards; "
                                                r"expected e.g. 'part-3.npz'\)"):
        import_store([inputs], data_keys(wds), tmp_path / 'ref', progress=False)
    (inputs / 'part-3.npz').write_bytes((inputs / 'part-7.npz').read_bytes())
    with pytest.raises(FeatureStoreError, match=r"input '.*part-7.npz': 'part-7' is not a shard of the data"):
        import_store([inputs], data_keys(wds), tmp_path / 'ref', progress=False)
    (inputs / 'part-7.npz').rename(inputs / 'part-3.parquet')
    with pytest.raises(FeatureStoreError, match=r"shard 'part-3' has features in several inputs"):
        import_store([inputs], data_keys(wds), tmp_path / 'ref', progress=False)
    assert not (tmp_path / 'ref').exists() and not (tmp_path / 'ref.partial').exists()


def test_an_existing_store_is_kept_without_overwrite(wds, tmp_path):
    inputs = write_inputs(tmp_path / 'feats', wds, 'npz')
    import_store([inputs], data_keys(wds), tmp_path / 'ref', progress=False)
    with pytest.raises(SystemExit, match=r"import: '.*ref' already holds a reference-feature store; pass "
                                         r"--overwrite"):
        precompute.main(['import', inputs, '--train-data', wds['urls'], '--output', tmp_path / 'ref'])


@pytest.mark.parametrize('fault', ['truncated', 'object keys npy', 'object keys npz'])
def test_an_input_that_cannot_be_read_is_named(wds, tmp_path, fault):
    inputs = write_inputs(tmp_path / 'feats', wds, 'npy' if 'npy' in fault else 'npz')
    if fault == 'truncated':
        file = inputs / 'part-1.npz'
        file.write_bytes(file.read_bytes()[:300])
        message = r"input '.*part-1.npz' cannot be read: .*\(is it complete\?"
    else:  # keys as a pandas column's values: Python objects, which numpy saves with pickle
        keys = np.array(wds['keys']['part-1'], dtype=object)
        if 'npy' in fault:
            np.save(inputs / 'part-1.keys.npy', keys, allow_pickle=True)
        else:
            np.savez(inputs / 'part-1.npz', keys=keys, image_features=wds['features']['part-1'][0],
                     text_features=wds['features']['part-1'][1])
        message = r"input '.*part-1.*' cannot be read: .*\(save keys as strings: np.array\(keys, dtype=str\)\)"
    with pytest.raises(FeatureStoreError, match=message):
        import_store([inputs], data_keys(wds), tmp_path / 'ref', progress=False)
    assert not (tmp_path / 'ref').exists() and not (tmp_path / 'ref.partial').exists()


def test_a_missing_reader_names_the_package_to_install(wds, tmp_path, monkeypatch):
    inputs = tmp_path / 'feats'
    inputs.mkdir()
    (inputs / 'part-0.parquet').write_bytes(b'PAR1')
    monkeypatch.setitem(__import__('sys').modules, 'pyarrow', None)  # as if pyarrow were not installed
    monkeypatch.setitem(__import__('sys').modules, 'fastparquet', None)
    from drrho_openclip.store_import import read_features
    with pytest.raises(FeatureStoreError, match=r"input '.*part-0.parquet': reading .parquet files needs pyarrow "
                                                r"\(pip install pyarrow\)"):
        read_features([inputs / 'part-0.parquet'])


@pytest.mark.parametrize('file, shard', [
    ('00042.npz', '00042'), ('00042.tar.npz', '00042'), ('train.000.npz', 'train.000'),
    ('train.000.image_features.npy', 'train.000'), ('train.000.tar.keys.npy', 'train.000'),
    ('data.v2.safetensors', 'data.v2'), ('data.v2.csv.parquet', 'data.v2')])
def test_an_input_is_the_features_of_the_shard_its_name_says(file, shard):
    assert input_shard(Path(file)) == shard
