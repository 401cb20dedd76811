"""How a store names its shards and spells their sample keys on disk: consecutive zero-padded numbers as one record,
others as UTF-8."""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from drrho_openclip.data import image_mismatch
from drrho_openclip.features import (LOCK, FeatureStore, FeatureStoreError, FeatureStoreWriter, KeyRun,
                                     encode_keys, shard_name)

DIM = 8


def _store(root, keys_per_shard, dtype='float16'):
    writer = FeatureStoreWriter(root, None if dtype is None else 'm', None if dtype is None else '',
                                dim=None if dtype is None else DIM, dtype=dtype)
    rng = np.random.default_rng(0)
    for name, keys in keys_per_shard.items():
        if dtype is None:
            writer.add_shard(name, keys)
        else:
            features = rng.normal(size=(2, len(keys), DIM))
            features /= np.linalg.norm(features, axis=-1, keepdims=True)
            writer.add_shard(name, keys, features[0], features[1])
        assert writer.finished(name)  # what resume relies on, whichever way the keys were stored
    assert writer.close()
    return FeatureStore.open(root)


@pytest.mark.parametrize('dtype', ['float16', None])
def test_consecutive_numbered_keys_cost_no_bytes_per_sample(tmp_path, dtype):
    shards = {'00000': [f'{i:09d}' for i in range(0, 5000)], '00001': [f'{i:09d}' for i in range(10000, 12000)]}
    store = _store(tmp_path / 'store', shards, dtype)
    for name, keys in shards.items():
        assert (tmp_path / 'store' / f'{name}.keys.npy').stat().st_size < 200  # a header and one record
        assert store.keys(name).tolist() == keys
    assert store.index_of('00001', '000010007') == 5000 + 7
    assert store.index_of('00000', '000004999') == 4999
    # found by arithmetic, not by a table of every key a loader worker would hold: exactly the stored keys match
    assert all(isinstance(store._rows(name), KeyRun) for name in shards)
    for key in ('000005000', '00004999', '0000004999', '-00000001', '00000 001', '０００００００１２', '000009999'):
        with pytest.raises(FeatureStoreError, match=f"sample '{key}' of shard '00000' is not in"):
            store.index_of('00000', key)
    assert store.index_of('00000', '000000000') == 0 and store.index_of('00001', '000011999') == 6999


@pytest.mark.parametrize('keys', [
    ['000010', '000011', '000013'],          # a gap: not a run
    ['9', '10', '11'],                       # consecutive, but not one width
    ['a/x', 'b/ü-1', 'c.d'],                 # arbitrary strings, non-ASCII
    ['0x1', '0x2'],                          # not decimal
    [f'{2 ** 63 - 1 + i}' for i in range(3)],  # consecutive past what the run's int64 record holds
])
def test_other_keys_are_stored_as_they_are(tmp_path, keys):
    store = _store(tmp_path / 'store', {'s': keys})
    assert store.keys('s').tolist() == keys
    assert [store.index_of('s', k) for k in keys] == list(range(len(keys)))
    stored = np.load(tmp_path / 'store' / 's.keys.npy')
    assert stored.dtype.kind == 'S' and stored.shape == (len(keys),)  # UTF-8 bytes, one entry per sample


@pytest.mark.parametrize('keys', [[f'{i:05d}' for i in range(4)], ['a', 'b', 'c', 'd']])
def test_a_keys_file_of_another_length_than_the_manifest_says_is_named(tmp_path, keys):
    """A shard's keys file replaced by another's (a key run, or bytes): found at the first lookup, not read as rows
    of the features beside it."""
    store = _store(tmp_path / 'store', {'s': keys})
    np.save(tmp_path / 'store' / 's.keys.npy', encode_keys(keys[:3]))
    store = FeatureStore.open(tmp_path / 'store')
    with pytest.raises(FeatureStoreError, match=r"shard 's': '.*s\.keys\.npy' holds 3 keys, the manifest says 4"):
        store.index_of('s', keys[0])


@pytest.mark.parametrize('keys', [[f'img/{i}.jpg' for i in range(10)], [f'{i:04d}' for i in range(10)]])
def test_a_shards_keys_are_compared_in_slices_as_they_are_stored(tmp_path, keys, monkeypatch):
    """A CSV's store is checked against its image paths at every start, by every rank: in slices of the memory-mapped
    keys file, never decoded whole, the first other key is found across a slice's end, and in a key run too."""
    import drrho_openclip.features as features
    from drrho_openclip.openclip.flags import check_csv_keys
    store = _store(tmp_path / 'store', {'data': keys})
    monkeypatch.setattr(features, 'KEY_SLICE', 3)
    assert store.first_other_key('data', keys) is None
    for row in (0, 2, 3, 9):  # the first and last of a slice, the next slice's first, the last row
        assert store.first_other_key('data', keys[:row] + ['other'] + keys[row + 1:]) == row
    monkeypatch.setattr(store, 'keys', lambda name: pytest.fail('the keys were read whole'))
    assert check_csv_keys(store, 'data.csv', keys) is None
    with pytest.raises(FeatureStoreError, match=r"has 10 reference features for 'data.csv', which has 9 rows"):
        check_csv_keys(store, 'data.csv', keys[:-1])


def test_a_store_written_with_str_keys_still_reads(tmp_path):
    store = _store(tmp_path / 'store', {'s': ['k1', 'k2']})
    np.save(tmp_path / 'store' / 's.keys.npy', np.array(['k1', 'k2']))  # numpy's str dtype, as earlier versions wrote
    store = FeatureStore.open(tmp_path / 'store')
    assert store.keys('s').tolist() == ['k1', 'k2'] and store.index_of('s', 'k2') == 1
    assert store.first_other_key('s', ['k1', 'k2']) is None and store.first_other_key('s', ['k1', 'k3']) == 1


def test_a_store_replaces_the_leftover_of_a_killed_replacement(tmp_path):
    """close() moves the store it replaces aside and then deletes it; a kill during that deletion leaves
    `<root>.previous` behind, which the next store written there must not trip over."""
    root = tmp_path / 'ref'
    _store(root, {'a': ['x', 'y']})
    leftover = tmp_path / 'ref.previous'
    leftover.mkdir()
    (leftover / 'a.keys.npy').write_bytes(b'half deleted')
    store = _store(root, {'b': ['z']})
    assert [s.name for s in store.shards] == ['b'] and not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ref']  # no partial, no previous left
    assert LOCK not in [p.name for p in root.iterdir()]


def test_a_store_is_never_written_over_a_folder_or_file_of_something_else(tmp_path):
    """Writing to a path that holds other files would delete them when the store is swapped in: refused up front,
    and again when the store is finished, with nothing there touched. A free path, an empty folder or a store is
    fine."""
    data = tmp_path / 'shards'
    data.mkdir()
    (data / '00000.tar').write_bytes(b'the user data')
    (tmp_path / 'notes.txt').write_text('kept')
    for taken in (data, tmp_path / 'notes.txt'):
        with pytest.raises(FeatureStoreError, match=f"'{taken}' exists and is not a reference-feature store"):
            FeatureStoreWriter(taken, 'm', '', dtype='float16')
    assert (data / '00000.tar').read_bytes() == b'the user data' and (tmp_path / 'notes.txt').read_text() == 'kept'
    assert not (tmp_path / 'shards.partial').exists()
    (tmp_path / 'empty').mkdir()
    assert [s.name for s in _store(tmp_path / 'empty', {'a': ['x']}).shards] == ['a']
    # something put at the path while the shards were being written
    writer = FeatureStoreWriter(tmp_path / 'late', None, None, dtype=None)
    writer.add_shard('a', ['x'])
    (tmp_path / 'late').mkdir()
    (tmp_path / 'late' / 'model.pt').write_bytes(b'weights')
    with pytest.raises(FeatureStoreError, match='is not a reference-feature store'):
        writer.close()
    assert (tmp_path / 'late' / 'model.pt').read_bytes() == b'weights'
    assert LOCK not in [p.name for p in (tmp_path / 'late.partial').iterdir()]  # a later close may try again


def test_a_shard_is_added_once_and_a_manifest_listing_one_twice_is_refused(tmp_path):
    writer = FeatureStoreWriter(tmp_path / 'ref', None, None, dtype=None)
    writer.add_shard('00000', ['a', 'b'])
    with pytest.raises(ValueError, match="shard '00000' was added already"):
        writer.add_shard('00000', ['c', 'd'])  # the same tar's name twice: it would overwrite the first's files
    writer.add_shard('00001', ['c'])
    assert writer.close()
    manifest = tmp_path / 'ref' / 'manifest.json'
    content = json.loads(manifest.read_text())
    content['shards'].append(dict(content['shards'][0]))
    manifest.write_text(json.dumps(content))
    with pytest.raises(FeatureStoreError, match="lists shard '00000' more than once"):
        FeatureStore.open(tmp_path / 'ref')


@pytest.mark.parametrize('source, name', [
    ('shards/00042.tar', '00042'), ('train.000.tar', 'train.000'), ('s3/a.b.tar.gz', 'a.b'), ('data.v2.csv', 'data.v2'),
    ('pipe:aws s3 cp s3://bucket/train-01.tar -', 'train-01'), ('https://host/00001.tar?token=x', '00001'),
    ('pipe:aws s3 cp s3://bucket/train-02.tar /dev/stdout', 'train-02'), ('https://h/00002.tar?sig=a/b', '00002'),
    ('pipe:curl -s -L https://host/a.b.tar.gz', 'a.b'), ('file:///data/00003.tar', '00003'),
    ('https://host/get?f=00004.tar', '00004'), ('https://host/get?token=T&f=00005.tar&sig=ab/cd', '00005'),
    ('https://host/api/shard?id=17', 'shard?id=17'),
    ('train.tarball.tar', 'train.tarball'), ('shard-7', 'shard-7'), ('notes.txt', 'notes.txt')])
def test_a_shard_is_named_after_its_file_up_to_the_data_extension(source, name):
    assert shard_name(source) == name


def test_a_store_written_when_names_ended_at_the_first_dot_still_finds_its_shards(tmp_path):
    """Stores written before kept `data.v2.csv`'s features as shard 'data': looked up under today's name 'data.v2',
    they are found there; a store written today is not searched so (its 'train' is another file's than train.v2)."""
    keys = [str(tmp_path / 'a.png'), str(tmp_path / 'b.png')]
    for size, key in enumerate(keys, 1):
        Path(key).write_bytes(b'x' * size)
    writer = FeatureStoreWriter(tmp_path / 'ref', model='m', pretrained='', dim=4,
                                image_bytes={'data': {'0': 1, '1': 2}})
    writer.add_shard('data', keys, np.eye(4)[:2], np.eye(4)[2:])
    writer.close()
    store = FeatureStore.open(tmp_path / 'ref')
    with pytest.raises(FeatureStoreError, match="no reference features for shard 'data.v2'"):
        store.shard(shard_name('data.v2.csv'))
    manifest = tmp_path / 'ref' / 'manifest.json'
    content = json.loads(manifest.read_text())
    del content['shard_names']
    manifest.write_text(json.dumps(content))
    store = FeatureStore.open(tmp_path / 'ref')
    assert store.shard(shard_name('data.v2.csv')).name == 'data'
    assert store.index_of('data.v2', keys[1]) == 1 and list(store.keys('data.v2')) == keys
    csv = SimpleNamespace(train_data='data.v2.csv')
    assert image_mismatch(store.shard('data.v2'), csv, keys) is None
    assert 'row 0 (from 0, the header not counted) of' in image_mismatch(store.shard('data.v2'), csv, keys[::-1])
    assert np.array_equal(store.shard_features('data.v2')[1], np.stack([np.eye(4)[1], np.eye(4)[3]]))


@pytest.mark.parametrize('names, recorded', [(['train.000', 'train.001'], True), (['part-0', 'part-1'], False)])
def test_an_unfinished_store_of_an_earlier_version_is_finished_under_the_rule_its_names_show(tmp_path, names,
                                                                                             recorded):
    """`--finalize` of a plan that records no naming rule: names with a dot are today's (the first-dot rule never
    gave one), and the store says so; names without may be cut at a first dot, and the store leaves them to be
    resolved so (today's 'part-0.v2' finds 'part-0')."""
    writer = FeatureStoreWriter(tmp_path / 'ref', None, None, dtype=None, shards=names)
    for name in names:
        writer.add_shard(name, ['a', 'b'])
    plan = tmp_path / 'ref.partial' / 'partial.json'
    content = json.loads(plan.read_text())
    del content['shard_names']
    plan.write_text(json.dumps(content))
    assert FeatureStoreWriter.resume(tmp_path / 'ref').close()
    manifest = json.loads((tmp_path / 'ref' / 'manifest.json').read_text())
    assert ('shard_names' in manifest) == recorded
    store = FeatureStore.open(tmp_path / 'ref')
    if recorded:
        with pytest.raises(FeatureStoreError, match=f"no sample keys for shard '{names[0]}.v2'"):
            store.shard(names[0] + '.v2')
    else:
        assert store.shard(names[0] + '.v2').name == names[0]


def test_a_replaced_data_file_s_new_size_reaches_the_store_whichever_part_closes_it(tmp_path):
    """Part 1 stopped at a broken file 'a' (0 bytes), which was downloaded again (99) while part 2 went on: the part
    resumed with the new file takes its size into the plan, and the store records it even where part 2, started with
    the old size, finishes last. A run refused for other settings leaves the plan as it was."""
    old = FeatureStoreWriter(tmp_path / 'ref', None, None, dtype=None, shards=['a', 'b'],
                             source_bytes={'a': 0, 'b': 10})
    old.add_shard('b', ['x'])
    plan = tmp_path / 'ref.partial' / 'partial.json'
    written = plan.read_text()
    with pytest.raises(FeatureStoreError, match='written with model None, pretrained None, keys only'):
        FeatureStoreWriter(tmp_path / 'ref', 'm', '', dtype='float16', shards=['a', 'b'],
                           source_bytes={'a': 99, 'b': 10})
    assert plan.read_text() == written
    new = FeatureStoreWriter(tmp_path / 'ref', None, None, dtype=None, shards=['a', 'b'],
                             source_bytes={'a': 99, 'b': 10})
    new.add_shard('a', ['y'])
    assert old.close()
    assert {s.name: s.source_bytes for s in FeatureStore.open(tmp_path / 'ref').shards} == {'a': 99, 'b': 10}
