"""The sample index of WebDataset runs whose loss keeps per-sample state but reads no reference features: a keys-only
store (`drrho-openclip-features --keys-only`) passed to training as `--sample-index`."""
import filecmp
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

from conftest import ENV, checkpoint, run_openclip
from drrho_openclip import precompute
from drrho_openclip.openclip import run
from drrho_openclip.features import FeatureStore, FeatureStoreError, FeatureStoreWriter


@pytest.fixture(scope='module')
def index(shards, tmp_path_factory):
    """The keys-only store of the 4 shards, written through the command line (with 2 loader workers)."""
    out = tmp_path_factory.mktemp('index') / 'index'
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--keys-only', '--train-data',
                             shards['urls'], '--output', str(out), '--workers', '2'],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr
    return out


def test_keys_only_store_indexes_the_samples_as_the_feature_store_does(shards, index):
    keys, full = FeatureStore.open(index), FeatureStore.open(shards['ref'])
    assert keys.keys_only and keys.num_samples == 64
    manifest = json.loads((index / 'manifest.json').read_text())
    assert (manifest['dtype'], manifest['dim'], manifest['model']) == (None, 0, None)
    assert sorted(os.listdir(index)) == ['manifest.json'] + [f'part-{s}.keys.npy' for s in range(4)]
    assert [(s.name, s.count, s.offset) for s in keys.shards] == [(s.name, s.count, s.offset) for s in full.shards]
    for shard in full.shards:
        for key in full.keys(shard.name):
            assert keys.index_of(shard.name, key) == full.index_of(shard.name, key)
    assert keys.index_of('part-2', 'sample_2_05_x') == 2 * 16 + 5
    with pytest.raises(FeatureStoreError, match=r"index' is a keys-only store .*: it holds no reference features"):
        keys.batch_features(torch.tensor([0]))
    with pytest.raises(FeatureStoreError, match='is a keys-only store'):
        keys.batch_features(torch.tensor([0, 1]))
    with pytest.raises(FeatureStoreError, match="no sample keys for shard 'part-7'"):
        keys.index_of('part-7', 'sample_2_05_x')


def test_keys_are_grouped_and_filtered_as_the_training_reader_does(tmp_path):
    """Members out of key order, an upper-case extension, a sample without a caption, a key with a directory, and a
    file whose second dot makes its extension 'x.png' (not an image to either reader)."""
    import webdataset as wds
    from open_clip_train import data as oc
    members = ['b.txt', 'b.png', 'a.PNG', 'a.txt', 'no-caption.jpg', 'dir/c-1.webp', 'dir/c-1.txt', 'v2.x.png',
               'v2.x.txt']
    with tarfile.open(tmp_path / 'odd.tar', 'w') as tar:
        for name in members:
            path = tmp_path / 'member'
            path.write_bytes(b'not decoded')  # neither reader decodes anything to find the keys
            tar.add(path, arcname=name)
    assert precompute.main(['--keys-only', '--train-data', tmp_path / 'odd.tar', '--output', tmp_path / 'index',
                            '--workers', '0']) == 0
    training = wds.DataPipeline(wds.SimpleShardList([str(tmp_path / 'odd.tar')]), oc.tarfile_to_samples_nothrow,
                                wds.select(oc.filter_no_caption_or_no_image))
    expected = [sample['__key__'] for sample in training]
    assert expected == ['b', 'a', 'dir/c-1']
    assert FeatureStore.open(tmp_path / 'index').keys('odd').tolist() == expected


def test_keys_only_parts_resume_and_verify(shards, index, tmp_path, monkeypatch, capsys):
    out, partial = tmp_path / 'index', tmp_path / 'index.partial'
    args = ['--keys-only', '--train-data', shards['urls'], '--output', out, '--workers', '0']
    assert precompute.main(args + ['--num-parts', 2, '--part', 1]) == 0  # shards 2 and 3
    assert not out.exists()
    finished = {f: os.stat(partial / f).st_mtime_ns for f in os.listdir(partial) if f.startswith('part-')}
    assert sorted(finished) == ['part-2.keys.npy', 'part-3.keys.npy']
    read = []
    shard_keys = precompute.shard_keys
    monkeypatch.setattr(precompute, 'shard_keys', lambda url: read.append(url) or shard_keys(url))
    assert precompute.main(args) == 0  # one part for all: resumes, reading only the shards not finished
    assert [os.path.basename(url) for url in read] == ['part-0.tar', 'part-1.tar']
    assert {f: os.stat(out / f).st_mtime_ns for f in finished} == finished
    names = sorted(os.listdir(index))
    assert sorted(os.listdir(out)) == names and all(filecmp.cmp(index / n, out / n, shallow=False) for n in names)
    capsys.readouterr()
    assert precompute.main(['verify', out, '--train-data', shards['urls']]) == 0
    report = capsys.readouterr().out
    assert f"{out}: 4 shards, 64 samples, keys only (a sample index, no features)" in report
    assert "part-1: 16 samples, keys unique, keys only, 16/16 data keys present" in report
    assert report.rstrip().endswith('OK')


def test_a_feature_run_does_not_resume_a_keys_only_store(shapes, shards, tmp_path):
    out = tmp_path / 'ref'
    FeatureStoreWriter(out, None, None, dtype=None, shards=[f'part-{s}' for s in range(4)])
    with pytest.raises(SystemExit, match=r"ref.partial' holds an unfinished store written with model None, "
                                         r"pretrained None, keys only: resume it with the same settings"):
        precompute.main(['--model', shapes['model'], '--train-data', shards['urls'], '--output', out,
                         '--device', 'cpu'])


@pytest.mark.parametrize('extra, message', [
    (['--model', 'ViT-B-32'], '--model: not used with --keys-only'),
    (['--pretrained', 'openai', '--dtype', 'int8', '--batch-size', '8'],
     '--pretrained, --dtype, --batch-size: not used with --keys-only'),
    (['--finalize'], '--finalize reads the settings of the unfinished store'),
])
def test_keys_only_refuses_the_flags_it_would_ignore(capsys, extra, message):
    with pytest.raises(SystemExit) as stop:
        precompute.parse_args(['--keys-only', '--train-data', 'x.tar', '--output', 'o', *extra])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize('size', ['0', '-3'])
def test_precompute_refuses_a_batch_size_below_one(capsys, size):
    with pytest.raises(SystemExit):
        precompute.parse_args(['--model', 'm', '--train-data', 'x.tar', '--output', 'o', '--batch-size', size])
    assert f'--batch-size must be at least 1, not {size}' in capsys.readouterr().err


def test_keys_only_needs_no_model_and_no_csv(capsys):
    args = precompute.parse_args(['--keys-only', '--train-data', 'x-{0..3}.tar', '--output', 'o'])
    assert args.keys_only and args.model is None and args.dtype is None
    with pytest.raises(SystemExit):
        precompute.parse_args(['--keys-only', '--train-data', 'train.csv', '--output', 'o'])
    assert '--keys-only is for WebDataset shards' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        precompute.parse_args(['--train-data', 'x.tar', '--output', 'o'])
    assert '--model is required (except with --keys-only or --finalize)' in capsys.readouterr().err


def test_sogclr_trains_on_webdataset_with_a_sample_index(shapes, shards, index, tmp_path):
    # shards 0-2 as they are, shard 3 without its odd-numbered samples: the rows of the state the run updates show
    # where it put every key it read
    data = tmp_path / 'data'
    data.mkdir()
    for s in range(3):
        os.symlink(shards['root'] / f'part-{s}.tar', data / f'part-{s}.tar')
    with tarfile.open(shards['root'] / 'part-3.tar') as full, tarfile.open(data / 'part-3.tar', 'w') as part:
        for member in full.getmembers():
            if int(member.name.split('_')[2]) % 2 == 0:  # sample_3_05_x.png: sample 5
                part.addfile(member, full.extractfile(member))
    run_openclip(['--train-data', data / 'part-{0..3}.tar', '--dataset-type', 'webdataset', '--train-num-samples', '56',
                  '--model', shapes['model'], '--batch-size', '8', '--epochs', '2', '--lr', '1e-3', '--warmup', '2',
                  '--workers', '0', '--precision', 'fp32', '--device', 'cpu', '--seed', '0', '--logs', tmp_path,
                  '--name', 'run', '--loss', 'sogclr', '--gamma', '0.5', '--sample-index', index])
    store = FeatureStore.open(index)
    trained = {store.index_of(f'part-{s}', f'sample_{s}_{i:02d}_x') for s in range(4) for i in range(16)
               if s < 3 or i % 2 == 0}
    assert len(trained) == 56
    state = checkpoint(tmp_path, 'run', 2)['loss_state']
    for table in ('state.log_u_image', 'state.log_u_text'):
        assert state[table].shape == (64,)
        assert set(torch.isfinite(state[table]).nonzero().flatten().tolist()) == trained  # the rest is NaN: unseen


def test_a_resume_onto_a_shard_rewritten_in_another_order_stops(shapes, shards, tmp_path):
    """A shard's samples in another order (a store written again for a copy of the data) have the same shard names
    and sizes: the state's rows would be other samples'; the store records each shard's keys in order."""
    data = tmp_path / 'data'
    data.mkdir()
    for s in range(4):
        os.symlink(shards['root'] / f'part-{s}.tar', data / f'part-{s}.tar')
    index = tmp_path / 'index'
    assert precompute.main(['--keys-only', '--train-data', str(data / 'part-{0..3}.tar'), '--output', index]) == 0
    args = ['--train-data', data / 'part-{0..3}.tar', '--dataset-type', 'webdataset', '--train-num-samples', '64',
            '--model', shapes['model'], '--batch-size', '8', '--epochs', '1', '--lr', '1e-3', '--warmup', '2',
            '--workers', '0', '--precision', 'fp32', '--device', 'cpu', '--seed', '0', '--logs', tmp_path,
            '--name', 'run', '--loss', 'sogclr', '--gamma', '0.5', '--sample-index', index, '--resume', 'latest']
    run_openclip(args)
    os.unlink(data / 'part-0.tar')
    with tarfile.open(shards['root'] / 'part-0.tar') as full, tarfile.open(data / 'part-0.tar', 'w') as reordered:
        members = full.getmembers()
        for i in reversed(range(0, len(members), 2)):  # the samples (image, caption) in reverse order
            for member in members[i:i + 2]:
                reordered.addfile(member, full.extractfile(member))
    assert precompute.main(['--keys-only', '--train-data', str(data / 'part-{0..3}.tar'), '--output', index,
                            '--overwrite']) == 0
    args[args.index('--epochs') + 1] = '2'
    result = run_openclip(args, check=False)
    assert result.returncode != 0 and "holds per-sample state whose rows are other samples than this run's" in \
        result.stderr, result.stderr[-2000:]


def parse(*argv):
    """The flags as `open_clip_train.main` parses them: OpenCLIP's parser with the plugin's add_args and check_args."""
    from open_clip_train.params import parse_args
    return parse_args([str(a) for a in argv])


def wds(shapes, shards, *extra):
    return ['--train-data', shards['urls'], '--dataset-type', 'webdataset', '--model', shapes['model'], *extra]


def test_sample_index_flag_is_accepted_for_losses_with_per_sample_state(shapes, shards, index):
    for extra in (['--loss', 'sogclr', '--gamma', '0.5'],
                  ['--loss', 'isogclr', '--gamma', '1'],  # γ 1 still learns a τ per sample
                  # online reference: no store of its own; γ < 1 keeps a per-sample u
                  ['--loss', 'drrho', '--gamma', '0.5', '--ref-model', shapes['model']]):
        parse(*wds(shapes, shards, *extra, '--sample-index', index))
        assert run.active().sample_index_size == 64


@pytest.mark.parametrize('extra, message', [
    (['--loss', 'clip', '--sample-index', '{index}'],
     '--sample-index: --loss clip with these options keeps no per-sample state, so it needs no sample index'),
    (['--loss', 'sogclr', '--gamma', '1', '--sample-index', '{index}'], 'needs no sample index (--gamma 1)'),
    (['--loss', 'drrho', '--gamma', '0.5', '--ref-features', '{ref}', '--sample-index', '{index}'],
     '--sample-index: the --ref-features store already indexes the samples; drop --sample-index'),
    (['--loss', 'sogclr', '--gamma', '0.5'],
     "--loss sogclr keeps per-sample state, and WebDataset samples have no index of their own: write one with "
     "`drrho-openclip-features --keys-only --train-data '{urls}' --output DIR` and pass --sample-index DIR"),
    (['--loss', 'isogclr'], '`drrho-openclip-features --keys-only'),
    (['--loss', 'drrho', '--gamma', '0.5', '--ref-model', 'm'], '(or precompute the reference features: --ref-features indexes them'),
    (['--loss', 'drrho', '--ref-features', '{index}'],
     "--ref-features: '{index}' is a keys-only store: it holds no reference features"),
    (['--loss', 'sogclr', '--sample-index', '{ref}/nowhere'], "--sample-index: reference-feature directory"),
])
def test_sample_index_errors_name_the_flag(shapes, shards, index, capsys, extra, message):
    where = dict(index=index, ref=shards['ref'], urls=shards['urls'])
    with pytest.raises(SystemExit) as stop:
        parse(*wds(shapes, shards, *[e.format(**where) for e in extra]))
    assert stop.value.code == 2 and message.format(**where) in capsys.readouterr().err


def test_sample_index_is_refused_for_csv_input(shapes, index, capsys):
    with pytest.raises(SystemExit):
        parse('--train-data', shapes['csv'], '--model', shapes['model'], '--loss', 'sogclr', '--sample-index', index)
    assert '--sample-index is for WebDataset input: the rows of --dataset-type csv input are its sample index' in \
        capsys.readouterr().err


def test_the_training_loader_samples_whole_windows_of_batch_times_accum_freq():
    """What the run's loader is given (`wrap_data`): two ranks with --batch-size 2 and --accum-freq 2 gather, window by
    window, the one process's batches of 8."""
    from types import SimpleNamespace
    from torch.utils.data import DataLoader
    from open_clip_train.data import DataInfo, SyntheticDataset
    from drrho_openclip.openclip.loaders import _with_sample_extras

    def sampled(world_size, rank, batch_size, accum_freq):
        loader = DataLoader(SyntheticDataset(image_size=(4, 4), dataset_size=70))
        loader.num_samples = 70  # as OpenCLIP sets it
        data = {'train': DataInfo(loader)}
        args = SimpleNamespace(world_size=world_size, rank=rank, seed=5, batch_size=batch_size, accum_freq=accum_freq,
                               workers=0)
        sampler = _with_sample_extras(SimpleNamespace(reference_store=None), data, args)['train'].sampler
        sampler.set_epoch(1)
        return list(sampler)
    one, ranks = sampled(1, 0, 8, 1), [sampled(2, rank, 2, 2) for rank in range(2)]
    assert [s for window in range(len(one) // 8) for r in ranks for s in r[4 * window:4 * (window + 1)]] == one


@pytest.mark.parametrize('samples, batch, accum', [(65, 3, 1), (70, 2, 3)])
def test_every_step_has_the_one_process_global_batch_at_any_world_size(samples, batch, accum):
    """CSV and synthetic input: rank r's block of each window, gathered in rank order, is the one process's global
    batch, sample for sample (what is chosen from the first batch's first anchors depends on their order), and no
    rank trains on a repeated sample or a step more (DistributedSampler padded the epoch: 65 samples at a global batch
    of 6 gave two ranks 11 steps, one process 10)."""
    from drrho_openclip.openclip.loaders import GlobalBatchSampler
    rows = batch * accum  # a rank's rows per optimiser step
    for epoch in (0, 1):
        one = GlobalBatchSampler(range(samples), 1, 0, 5, 2 * rows)
        ranks = [GlobalBatchSampler(range(samples), 2, rank, 5, rows) for rank in range(2)]
        for sampler in (one, *ranks):
            sampler.set_epoch(epoch)
        blocks = [list(sampler) for sampler in ranks]
        gathered = [sample for step in range(len(blocks[0]) // rows) for block in blocks
                    for sample in block[step * rows:(step + 1) * rows]]
        assert gathered == list(one) and len(set(gathered)) == len(gathered)
        assert len(gathered) == samples // (2 * rows) * 2 * rows and len(one) == len(gathered)
        assert [len(sampler) for sampler in ranks] == [len(gathered) // 2] * 2


@pytest.mark.parametrize('seed', [0, 123_456_789])
def test_a_map_style_sample_draws_the_same_augmentation_whatever_the_seed(seed):
    """A CSV sample's augmentation is seeded by (--seed, epoch, index): reproducible, for any --seed, whichever
    generator it draws from (timm's, with --aug-cfg use_timm=True, draw from Python's and numpy's), and the caller's
    own draws go on unchanged."""
    import random

    import numpy as np
    from drrho_openclip.openclip.loaders import WithSampleExtras

    class Draws:  # a dataset whose "augmentation" is a draw from each generator
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return (torch.rand(3), random.random(), np.random.rand()), index

    sampler = type('Sampler', (), {'epoch': 2})()
    dataset = WithSampleExtras(Draws(), sampler, seed)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    first, again = dataset[3], dataset[3]
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    assert torch.equal(first[0][0], again[0][0]) and first[0][1:] == again[0][1:] and first[2] == {'index': 3}
    other = dataset[2][0]
    assert not torch.equal(first[0][0], other[0]) and first[0][1] != other[1] and first[0][2] != other[2]
