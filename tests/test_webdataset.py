"""WebDataset input: reference features written per shard by the precompute command, looked up by `__key__`."""
import io
import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset

from conftest import ENV, checkpoint, refused_at_parsing, run_openclip
from drrho_openclip import precompute
from drrho_openclip.data import shard_urls
from drrho_openclip.features import FeatureStore, first_dot_name


def wds_args(shapes, shards, logs, name, *extra):
    return ['--train-data', shards['urls'], '--dataset-type', 'webdataset', '--train-num-samples', '64',
            '--model', shapes['model'], '--batch-size', '8', '--epochs', '2', '--lr', '1e-3', '--warmup', '2',
            '--workers', '2', '--precision', 'fp32', '--device', 'cpu', '--seed', '0', '--logs', logs, '--name', name,
            '--loss', 'drrho', '--gamma', '0.5', '--ref-features', shards['ref'], *extra]


def test_precompute_writes_one_store_shard_per_tar(shards):
    store = FeatureStore.open(shards['ref'])
    assert [s.name for s in store.shards] == [f'part-{s}' for s in range(4)]
    assert store.num_samples == 64 and store.dim == 32 and store.dtype == 'float16'
    assert store.index_of('part-2', 'sample_2_05_x') == 2 * 16 + 5
    images, texts = store.batch_features(torch.tensor([37]))
    image, text = images[0], texts[0]
    assert image.shape == (32,) and abs(image.norm().item() - 1) < 1e-2 and abs(text.norm().item() - 1) < 1e-2


@pytest.mark.parametrize('resampled', [False, True])
def test_drrho_trains_on_webdataset(shapes, shards, tmp_path, resampled):
    extra = ['--dataset-resampled'] if resampled else []
    run_openclip(wds_args(shapes, shards, tmp_path, 'run', *extra))
    log_u = checkpoint(tmp_path, 'run', 2)['loss_state']['state.log_u_image']
    visited = torch.isfinite(log_u)
    assert log_u.shape == (64,) and visited.sum() >= 32  # WebDataset epochs are not exact passes


# Loader workers started by forkserver, Python 3.14's default on Linux, receive the dataset pickled, so a lambda
# anywhere in it (OpenCLIP 3.3.0's WebDataset and synthetic pipelines had two) fails the run before its first batch;
# with fork (the default before 3.14) nothing is pickled and such a bug stays hidden.
def test_loader_workers_started_by_forkserver_get_the_samples_extras(shapes, shards, tmp_path):
    run_openclip(wds_args(shapes, shards, tmp_path, 'run'), start_method='forkserver')
    log_u = checkpoint(tmp_path, 'run', 2)['loss_state']['state.log_u_image']
    assert torch.isfinite(log_u).sum() >= 32  # each batch came with its sample index and reference features


@pytest.mark.parametrize('loss', ['clip', 'sogclr'])
def test_synthetic_data_trains_with_workers_started_by_forkserver(shapes, tmp_path, loss):
    args = ['--dataset-type', 'synthetic', '--train-num-samples', '32', '--model', shapes['model'],
            '--batch-size', '8', '--epochs', '1', '--workers', '2', '--precision', 'fp32', '--device', 'cpu',
            '--logs', tmp_path, '--name', 'run', '--loss', loss]
    run_openclip(args, start_method='forkserver')
    assert checkpoint(tmp_path, 'run', 1)['epoch'] == 1


def test_a_shard_without_features_or_file_is_named(shapes, shards, tmp_path, capsys):
    """Both stop at parsing, before OpenCLIP creates the run: a shard the store was not written for, and a shard path
    that is no file (a mistyped range), which is said as such rather than as a shard without features."""
    extra_shard = shards['root'] / 'part-9.tar'
    extra_shard.write_bytes((shards['root'] / 'part-0.tar').read_bytes())
    missing = shards['root'] / 'part-8.tar'
    for added, said in ((extra_shard, "no reference features for shard 'part-9'"),
                        (missing, f"--train-data: no such file '{missing}'")):
        args = wds_args(shapes, shards, tmp_path, 'run', '--workers', '0')
        args[1] = str(shards['root'] / 'part-{0..3}.tar') + '::' + str(added)
        assert said in refused_at_parsing(args, capsys)


def test_two_shards_of_one_file_name_are_refused(shapes, shards, tmp_path, capsys):
    """cc3m/00000.tar::cc12m/00000.tar: the store keys shards by file name, so the second would silently read the
    first one's features and per-sample state. The same shard twice (upsampling a source) reads the same one."""
    other = tmp_path / 'other'
    other.mkdir()
    (other / 'part-0.tar').write_bytes((shards['root'] / 'part-1.tar').read_bytes())
    args = wds_args(shapes, shards, tmp_path, 'run', '--workers', '0')
    args[1] = shards['urls'] + '::' + str(other / 'part-0.tar')
    assert (f"--ref-features: '{shards['root'] / 'part-0.tar'}' and '{other / 'part-0.tar'}' in --train-data have "
            f"one file name") in refused_at_parsing(args, capsys)
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'],
                             '--train-data', args[1], '--output', str(tmp_path / 'ref')],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and "are both shard 'part-0'" in result.stderr
    args[1] = shards['urls'] + '::' + str(shards['root'] / 'part-0.tar')
    args[args.index('--epochs') + 1] = '1'
    run_openclip(args)


def test_shards_of_the_same_names_and_other_sizes_are_warned_about(shapes, shards, tmp_path):
    """Another dataset's tar shards can have the store's shard names and keys (img2dataset numbers both alike): the
    store records its shards' sizes, and a run whose shards differ says so at start-up. A warning: shards filtered
    after the store was written differ too, and their samples' features are right."""
    import shutil
    other = tmp_path / 'other'
    shutil.copytree(shards['root'], other, ignore=shutil.ignore_patterns('ref', '*.txt'))
    with open(other / 'part-1.tar', 'ab') as f:  # the same keys, other content
        f.write(bytes(10240))
    size = (other / 'part-1.tar').stat().st_size
    assert FeatureStore.open(shards['ref']).shard('part-1').source_bytes == size - 10240
    args = wds_args(shapes, shards, tmp_path, 'run', '--workers', '0', '--epochs', '1')
    args[1] = str(other / 'part-{0..3}.tar')
    result = run_openclip(args)
    assert (f"1 of the 4 --train-data shards checked differ in size from those --ref-features was written from, "
            f"e.g. '{other / 'part-1.tar'}': {size} bytes here, {size - 10240} there") in result.stderr
    # the data it was written from: no warning
    assert 'differ in size' not in run_openclip(wds_args(shapes, shards, tmp_path, 'same', '--workers', '0',
                                                          '--epochs', '1')).stderr


def test_an_image_that_cannot_be_decoded_is_left_out_of_the_store_as_training_leaves_it_out(shapes, shards, tmp_path,
                                                                                           capsys):
    import tarfile
    data = tmp_path / 'data'
    data.mkdir()
    with tarfile.open(shards['root'] / 'part-0.tar') as source, tarfile.open(data / 'part-0.tar', 'w') as tar:
        for member in source.getmembers():
            content = source.extractfile(member).read()
            if member.name == 'sample_0_03_x.png':
                content = b'not an image'
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'],
                             '--train-data', str(data / 'part-0.tar'), '--output', str(tmp_path / 'ref'),
                             '--workers', '0'], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"'{data / 'part-0.tar'}': sample 'sample_0_03_x' cannot be decoded" in result.stderr
    store = FeatureStore.open(tmp_path / 'ref')
    assert store.num_samples == 15 and 'sample_0_03_x' not in store.keys('part-0').tolist()
    # verify accounts for it: no problem, and the line says what was left out and why
    assert precompute.main(['verify', str(tmp_path / 'ref'), '--train-data', str(data / 'part-0.tar')]) == 0
    assert ("15/16 data keys present (1 left out: their images cannot be decoded, e.g. 'sample_0_03_x')"
            in capsys.readouterr().out)
    args = wds_args(shapes, dict(shards, ref=tmp_path / 'ref'), tmp_path, 'run', '--workers', '0',
                    '--train-num-samples', '15', '--epochs', '1')
    args[1] = str(data / 'part-0.tar')
    run_openclip(args)  # training skips that sample too: it never asks the store for it
    # import, from another encoder's features of the samples it could decode, with keys or in data order
    keys = store.keys('part-0').tolist()
    image, text = store.shard_features('part-0').transpose(1, 0, 2)
    for name, extra in (('keyed', {'keys': np.array(keys[::-1])}), ('ordered', {})):
        (tmp_path / name).mkdir()
        rows = slice(None, None, -1) if extra else slice(None)
        np.savez(tmp_path / name / 'part-0.npz', image_features=image[rows], text_features=text[rows], **extra)
        result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', 'import', str(tmp_path / name),
                                 '--train-data', str(data / 'part-0.tar'), '--output', str(tmp_path / f'{name}_ref')],
                                capture_output=True, text=True, env=ENV)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "1 samples whose image cannot be decoded have no features, e.g. 'sample_0_03_x'" in result.stderr
        imported = FeatureStore.open(tmp_path / f'{name}_ref')
        assert imported.keys('part-0').tolist() == keys
        assert np.array_equal(imported.shard_features('part-0'), store.shard_features('part-0'))


def run_precompute(shapes, urls, output, *extra):
    return subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'],
                           '--train-data', urls, '--output', str(output), *map(str, extra)],
                          capture_output=True, text=True, env=ENV)


def test_precompute_refuses_to_overwrite_a_store_of_other_settings(shapes, shards):
    """A finished store written otherwise stops precompute, naming what differs; the same settings find nothing to
    do and succeed (a rerun, a resubmitted array task). Neither touches the store."""
    before = (shards['ref'] / 'manifest.json').read_bytes()
    result = run_precompute(shapes, shards['urls'], shards['ref'], '--dtype', 'float32')
    assert result.returncode != 0
    assert (f"{shards['ref']} already holds a reference-feature store, written with dtype 'float16'; pass "
            f"--overwrite to replace it") in result.stderr
    result = run_precompute(shapes, shards['urls'], shards['ref'])
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'already holds the finished store of these 4 shards with these settings: nothing to do' in result.stderr
    assert (shards['ref'] / 'manifest.json').read_bytes() == before


def test_a_resubmitted_part_finds_the_store_finished(shapes, shards, tmp_path):
    """An array whose task 1 ran alone, then resubmitted: task 0 finishes the store, and task 1, starting after,
    has nothing left to do and succeeds (it stopped with an error, failing the array and the verify chained to it)."""
    output = tmp_path / 'ref'
    parts = ('--num-parts', 2, '--part')
    result = run_precompute(shapes, shards['urls'], output, *parts, 1)
    assert result.returncode == 0 and '2 shards of other parts are not finished yet' in result.stderr
    assert run_precompute(shapes, shards['urls'], output, *parts, 0).returncode == 0
    result = run_precompute(shapes, shards['urls'], output, *parts, 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'nothing to do' in result.stderr
    assert FeatureStore.open(output).shards == FeatureStore.open(shards['ref']).shards



def test_accumulation_steps_the_learned_temperature_once_per_window(shapes, shards, tmp_path):
    """fastclip with γ = 1 reads neither an index nor reference features, so its WebDataset batches carry no extras;
    under --accum-freq its learned τ must still take one Adam step per window, not one per call. Adam's first step
    on log τ is exactly lr_tau long (m and v start at the first gradient and its square)."""
    args = wds_args(shapes, shards, tmp_path, 'run')
    args = args[:args.index('--loss')] + ['--loss', 'fastclip', '--gamma', '1', '--lr-tau', '0.05']
    for option, value in (('--train-num-samples', '8'), ('--batch-size', '4'), ('--epochs', '1'), ('--workers', '1')):
        args[args.index(option) + 1] = value
    run_openclip([*args, '--accum-freq', '2'])  # 2 batches: one window, one optimiser step
    log_tau = checkpoint(tmp_path, 'run', 1)['loss_state']['temperature.log_tau'].item()
    assert abs(log_tau - math.log(0.07)) == pytest.approx(0.05, rel=1e-4)


def test_shards_whose_names_differ_after_a_dot_are_two_shards(shapes, shards, tmp_path):
    """train.000.tar and train.001.tar: a shard is named up to its data extension, not its first dot (which made both
    'train', refused as one file name), so a store is written for them and training reads each shard's features."""
    data = tmp_path / 'data'
    data.mkdir()
    for s in range(4):
        (data / f'train.00{s}.tar').write_bytes((shards['root'] / f'part-{s}.tar').read_bytes())
    urls = str(data / 'train.00{0..3}.tar')
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'],
                             '--train-data', urls, '--output', str(tmp_path / 'ref'), '--workers', '0'],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    store, written_before = FeatureStore.open(tmp_path / 'ref'), FeatureStore.open(shards['ref'])
    assert [s.name for s in store.shards] == [f'train.00{s}' for s in range(4)]
    assert all(list(store.keys(f'train.00{s}')) == list(written_before.keys(f'part-{s}')) for s in range(4))
    args = wds_args(shapes, {**shards, 'urls': urls, 'ref': tmp_path / 'ref'}, tmp_path, 'run', '--workers', '0')
    run_openclip(args)
    assert torch.isfinite(checkpoint(tmp_path, 'run', 2)['loss_state']['state.log_u_image']).sum() >= 32


def test_shards_too_small_for_a_batch_per_loader_worker_stop_the_run_instead_of_waiting_forever(shapes, shards,
                                                                                              tmp_path):
    """4 shards of 16 samples, 2 workers: each reads 2 shards, 32 samples a pass. OpenCLIP's loader forms batches
    within a pass and repeats the pass until it has one, so at --batch-size 40 it would wait forever."""
    args = wds_args(shapes, shards, tmp_path, 'run', '--workers', '2')
    args[args.index('--batch-size') + 1] = '40'
    result = run_openclip(args, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    assert ("its 2 readers (1 rank(s) × 2 worker(s)) each pass over 2 or more of the 4 shards, which can hold as few "
            "as 32 samples, fewer than --batch-size 40") in result.stderr
    args[args.index('--batch-size') + 1] = '32'  # one batch a pass: it trains
    args[args.index('--name') + 1] = 'fits'
    run_openclip(args)
    assert checkpoint(tmp_path, 'fits', 2)['epoch'] == 2


def test_shard_urls_with_environment_variables_are_read_as_webdataset_reads_them(shapes, shards, tmp_path,
                                                                                  monkeypatch):
    """webdataset replaces ${VAR} in --train-data with the environment's WDS_VAR (a dataset root per cluster): the
    store is written for, and training finds, the shards it names; an unset one is named."""
    monkeypatch.setitem(ENV, 'WDS_SHARDS', str(shards['root']))
    urls = '${SHARDS}/part-{0..3}.tar'
    command = [sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'], '--train-data', urls,
               '--output', str(tmp_path / 'ref'), '--workers', '0']
    result = subprocess.run(command, capture_output=True, text=True, env=ENV)
    if not hasattr(webdataset.shardlists, 'envsubst'):  # before 0.2.48 webdataset read the URL as written
        assert result.returncode == 1 and "no such file '${SHARDS}/part-0.tar'" in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert [s.name for s in FeatureStore.open(tmp_path / 'ref').shards] == [f'part-{s}' for s in range(4)]
    args = wds_args(shapes, {**shards, 'urls': urls, 'ref': tmp_path / 'ref'}, tmp_path, 'run', '--workers', '0')
    args[args.index('--epochs') + 1] = '1'
    run_openclip(args)
    assert torch.isfinite(checkpoint(tmp_path, 'run', 1)['loss_state']['state.log_u_image']).sum() >= 32
    monkeypatch.delitem(ENV, 'WDS_SHARDS')
    result = subprocess.run(command, capture_output=True, text=True, env=ENV)
    assert result.returncode == 1
    assert "webdataset reads ${SHARDS} from the environment variable WDS_SHARDS, which is not set" in result.stderr


def as_written_before_shard_names(folder, plan=False):
    """Make the store (or with `plan`, the unfinished store's plan) in `folder` what an earlier version wrote: shards
    named up to the first dot of their file names, and no record of the rule."""
    path = folder / ('partial.json' if plan else 'manifest.json')
    content = json.loads(path.read_text())
    del content['shard_names']
    names = content['shards'] if plan else [entry['name'] for entry in content['shards']]
    renamed = {name: first_dot_name(name) for name in names}
    for name, old in renamed.items():
        for file in folder.glob(f'{name}.*.npy'):
            file.rename(folder / (old + file.name[len(name):]))
    if plan:  # the plan keys what the data was by shard name; a manifest holds it in each shard's entry
        content['shards'] = [renamed[name] for name in names]
        for key in ('source_bytes', 'captions_sha256', 'image_bytes'):
            content[key] = {renamed[name]: value for name, value in content.get(key, {}).items()}
    else:
        for entry in content['shards']:
            entry['name'] = renamed[entry['name']]
    path.write_text(json.dumps(content))


@pytest.fixture
def dotted_shards(shards, tmp_path):
    """part-0..1 as a.v2.tar and b.v2.tar: one dot more than their data extension."""
    data = tmp_path / 'dotted'
    data.mkdir()
    for s, stem in enumerate('ab'):
        (data / f'{stem}.v2.tar').write_bytes((shards['root'] / f'part-{s}.tar').read_bytes())
    return str(data / '{a,b}.v2.tar')


def test_a_store_written_before_shard_names_kept_their_dots_is_found_complete_on_a_rerun(shapes, dotted_shards,
                                                                                         tmp_path, caplog):
    """A resubmitted precompute over a store an earlier version wrote (shards 'a', 'b' of a.v2.tar, b.v2.tar): the
    same store, nothing to do (it was refused as one of other shards, data and sizes); training reads it."""
    store = tmp_path / 'ref'
    command = ['--model', shapes['model'], '--train-data', dotted_shards, '--output', store, '--workers', '0']
    assert precompute.main(command) == 0
    as_written_before_shard_names(store)
    written = (store / 'manifest.json').read_text()
    assert [s.source_bytes for s in FeatureStore.open(store).shards] == [(Path(dotted_shards).parent / f).stat().st_size
                                                                        for f in ('a.v2.tar', 'b.v2.tar')]
    with caplog.at_level(logging.INFO):
        assert precompute.main(command) == 0
    assert 'nothing to do' in caplog.text and (store / 'manifest.json').read_text() == written
    assert [s.name for s in FeatureStore.open(store).shards] == ['a', 'b']
    assert precompute.main(['verify', store, '--train-data', dotted_shards]) == 0


def test_an_unfinished_store_planned_by_an_earlier_version_is_not_finished_under_other_names(shapes, shards,
                                                                                            dotted_shards, tmp_path):
    """Its plan names shards up to their first dot: where today's names differ, say so (the settings cannot be made
    'the same'); where they do not (00000.tar), resume it."""
    store = tmp_path / 'ref'
    parts = ['--model', shapes['model'], '--output', store, '--workers', '0', '--num-parts', '2', '--part']
    assert precompute.main(['--train-data', dotted_shards, *parts, '0']) == 0
    as_written_before_shard_names(tmp_path / 'ref.partial', plan=True)
    with pytest.raises(SystemExit, match="started by an earlier version, which named shards up to the first dot"):
        precompute.main(['--train-data', dotted_shards, *parts, '1'])
    shutil.rmtree(tmp_path / 'ref.partial')
    urls = str(shards['root'] / 'part-{0..1}.tar')
    assert precompute.main(['--train-data', urls, *parts, '0']) == 0
    as_written_before_shard_names(tmp_path / 'ref.partial', plan=True)
    assert precompute.main(['--train-data', urls, *parts, '1']) == 0
    assert [s.name for s in FeatureStore.open(store).shards] == ['part-0', 'part-1']
    assert precompute.main(['--train-data', urls, *parts, '1']) == 0  # a rerun: the store is the one it writes


def test_two_shards_that_a_store_written_before_holds_as_one_are_refused(shapes, dotted_shards, tmp_path, capsys):
    """A store of an earlier version holds a.v2.tar as 'a': a.v3.tar, today another name, would read its features."""
    store = tmp_path / 'ref'
    assert precompute.main(['--model', shapes['model'], '--train-data', dotted_shards, '--output', store,
                            '--workers', '0']) == 0
    as_written_before_shard_names(store)
    other = dotted_shards.replace('{a,b}.v2.tar', 'a.v3.tar')
    shutil.copy(dotted_shards.replace('{a,b}.v2.tar', 'a.v2.tar'), other)
    args = wds_args(shapes, {'urls': dotted_shards + '::' + other, 'ref': store}, tmp_path, 'run', '--workers', '0')
    assert f"'{other}' in --train-data have one file name" in refused_at_parsing(args, capsys)


def test_environment_variables_openclip_does_not_expand_are_refused(shapes, shards, tmp_path, monkeypatch, capsys):
    """With --train-data-upsampling-factors OpenCLIP reads the URLs as written (no ${VAR}), and waited forever for
    files named '${...}'; a variable in a variable's value that is not set is named, not a traceback."""
    monkeypatch.setenv('WDS_SHARDS', str(shards['root']))
    args = wds_args(shapes, {**shards, 'urls': '${SHARDS}/part-{0..1}.tar::${SHARDS}/part-{2..3}.tar'}, tmp_path,
                    'run', '--workers', '0', '--dataset-resampled', '--train-data-upsampling-factors', '1::1')
    assert "OpenCLIP reads the URLs of --train-data as written" in refused_at_parsing(args, capsys)
    if hasattr(webdataset.shardlists, 'envsubst'):
        monkeypatch.setenv('WDS_ROOT', '${BASE}/x')
        monkeypatch.delenv('WDS_BASE', raising=False)
        with pytest.raises(SystemExit, match="webdataset cannot expand it: missing environment variable"):
            shard_urls('${ROOT}/part-0.tar')


def test_a_shard_cut_short_gives_the_samples_training_reads_and_one_that_is_no_tar_is_named(shapes, shards, tmp_path,
                                                                                          caplog):
    """A download cut short: OpenCLIP's training reads its samples up to the cut and skips the rest with a warning,
    so the store holds those (precompute ended in tarfile's traceback); a file that is no tar at all (a failed
    download, a gzipped CSV taken for shards) stops precompute, named."""
    data = tmp_path / 'data'
    data.mkdir()
    shutil.copy(shards['root'] / 'part-0.tar', data / 'part-0.tar')
    (data / 'part-1.tar').write_bytes((shards['root'] / 'part-1.tar').read_bytes()[:30000])
    urls = str(data / 'part-{0..1}.tar')
    with caplog.at_level(logging.WARNING):
        assert precompute.main(['--model', shapes['model'], '--train-data', urls, '--output', tmp_path / 'ref',
                                '--workers', '0']) == 0
    store = FeatureStore.open(tmp_path / 'ref')
    cut = store.shard('part-1').count
    assert 0 < cut < 16 and list(store.keys('part-1')) == list(FeatureStore.open(shards['ref']).keys('part-1'))[:cut]
    assert f"'{data / 'part-1.tar'}' is cut short or corrupt after {cut} samples" in caplog.text
    args = wds_args(shapes, {'urls': urls, 'ref': tmp_path / 'ref'}, tmp_path, 'run', '--workers', '0')
    args[args.index('--epochs') + 1] = '1'
    run_openclip(args)  # every sample it reads has its features
    shutil.copy(shards['root'] / 'part-1.tar', data / 'part-1.tar')  # downloaded again, the store not written again
    args[args.index('--name') + 1] = 'whole'
    result = run_openclip(args, check=False)
    assert result.returncode != 0
    assert f"'{data / 'part-1.tar'}' is larger: downloaded again after precompute found it cut short?" in result.stderr
    assert "(a shard changed since the store was written, e.g. downloaded again?" in result.stderr
    (data / 'part-1.tar').write_bytes(b'\x1f\x8b' + bytes(600))
    with pytest.raises(SystemExit, match=f"no sample of '{data / 'part-1.tar'}' can be read"):
        precompute.main(['--model', shapes['model'], '--train-data', urls, '--output', tmp_path / 'ref2',
                         '--workers', '0'])


def test_a_shard_whose_reading_ends_early_without_an_error_is_named(tmp_path, caplog):
    """tarfile ends a stream at a damaged header or a missing end-of-archive as at the end: a download cut on a
    member's boundary, a flipped header byte and two joined tar files read as fewer samples in precompute and in
    training alike, which said nothing; now a warning names the file. Whole tar files, gzipped or not, say nothing."""
    import gzip
    import tarfile
    from open_clip_train import data as oc
    from drrho_openclip.data import shard_keys

    def write(path, prefix):
        with tarfile.open(path, 'w') as tar:
            for i in range(4):
                for extension in ('png', 'txt'):
                    member = tarfile.TarInfo(f'{prefix}{i}.{extension}')
                    member.size = 700
                    tar.addfile(member, io.BytesIO(bytes([i + 1]) * 700))
        with tarfile.open(path) as tar:
            return [member.offset for member in tar.getmembers()]

    offsets = write(tmp_path / 'whole.tar', 'a')
    write(tmp_path / 'other.tar', 'b')
    whole = (tmp_path / 'whole.tar').read_bytes()
    flipped = bytearray(whole)
    flipped[offsets[4] + 3] ^= 0x20  # a header's name: its checksum no longer matches
    (tmp_path / 'boundary.tar').write_bytes(whole[:offsets[4]])
    (tmp_path / 'flipped.tar').write_bytes(bytes(flipped))
    (tmp_path / 'joined.tar').write_bytes(whole + (tmp_path / 'other.tar').read_bytes())
    (tmp_path / 'whole.tar.gz').write_bytes(gzip.compress(whole))
    (tmp_path / 'zeros.tar').write_bytes(whole[:offsets[4]] + bytes(len(whole)))  # allocated in full, then cut
    expected = {'whole.tar': (4, None), 'whole.tar.gz': (4, None),
                'boundary.tar': (2, 'ends without the two empty blocks that end a tar file'),
                'flipped.tar': (2, f'is read up to byte {offsets[4]} of its {len(whole)}'),
                'joined.tar': (4, f'is read up to byte {offsets[-1] + 512 + 1024} of its {2 * len(whole)}, and more'),
                'zeros.tar': (2, f'is read up to byte {offsets[4]} of its {offsets[4] + len(whole)}, and zeros')}
    for name, (count, warning) in expected.items():
        url = str(tmp_path / name)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            keys = list(shard_keys(url))
        training = webdataset.DataPipeline(webdataset.SimpleShardList([url]), oc.tarfile_to_samples_nothrow,
                                           webdataset.select(oc.filter_no_caption_or_no_image))
        assert keys == [sample['__key__'] for sample in training] == [f'a{i}' for i in range(count)], name
        if warning is None:
            assert caplog.text == '', name
        else:
            assert f"'{url}' {warning}" in caplog.text and f"its {count} samples before that point" in caplog.text


def test_a_shard_that_stopped_precompute_can_be_downloaded_again_and_the_run_goes_on(shapes, shards, tmp_path):
    """A failed download (an empty file) stops precompute, named; downloaded again, the rerun goes on with the
    shards already written (the plan had recorded the empty file's size, and refused the new one as other data)."""
    data = tmp_path / 'data'
    data.mkdir()
    for s in range(4):
        shutil.copy(shards['root'] / f'part-{s}.tar', data / f'part-{s}.tar')
    (data / 'part-2.tar').write_bytes(b'')
    command = ['--model', shapes['model'], '--train-data', str(data / 'part-{0..3}.tar'), '--output',
               tmp_path / 'ref', '--workers', '0']
    with pytest.raises(SystemExit, match=f"no sample of '{data / 'part-2.tar'}' can be read"):
        precompute.main(command)
    shutil.copy(shards['root'] / 'part-2.tar', data / 'part-2.tar')
    assert precompute.main(command) == 0
    store = FeatureStore.open(tmp_path / 'ref')
    assert store.num_samples == 64 and store.shard('part-2').source_bytes == (data / 'part-2.tar').stat().st_size


def test_a_stream_that_fails_partway_stops_precompute(shapes, shards, tmp_path):
    """A pipe: or http shard whose stream fails gives the samples read before the failure, which depend on when it
    failed: stored, training read others and stopped at a sample the store lacked."""
    url = f"pipe:head -c 30000 {shards['root'] / 'part-1.tar'}; exit 3"
    with pytest.raises(SystemExit, match=r"failed after \d+ samples .*run again once it reads"):
        precompute.main(['--model', shapes['model'], '--train-data', url, '--dataset-type', 'webdataset',
                         '--output', tmp_path / 'ref', '--workers', '0'])


def test_the_data_type_is_told_as_openclip_tells_it(shapes, tmp_path, capsys):
    """--dataset-type auto: by the text after the last dot of the whole --train-data, as OpenCLIP 3.3's get_dataset_fn
    does (it took the first '::' source's, and any case, and called every other ending WebDataset shards). An ending
    OpenCLIP refuses, after building the model, stops at parsing."""
    from open_clip_train.data import get_csv_dataset, get_dataset_fn, get_wds_dataset
    from drrho_openclip.data import input_kind
    kinds = {get_csv_dataset: 'csv', get_wds_dataset: 'webdataset'}
    for data in ('train.csv', 'a/b.v2.tsv', 'part-{0..3}.tar', 'x.tsv::y.tar', 'x.tar::y.csv', 'TRAIN.CSV',
                 'pipe:aws s3 cp s3://b/part-0.tar -', 'shards/part-0', 'https://host/x.tar?download=1'):
        try:
            openclip = kinds[get_dataset_fn(data, 'auto')]
        except ValueError:
            openclip = ValueError
        try:
            ours = input_kind(data)
        except ValueError as e:
            ours = ValueError
            assert f"--train-data '{data}'" in str(e) and '--dataset-type webdataset or csv' in str(e)
        assert ours == openclip, data
    args = wds_args(shapes, {'urls': 'pipe:cat part-0.tar -', 'ref': tmp_path}, tmp_path, 'run')
    args[args.index('--dataset-type') + 1] = 'auto'
    assert "and this ends in 'tar -': give --dataset-type webdataset or csv" in refused_at_parsing(args, capsys)
