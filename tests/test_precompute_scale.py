"""Precompute at scale: parts, resume, storage dtypes, finishing the store, and `verify`."""
import filecmp
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ENV
from drrho_openclip import features, precompute
from drrho_openclip.data import local_file_sizes, missing_local_file
from drrho_openclip.features import LOCK, FeatureStore, FeatureStoreError, FeatureStoreWriter

SIZES = (7, 9, 5, 11, 8)  # samples per tar shard: uneven, so parts differ in size


def write_shards(root, csv, sizes=SIZES):
    """Tar shards `shard-{i}.tar` of the CSV's image-caption pairs; returns their brace pattern."""
    rows = [line.split('\t') for line in csv.read_text().splitlines()[1:]]
    start = 0
    for s, size in enumerate(sizes):
        with tarfile.open(root / f'shard-{s}.tar', 'w') as tar:
            for path, title, _ in rows[start:start + size]:
                key = f'{s}/sample-{start:03d}'  # keys with a directory, as img2dataset may write
                tar.add(path, arcname=f'{key}.png')
                caption = root / f'caption-{start}.txt'
                caption.write_text(title)
                tar.add(caption, arcname=f'{key}.txt')
                start += 1
    return str(root / f'shard-{{0..{len(sizes) - 1}}}.tar')


def write_checkpoint(model_name, path):
    """Fixed weights for the tiny model, so that separate processes compute the same features."""
    import torch
    torch.manual_seed(0)
    torch.save(precompute.create_model(model_name)[0].state_dict(), path)
    return str(path)


@pytest.fixture(scope='module')
def data(shapes, tmp_path_factory):
    root = tmp_path_factory.mktemp('scale')
    urls = write_shards(root, shapes['csv'])
    args = ['--model', shapes['model'], '--pretrained', write_checkpoint(shapes['model'], root / 'tiny.pt'),
            '--train-data', urls, '--batch-size', '4', '--device', 'cpu']
    # the reference: one process, with loader workers (the parts below use none: a shard's features must not
    # depend on either)
    assert precompute.main(args + ['--output', root / 'one', '--workers', '2']) == 0
    return dict(root=root, urls=urls, args=args + ['--workers', '0'], one=root / 'one')


def same_store(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def test_parts_write_the_store_of_one_process(data, tmp_path):
    out = tmp_path / 'ref'
    for done, part in enumerate((2, 0, 1), 1):  # any order: the part that ends last finishes the store
        assert precompute.main(data['args'] + ['--output', out, '--num-parts', 3, '--part', part]) == 0
        assert out.exists() == (done == 3) and (tmp_path / 'ref.partial').exists() == (done < 3)
    assert same_store(data['one'], out)
    assert FeatureStore.open(out).num_samples == sum(SIZES)


def test_the_reference_weights_are_loaded_or_the_run_stops(data, tmp_path, caplog, capsys):
    """OpenCLIP's own log says "initialized randomly" before the checkpoint is loaded: the run says where the
    weights came from, and a checkpoint path that is not a file stops it (OpenCLIP would ignore it for a local-dir:
    model, leaving random weights)."""
    checkpoint = data['args'][data['args'].index('--pretrained') + 1]
    with caplog.at_level('INFO'):
        assert precompute.main(data['args'] + ['--output', tmp_path / 'ref']) == 0
    assert f"weights from '{checkpoint}'" in caplog.text
    missing = str(checkpoint).replace('tiny.pt', 'tiny_typo.pt')
    argv = [str(a) for a in data['args']]
    argv[argv.index('--pretrained') + 1] = missing
    with pytest.raises(SystemExit) as stop:
        precompute.main(argv + ['--output', str(tmp_path / 'other')])
    assert stop.value.code == 2 and f"--pretrained: '{missing}' is not a file" in capsys.readouterr().err
    assert not (tmp_path / 'other.partial').exists()
    # a file that is no checkpoint of the model: named, with the first line of the cause (torch's own messages name
    # neither, and its unpickling error advises loading the file with weights_only=False)
    truncated = tmp_path / 'truncated.pt'
    truncated.write_bytes(Path(checkpoint).read_bytes()[:1000])
    config = Path(data['args'][data['args'].index('--model') + 1].removeprefix('local-dir:')) / 'open_clip_config.json'
    for wrong in (truncated, config):
        argv[argv.index('--pretrained') + 1] = str(wrong)
        with pytest.raises(SystemExit) as stop:
            precompute.main(argv + ['--output', str(tmp_path / 'other')])
        message = str(stop.value)
        assert f"--pretrained {wrong}" in message and f"'{wrong}' is not a checkpoint of it (" in message, message
        assert 'weights_only' not in message and '\n' not in message
        assert not (tmp_path / 'other.partial').exists() and not (tmp_path / 'other').exists()
    # a checkpoint that lacks some of the model's weights is none of it either
    state = torch.load(checkpoint)
    state.pop(next(iter(state)))
    torch.save(state, truncated)
    argv[argv.index('--pretrained') + 1] = str(truncated)
    with pytest.raises(SystemExit) as stop:
        precompute.main(argv + ['--output', str(tmp_path / 'other')])
    assert f"'{truncated}' is not a checkpoint of it (it lacks 1 of the model's weights and has 0 others" in str(
        stop.value)


def test_a_checkpoint_trained_with_tempnet_is_a_reference(data, tmp_path, caplog):
    """TempNet's networks are attached to the model it trains (its checkpoint's loss_* weights): the reference model
    is the model without them, and computes the features the model alone does."""
    state = torch.load(data['args'][data['args'].index('--pretrained') + 1])
    state['loss_temperature.image.prototypes'] = torch.zeros(4, 8)
    torch.save({'state_dict': {f'module.{k}': v for k, v in state.items()}}, tmp_path / 'tempnet.pt')
    argv = [str(a) for a in data['args']]
    argv[argv.index('--pretrained') + 1] = str(tmp_path / 'tempnet.pt')
    with caplog.at_level('INFO'):
        assert precompute.main(argv + ['--output', str(tmp_path / 'ref')]) == 0
    assert "the reference model leaves them out" in caplog.text
    one, ref = FeatureStore.open(data['one']), FeatureStore.open(tmp_path / 'ref')  # manifests name other files
    for shard in one.shards:
        assert np.array_equal(one.shard_features(shard.name), ref.shard_features(shard.name))


def test_parts_default_to_torchrun_or_the_slurm_array(monkeypatch):
    base = ['--model', 'm', '--train-data', 'x.tar', '--output', 'o']
    for name in ('RANK', 'WORLD_SIZE', 'SLURM_ARRAY_TASK_ID', 'SLURM_ARRAY_TASK_MIN', 'SLURM_ARRAY_TASK_COUNT',
                 'SLURM_ARRAY_TASK_STEP', 'SLURM_STEP_NUM_TASKS', 'SLURM_PROCID', 'SLURM_NTASKS'):
        monkeypatch.delenv(name, raising=False)
    args = precompute.parse_args(base)
    assert (args.part, args.num_parts) == (0, 1)
    # a batch script of a job of 4 tasks sees their count, but runs once: all of the shards
    monkeypatch.setenv('SLURM_NTASKS', '4')
    monkeypatch.setenv('SLURM_PROCID', '0')
    assert (precompute.parse_args(base).part, precompute.parse_args(base).num_parts) == (0, 1)
    monkeypatch.setenv('SLURM_STEP_NUM_TASKS', '4')  # `srun -n 4`: its task 2 of 4 (they raced for one store)
    monkeypatch.setenv('SLURM_PROCID', '2')
    assert (precompute.parse_args(base).part, precompute.parse_args(base).num_parts) == (2, 4)
    monkeypatch.delenv('SLURM_STEP_NUM_TASKS')
    monkeypatch.setenv('SLURM_ARRAY_TASK_ID', '7')
    monkeypatch.setenv('SLURM_ARRAY_TASK_MIN', '4')
    monkeypatch.setenv('SLURM_ARRAY_TASK_COUNT', '5')
    args = precompute.parse_args(base)
    assert (args.part, args.num_parts) == (3, 5)
    monkeypatch.setenv('SLURM_STEP_NUM_TASKS', '2')  # an array task's `srun -n 2`: its two halves of the task's part
    monkeypatch.setenv('SLURM_PROCID', '1')
    assert (precompute.parse_args(base).part, precompute.parse_args(base).num_parts) == (7, 10)
    monkeypatch.setenv('RANK', '1')
    monkeypatch.setenv('WORLD_SIZE', '2')
    args = precompute.parse_args(base)
    assert (args.part, args.num_parts) == (1, 2)
    for count, parts in ((5, 3), (2, 4), (100, 7)):
        slices = [range(count)[precompute.part_slice(count, i, parts)] for i in range(parts)]
        assert [i for s in slices for i in s] == list(range(count))
        assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_a_rerun_skips_finished_shards_and_ignores_leftovers(data, tmp_path, monkeypatch):
    out, partial = tmp_path / 'ref', tmp_path / 'ref.partial'
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 2, '--part', 0]) == 0  # shards 0, 1
    finished = {f: os.stat(partial / f).st_mtime_ns for f in os.listdir(partial) if f.startswith('shard-')}
    assert sorted(finished) == ['shard-0.features.npy', 'shard-0.keys.npy', 'shard-1.features.npy',
                                'shard-1.keys.npy']
    # what a killed writer leaves: a complete features file whose keys file was never written, and .tmp files
    shutil.copy(data['one'] / 'shard-3.features.npy', partial)
    (partial / 'shard-4.keys.npy.node7-123.tmp').write_bytes(b'half a file')
    (partial / 'shard-2.features.npy.node7-123.tmp').write_bytes(b'\x93NUMPY')
    encoded = []
    encode = precompute._encode
    monkeypatch.setattr(precompute, '_encode', lambda model, images, *a: encoded.append(len(images)) or
                        encode(model, images, *a))
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 1, '--part', 0]) == 0
    assert sum(encoded) == sum(SIZES[2:])  # shards 2, 3 and 4 only
    assert {f: os.stat(out / f).st_mtime_ns for f in finished} == finished
    assert same_store(data['one'], out)  # bit for bit, and no leftover file


def test_a_rerun_of_a_finished_part_loads_no_model(data, tmp_path, monkeypatch, caplog):
    """A SLURM array resubmitted whole reruns parts that are done: each loaded the reference model (minutes and a GPU's
    memory for a large one) to encode nothing."""
    out = tmp_path / 'ref'
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 2, '--part', 0]) == 0
    loads = []
    load = precompute._load_encoder
    monkeypatch.setattr(precompute, '_load_encoder', lambda args: loads.append(args.part) or load(args))
    caplog.set_level('INFO')
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 2, '--part', 0]) == 0
    assert loads == [] and "('shard-0' to 'shard-1'), 2 already finished" in caplog.text
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 2, '--part', 1]) == 0
    assert loads == [1] and same_store(data['one'], out)


def test_a_part_with_other_settings_is_refused(data, tmp_path):
    out = tmp_path / 'ref'
    FeatureStoreWriter(out, data['args'][1], data['args'][3], dtype='float32', shards=['shard-0'])
    with pytest.raises(SystemExit, match=r"ref.partial' holds an unfinished store written with dtype 'float32', "
                                         r"another list of shards"):
        precompute.main(data['args'] + ['--output', out, '--dtype', 'int8'])


@pytest.mark.parametrize('dtype, tolerance', [('float32', 0), ('float16', 1e-3), ('int8', 1 / 254)])
def test_every_dtype_loads_as_float32(tmp_path, dtype, tolerance):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(2, 10, 24))
    features /= np.linalg.norm(features, axis=-1, keepdims=True)
    features[:, 3] = 0  # a zero vector (e.g. an empty caption's) must survive int8 scaling
    writer = FeatureStoreWriter(tmp_path / 'ref', 'm', '', dim=24, dtype=dtype)
    writer.add_shard('a', [f'k{i}' for i in range(10)], features[0], features[1])
    assert writer.close()
    store = FeatureStore.open(tmp_path / 'ref')
    assert store.dtype == dtype and store.dim == 24
    assert (tmp_path / 'ref' / 'a.scales.npy').exists() == (dtype == 'int8')
    images, texts = store.batch_features(torch.tensor([store.index_of('a', f'k{i}') for i in range(10)]))
    assert images.dtype == texts.dtype == torch.float32
    for i, (image, text) in enumerate(zip(images, texts)):
        peak = np.abs(features[:, i]).max()  # int8's step is peak / 127, its error half of that
        assert np.abs(image.numpy() - features[0, i]).max() <= tolerance * peak + 1e-7
        assert np.abs(text.numpy() - features[1, i]).max() <= tolerance * peak + 1e-7
    assert np.array_equal(store.shard_features('a')[3], np.zeros((2, 24)))


@pytest.mark.parametrize('dtype', ['float32', 'float16', 'int8'])
def test_a_non_finite_vector_reads_back_as_one(tmp_path, dtype):
    """int8 stored a NaN vector as zeros at a finite scale: training then read a zero reference feature and went on."""
    features = np.full((2, 4, 8), 8 ** -0.5)
    features[1, 2, 5] = np.nan
    writer = FeatureStoreWriter(tmp_path / 'ref', 'm', '', dim=8, dtype=dtype)
    writer.add_shard('a', [f'k{i}' for i in range(4)], features[0], features[1])
    assert writer.close()
    store = FeatureStore.open(tmp_path / 'ref')
    store.batch_features(torch.tensor([0, 1, 3]))
    with pytest.raises(FeatureStoreError, match="shard 'a', row 2: non-finite features"):
        store.batch_features(torch.tensor([0, 2]))


def test_a_reference_that_gives_non_finite_features_stops_precompute_at_its_first_shard(data, tmp_path):
    checkpoint = data['args'][data['args'].index('--pretrained') + 1]
    state = torch.load(checkpoint)
    state['visual.proj'][0, 0] = float('nan')
    broken = tmp_path / 'nan.pt'
    torch.save(state, broken)
    argv = [str(a) for a in data['args']]
    argv[argv.index('--pretrained') + 1] = str(broken)
    for dtype in ('float16', 'int8'):
        with pytest.raises(SystemExit) as stop:
            precompute.main(argv + ['--output', str(tmp_path / dtype), '--dtype', dtype])
        assert (f"the reference --model {argv[argv.index('--model') + 1]} --pretrained {broken} gives features that "
                f"cannot be stored: shard 'shard-0', sample '0/sample-000' (row 0): non-finite image features; "
                f"nothing of the shard was written") == str(stop.value)
        assert FeatureStoreWriter.resume(tmp_path / dtype).shards == []


@pytest.mark.parametrize('order', [
    lambda members: members + members[:2],  # the first sample again at the end
    lambda members: members[:2] + members,  # again right after itself: OpenCLIP's training reads two samples
])
def test_a_shard_that_repeats_a_sample_key_is_named_as_the_datas_fault(data, tmp_path, order):
    """Training finds a tar sample's features by its key, so a key twice in a shard has no one row: precompute stops
    at that shard (features or keys only), says the data repeats it, and writes nothing of the shard."""
    source = data['root'] / 'shard-0.tar'
    repeated = tmp_path / 'shard-0.tar'
    with tarfile.open(source) as tar, tarfile.open(repeated, 'w') as out:
        for member in order(tar.getmembers()):
            out.addfile(member, tar.extractfile(member))
    argv = [str(a) for a in data['args']]
    argv[argv.index('--train-data') + 1] = str(repeated)
    for flags in (argv, ['--keys-only', '--train-data', str(repeated)]):
        output = tmp_path / f'ref-{len(flags)}'
        with pytest.raises(SystemExit) as stop:
            precompute.main(flags + ['--output', str(output)])
        assert str(stop.value) == (f"--train-data '{repeated}': shard 'shard-0': sample key '0/sample-000' appears "
                                   f"more than once; nothing of the shard was written")
        assert FeatureStoreWriter.resume(output).shards == []


def test_an_empty_shard_is_a_shard_of_no_samples(data, tmp_path):
    """img2dataset writes a shard with no sample where every download of it failed, and OpenCLIP trains through it:
    the store holds it with no sample, so that it covers the data."""
    empty = tmp_path / 'shard-9.tar'
    tarfile.open(empty, 'w').close()
    urls = f"{data['urls']}::{empty}"
    argv = [str(a) for a in data['args']]
    argv[argv.index('--train-data') + 1] = urls
    for flags in (argv, ['--keys-only', '--train-data', urls]):
        output = tmp_path / f'ref-{len(flags)}'
        assert precompute.main(flags + ['--output', str(output)]) == 0
        store = FeatureStore.open(output)
        assert store.shard('shard-9').count == 0 and store.num_samples == sum(SIZES)
        assert precompute.main(['verify', str(output), '--train-data', urls]) == 0


def test_precompute_writes_int8(data, tmp_path, capsys):
    assert precompute.main(data['args'] + ['--output', tmp_path / 'ref', '--dtype', 'int8']) == 0
    int8, one = FeatureStore.open(tmp_path / 'ref'), FeatureStore.open(data['one'])
    assert int8.dtype == 'int8' and int8.num_samples == one.num_samples
    assert np.abs(int8.shard_features('shard-3') - one.shard_features('shard-3')).max() < 5e-3
    scales = np.load(tmp_path / 'ref' / 'shard-3.scales.npy')
    scales[2, 0] = np.inf
    np.save(tmp_path / 'ref' / 'shard-3.scales.npy', scales)
    assert precompute.main(['verify', tmp_path / 'ref']) == 1
    assert "PROBLEM: shard 'shard-3', file 'shard-3.scales.npy': 32 non-finite values (first in row 2)" in \
        capsys.readouterr().out
    np.save(tmp_path / 'ref' / 'shard-3.scales.npy', scales.astype(np.float16))
    assert precompute.main(['verify', tmp_path / 'ref']) == 1
    assert f"'{tmp_path / 'ref' / 'shard-3.scales.npy'}' holds float16, not float32 (the manifest says int8)" in \
        capsys.readouterr().out


def test_finalize_finishes_a_store_whose_shards_are_all_written(tmp_path, capsys):
    out = tmp_path / 'ref'
    writer = FeatureStoreWriter(out, 'm', '', dtype='float16', shards=['a', 'b'])
    unit = np.eye(4)[:2]
    writer.add_shard('b', ['x', 'y'], unit, unit)
    with pytest.raises(SystemExit, match="1 of 2 shards are not finished, e.g. 'a'"):
        precompute.main(['--finalize', '--output', out])
    assert not (tmp_path / 'ref.partial' / LOCK).exists()  # a failed check leaves the lock to the next attempt
    writer.add_shard('a', ['z'], unit[:1], unit[:1])
    (tmp_path / 'ref.partial' / LOCK).touch()  # as if another process were finishing it
    with pytest.raises(SystemExit, match='another process is finishing the store'):
        precompute.main(['--finalize', '--output', out])
    assert not out.exists()
    (tmp_path / 'ref.partial' / LOCK).unlink()
    assert precompute.main(['--finalize', '--output', f'{out}/']) == 0  # the README's `--output ref/`
    store = FeatureStore.open(out)
    assert [(s.name, s.count) for s in store.shards] == [('a', 1), ('b', 2)] and store.index_of('b', 'y') == 2
    assert sorted(os.listdir(out)) == ['a.features.npy', 'a.keys.npy', 'b.features.npy', 'b.keys.npy',
                                       'manifest.json']


def test_an_output_that_cannot_be_written_is_named(data, tmp_path):
    (tmp_path / 'afile').write_text('x')  # where a folder is needed: as a read-only one, an OSError
    output = tmp_path / 'afile' / 'ref'
    with pytest.raises(SystemExit, match=re.escape(f"cannot write the store's folder '{output}.partial' (")):
        precompute.main(['--keys-only', '--train-data', data['urls'], '--output', output])


def _ended_process() -> str:
    """The id of a process of this host that has ended."""
    return subprocess.run(['sh', '-c', 'echo $$'], capture_output=True, text=True, check=True).stdout.split()[0]


def test_finalize_finishes_a_store_whose_finishing_was_killed_before_the_move(tmp_path, monkeypatch, caplog):
    """The manifest written, the store not yet moved into place, the lock left: --finalize names the lock's holder,
    and takes the lock over where that is a process of this host that has ended (it told the user to delete it)."""
    out = tmp_path / 'ref'
    writer = FeatureStoreWriter(out, 'm', '', dtype='float16', shards=['a'])
    writer.add_shard('a', ['x'], np.eye(4)[:1], np.eye(4)[:1])
    real = os.replace

    def killed(source, target):
        if str(source).endswith('.partial'):
            raise KeyboardInterrupt  # stands for a kill at this point
        return real(source, target)
    monkeypatch.setattr(os, 'replace', killed)
    with pytest.raises(KeyboardInterrupt):
        writer.close()
    monkeypatch.setattr(os, 'replace', real)
    assert not out.exists() and (tmp_path / 'ref.partial' / 'manifest.json').exists()
    lock = tmp_path / 'ref.partial' / LOCK
    with pytest.raises(SystemExit, match=f"taken by process {os.getpid()} on {socket.gethostname()}: another "
                                         f"process is finishing the store .*delete that file and run --finalize"):
        precompute.main(['--finalize', '--output', out])  # its holder, this process, still runs
    lock.write_text('node-elsewhere 12\n')  # another host's process: not known to have ended
    with pytest.raises(SystemExit, match="taken by process 12 on node-elsewhere"):
        precompute.main(['--finalize', '--output', out])
    ended = _ended_process()
    lock.write_text(f'{socket.gethostname()} {ended}\n')  # a process of this host that has ended: left behind
    with caplog.at_level(logging.WARNING):
        assert precompute.main(['--finalize', '--output', out]) == 0
    assert f"was left by process {ended} of this host, which has ended while finishing the store" in caplog.text
    assert [s.name for s in FeatureStore.open(out).shards] == ['a'] and not (tmp_path / 'ref.partial').exists()
    assert sorted(os.listdir(out)) == ['a.features.npy', 'a.keys.npy', 'manifest.json']


def test_two_finalize_taking_over_an_ended_lock_at_once_do_not_both_finish_the_store(tmp_path, monkeypatch):
    """Each read the ended holder; the one that comes second finds the lock gone (the store finished), or the other's
    fresh lock in its place, which it must leave there (it removed it, and both finished the store)."""
    out = tmp_path / 'ref'
    writer = FeatureStoreWriter(out, 'm', '', dtype='float16', shards=['a'])
    writer.add_shard('a', ['x'], np.eye(4)[:1], np.eye(4)[:1])
    lock = tmp_path / 'ref.partial' / LOCK
    ended = _ended_process()
    real = features.lock_holder
    reads = []

    def read_before_the_other_took_over(path):  # the first read: the ended holder, as the file said a moment ago
        reads.append(path)
        return (socket.gethostname(), int(ended)) if len(reads) == 1 else real(path)
    monkeypatch.setattr(features, 'lock_holder', read_before_the_other_took_over)
    lock.write_text(f'{socket.gethostname()} {os.getpid()}\n')  # the other --finalize's fresh lock: it is finishing
    with pytest.raises(SystemExit, match=f"taken by process {os.getpid()} on"):
        precompute.main(['--finalize', '--output', out])
    assert lock.read_text().split() == [socket.gethostname(), str(os.getpid())] and not out.exists()
    assert [p.name for p in lock.parent.iterdir() if p.name.startswith(LOCK)] == [LOCK]
    lock.unlink()  # the other finished and released it; this one read the ended holder before
    reads.clear()
    assert precompute.main(['--finalize', '--output', out]) == 0
    assert [s.name for s in FeatureStore.open(out).shards] == ['a']


def test_what_would_stop_precompute_later_stops_it_before_a_store_is_started(shapes, shards, tmp_path):
    """A mistyped shard range or model: stopped with its flag named and no `.partial` left behind, which would
    otherwise hold the mistyped plan and refuse the corrected command."""
    out = tmp_path / 'ref'
    cases = [(['--model', shapes['model'], '--train-data', str(shards['root'] / 'part-{0..4}.tar')],
              f"--train-data: no such file '{shards['root'] / 'part-4.tar'}'"),
             (['--model', shapes['model'], '--train-data', str(tmp_path / 'train.csv')],
              f"--train-data: no such file '{tmp_path / 'train.csv'}'"),
             (['--keys-only', '--train-data', str(shards['root'] / 'part-{0..4}.tar')], "no such file"),
             (['--model', 'ViT-B-33', '--train-data', shards['urls']],
              "cannot load the reference model --model ViT-B-33 on --device cpu: ")]
    for flags, message in cases:
        with pytest.raises(SystemExit, match=re.escape(message)):
            precompute.main([*flags, '--output', out, *([] if '--keys-only' in flags else ['--device', 'cpu'])])
        assert not out.exists() and not (tmp_path / 'ref.partial').exists()
    with pytest.raises(SystemExit, match=re.escape(f"import: --train-data: no such file '{tmp_path / 'x.csv'}'")):
        precompute.main(['import', tmp_path, '--train-data', tmp_path / 'x.csv', '--output', out])
    # what webdataset reads besides paths: file: URLs are checked as paths, remote URLs and pipes left to it
    shard = shards['root'] / 'part-0.tar'
    assert missing_local_file([('a', f'file:{shard}'), ('b', f'file://{shard}'), ('c', 's3://bucket/x.tar'),
                               ('d', 'pipe:curl -s https://host/x.tar')]) is None
    assert missing_local_file([('a', f'file:{tmp_path}/none.tar')]) == f'file:{tmp_path}/none.tar'


def test_a_file_url_shard_has_its_size_recorded_and_checked_as_a_path_does(tmp_path):
    from types import SimpleNamespace
    from drrho_openclip.openclip.flags import _shard_size_warning
    shard = tmp_path / 'part-0.tar'
    shard.write_bytes(bytes(10240))
    assert local_file_sizes([('part-0', f'file:{shard}'), ('part-1', 'pipe:cat x.tar'), ('part-2', 's3://b/x.tar')]
                            ) == {'part-0': 10240}
    store = SimpleNamespace(shard=lambda name: SimpleNamespace(source_bytes=20480))  # written from a larger shard
    for url in (str(shard), f'file:{shard}', f'file://{shard}'):
        warning = _shard_size_warning('ref_features', store, [url], url)
        assert warning and f"'{url}': 10240 bytes here, 20480 there" in warning


def test_parts_that_end_together_finish_the_store_once(tmp_path):
    # both parts see every shard finished; one moves the store in place first, and the other must step aside
    # instead of reporting the moved shards as missing (the race two torchrun ranks ran into)
    out = tmp_path / 'ref'
    first, second = (FeatureStoreWriter(out, 'm', '', dtype='float16', shards=['a', 'b']) for _ in range(2))
    unit = np.eye(4)[:2]
    first.add_shard('a', ['x', 'y'], unit, unit)
    second.add_shard('b', ['z'], unit[:1], unit[:1])
    assert first.missing() == second.missing() == []
    assert second.close()
    assert not first.close()
    assert precompute._finalize(first, explicit=False) == 0
    store = FeatureStore.open(out)
    assert [(s.name, s.count) for s in store.shards] == [('a', 2), ('b', 1)]
    assert not (tmp_path / 'ref.partial').exists()


def test_a_part_that_finds_the_store_being_finished_waits_for_it(tmp_path, monkeypatch, caplog):
    """Parts that end together (torchrun ranks): the one that finds the finishing lock taken waits to see the store
    in place and says so; only a lock that stays (its holder died) earns the warning."""
    import threading
    from drrho_openclip.features import LOCK
    out = tmp_path / 'ref'
    first, second = (FeatureStoreWriter(out, 'm', '', dtype='float16', shards=['a']) for _ in range(2))
    first.add_shard('a', ['x'], np.eye(4)[:1], np.eye(4)[:1])
    lock = tmp_path / 'ref.partial' / LOCK
    lock.touch()  # the other part took it, and finishes a moment later

    def the_other_part_finishes():
        lock.unlink()
        assert second.close()
    finisher = threading.Timer(0.5, the_other_part_finishes)
    finisher.start()
    caplog.set_level('INFO')
    assert precompute._finalize(first, explicit=False) == 0
    finisher.join()
    assert 'another process finished the store' in caplog.text and 'exists' not in caplog.text
    assert [s.name for s in FeatureStore.open(out).shards] == ['a']

    again = FeatureStoreWriter(tmp_path / 'ref2', 'm', '', dtype='float16', shards=['a'])
    again.add_shard('a', ['x'], np.eye(4)[:1], np.eye(4)[:1])
    (tmp_path / 'ref2.partial' / LOCK).touch()  # held by a process that died
    monkeypatch.setattr(precompute, 'FINISH_WAIT_S', 0.3)
    caplog.clear()
    assert precompute._finalize(again, explicit=False) == 1  # no store: a job chain must not go on to training
    assert "finalize.lock' exists: another process is finishing the store (or died doing so" in caplog.text
    assert f"no store was written to {tmp_path / 'ref2'} yet" in caplog.text


def test_a_part_whose_store_another_part_finished_says_so(data, tmp_path, monkeypatch, caplog):
    out = tmp_path / 'ref'
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 2, '--part', 1]) == 0
    compute = precompute._compute

    def compute_then_the_other_part_finishes(*args):
        result = compute(*args)
        assert FeatureStoreWriter.resume(out).close()  # between this part's last shard and its look at the store
        return result

    monkeypatch.setattr(precompute, '_compute', compute_then_the_other_part_finishes)
    caplog.set_level('INFO')
    assert precompute.main(data['args'] + ['--output', out, '--num-parts', 2, '--part', 0]) == 0
    assert 'another process finished the store' in caplog.text and 'not finished yet' not in caplog.text
    assert same_store(out, data['one'])


def test_verify_reports_every_shard_and_the_coverage(data, capsys):
    assert precompute.main(['verify', data['one'], '--train-data', data['urls']]) == 0
    out = capsys.readouterr().out
    assert "shard-3: 11 samples, keys unique, dim 32, float16, 0 non-finite, 11/11 data keys present" in out
    assert out.rstrip().endswith('OK')


def test_verify_against_some_of_the_stores_shards_checks_those(data, capsys):
    """Training accepts a store of more shards than --train-data names; verify compares the keys of those it names
    and reports the others as not in the data, not as problems."""
    assert precompute.main(['verify', data['one'], '--train-data', str(data['root'] / 'shard-{1..2}.tar')]) == 0
    out = capsys.readouterr().out
    assert "shard-1: 9 samples, keys unique, dim 32, float16, 0 non-finite, 9/9 data keys present" in out
    assert "shard-3: 11 samples, keys unique, dim 32, float16, 0 non-finite, not a shard of --train-data" in out
    assert out.rstrip().endswith('OK')


def test_verify_says_what_is_missing(data, tmp_path, capsys):
    missing = data['root'] / 'shard-9.tar'
    assert precompute.main(['verify', data['one'], '--train-data', str(missing)]) == 1
    assert f"PROBLEM: --train-data: [Errno 2] No such file or directory: '{missing}'" in capsys.readouterr().out
    (tmp_path / 'ref.partial').mkdir()  # a store being written
    assert precompute.main(['verify', tmp_path / 'ref']) == 1
    out = capsys.readouterr().out
    assert f"('{tmp_path / 'ref.partial'}' holds an unfinished one: run precompute again" in out
    shutil.copytree(data['one'], tmp_path / 'nan')
    _nan(tmp_path / 'nan' / 'shard-0.features.npy')
    assert precompute.main(['verify', tmp_path / 'nan']) == 1
    assert capsys.readouterr().out.rstrip().endswith('\n1 problem')


def test_verify_warns_where_a_shard_differs_in_size_from_the_one_the_store_was_written_from(data, tmp_path, capsys):
    """Training warns at start-up where a checked shard's size differs (another dataset's shards of the same names and
    keys would read other samples' features); verify said OK to the same data."""
    for i in range(len(SIZES)):
        shutil.copy(data['root'] / f'shard-{i}.tar', tmp_path)
    with open(tmp_path / 'shard-2.tar', 'ab') as f:
        f.write(b'\0' * 1024)  # tar's trailing zero blocks: the same samples, another size
    assert precompute.main(['verify', data['one'], '--train-data', str(tmp_path / 'shard-{0..4}.tar')]) == 0
    out = capsys.readouterr().out
    assert ("shard-2: 5 samples, keys unique, dim 32, float16, 0 non-finite, 5/5 data keys present -- size differs"
            in out)
    size = (tmp_path / 'shard-2.tar').stat().st_size
    assert f"WARNING: shard 'shard-2': '{tmp_path / 'shard-2.tar'}' has {size} bytes, the file the store was written " \
           f"from {size - 1024}" in out
    assert out.count('WARNING') == 1 and out.rstrip().endswith('OK')


def _nan(path):
    array = np.load(path)
    array[4, 1, 0] = np.nan
    np.save(path, array)


def _duplicate_key(path):
    keys = np.load(path)
    keys[2] = keys[0]
    np.save(path, keys)


def _rename_key(path):
    keys = np.load(path)
    keys[0] = 'not-in-the-data'
    np.save(path, keys)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:300])


@pytest.mark.parametrize('file, corrupt, message', [
    ('shard-2.features.npy', _nan,
     "shard 'shard-2', file 'shard-2.features.npy': 1 non-finite values (first in row 4)"),
    ('shard-2.features.npy', _truncate, "shard 'shard-2': '{root}/shard-2.features.npy' is corrupt"),
    ('shard-2.keys.npy', _duplicate_key, "shard 'shard-2', file 'shard-2.keys.npy': 1 keys appear more than once, "
                                         "e.g. '2/sample-016' 2 times"),
    ('shard-2.keys.npy', _rename_key, "shard 'shard-2', file 'shard-2.keys.npy': 1 samples of the data have no "
                                      "features, e.g. '2/sample-016'"),
])
def test_verify_names_the_corrupt_shard_and_file(data, tmp_path, capsys, file, corrupt, message):
    root = tmp_path / 'ref'
    shutil.copytree(data['one'], root)
    corrupt(root / file)
    assert precompute.main(['verify', root, '--train-data', data['urls']]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM: {message.format(root=root)}" in out
    assert "shard-1: 9 samples, keys unique" in out  # the other shards are still reported


def test_verify_exit_status_from_the_command_line(data, tmp_path):
    root = tmp_path / 'ref'
    shutil.copytree(data['one'], root)
    _nan(root / 'shard-0.features.npy')
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', 'verify', str(root)],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode == 1 and "PROBLEM: shard 'shard-0', file 'shard-0.features.npy'" in result.stdout


@pytest.mark.parametrize('cores, local_world_size, workers', [
    (2, None, 1),     # the model's loop on one core, a loader worker on the other
    (1, None, 1),
    (16, None, 8),    # capped
    (16, '8', 1),     # 8 processes per node share 16 cores
    (64, '4', 8),
])
def test_default_loader_workers_follow_the_cores_of_the_process(monkeypatch, cores, local_world_size, workers):
    monkeypatch.setattr(precompute.os, 'sched_getaffinity', lambda pid: set(range(cores)))
    if local_world_size is None:
        monkeypatch.delenv('LOCAL_WORLD_SIZE', raising=False)
    else:
        monkeypatch.setenv('LOCAL_WORLD_SIZE', local_world_size)
    assert precompute.default_workers() == workers


def test_default_loader_workers_without_cpu_affinity(monkeypatch):
    """Where the OS has no sched_getaffinity (macOS, Windows), the CPU count stands in for it."""
    monkeypatch.delattr(precompute.os, 'sched_getaffinity')
    monkeypatch.setattr(precompute.os, 'cpu_count', lambda: 4)
    monkeypatch.delenv('LOCAL_WORLD_SIZE', raising=False)
    assert precompute.default_workers() == 3


def test_a_mistyped_command_is_named():
    """precompute takes no positional argument: argparse's answer was "required: --output", not the typo."""
    with pytest.raises(SystemExit) as stop:
        precompute.main(['verfiy', 'ref/'])
    assert "no command 'verfiy' (the commands: verify, check, import" in str(stop.value)
