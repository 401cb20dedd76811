"""End to end through OpenCLIP's own entry point (`python -m open_clip_train.main` / torchrun) on CPU."""
import gc
import hashlib
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import open_clip
import pytest
import torch
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
from tqdm import tqdm

from conftest import (ENV, SGD, assert_equivalent_runs, assert_same, assert_same_weights, checkpoint, loss_tensors,
                      refused_at_parsing, run_openclip, start_openclip, train_args)
from drrho_openclip import precompute
from drrho_openclip.features import FeatureStore, FeatureStoreError, FeatureStoreWriter
from drrho_openclip.openclip.checkpoints import RUN_KEY, _new_run
from drrho_openclip.losses.registry import get_loss_spec, list_losses

# drrho with every kind of state it can keep: the per-sample u (γ < 1) and τ learned by its own Adam
DRRHO = ('--loss', 'drrho', '--gamma', '0.5', '--gamma-decay-epochs', '2', '--temperature-optimizer', 'loss')


@pytest.fixture(scope='session')
def drrho_run(shapes, tmp_path_factory) -> Path:
    """One epoch of `DRRHO` on the shapes, trained once per test process: the tests that resume from it copy it."""
    logs = tmp_path_factory.mktemp('drrho_run')
    run_openclip(train_args(shapes, logs, 'run', *DRRHO, '--ref-features', shapes['ref']))
    return logs / 'run'


def copy_run(run: Path, logs: Path):
    """`run` as the folder 'run' of `logs`, so that a test may change or resume its checkpoints."""
    shutil.copytree(run, logs / 'run')


def test_drrho_trains_and_saves_u_state(shapes, tmp_path):
    result = run_openclip(train_args(shapes, tmp_path, 'run', *DRRHO, '--ref-features', shapes['ref'], epochs=2))
    assert 'drrho-openclip: --loss drrho' in result.stderr + result.stdout
    ckpt = checkpoint(tmp_path, 'run', 2)
    log_u = ckpt['loss_state']['state.log_u_image']
    assert log_u.shape == (64,) and torch.isfinite(log_u).all()  # every sample visited, no overflow
    # τ, learned by the loss's Adam from 0.07, moved and is saved with the loss's state
    tau = ckpt['loss_state']['temperature.log_tau'].exp().item()
    assert tau != pytest.approx(0.07, rel=1e-3) and 0.001 <= tau <= 1.0
    # the state lives outside the model: OpenCLIP's own loader still reads the checkpoint strictly; the model's
    # logit_scale, which this loss does not read, stays frozen at its start 1/0.07
    model = open_clip.create_model(shapes['model'])
    open_clip.load_checkpoint(model, str(tmp_path / 'run' / 'checkpoints' / 'epoch_2.pt'), strict=True)
    assert torch.equal(model.logit_scale.detach(), torch.tensor(math.log(1 / 0.07)))


@pytest.mark.parametrize('other', [('--loss', 'sogclr', '--gamma', '0.5'), ('--loss', 'clip'),
                                   # the same state entries as drrho's (u, a learned τ): only the name tells
                                   ('--loss', 'sogclr', '--gamma', '0.5', '--gamma-decay-epochs', '2',
                                    '--learn-temperature')])
def test_resuming_with_another_loss_names_both(shapes, drrho_run, tmp_path, other):
    copy_run(drrho_run, tmp_path)
    first = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    digest = hashlib.sha256(first.read_bytes()).hexdigest()
    result = run_openclip(train_args(shapes, tmp_path, 'other', *other, '--resume', first, epochs=2), check=False)
    assert result.returncode != 0
    assert (f"--resume '{first}' was trained with --loss drrho, this run's is --loss {other[1]}. Train another "
            f"loss or data as a new run (another --name); OpenCLIP reads a local-dir: model's weights from its "
            f"folder, not from --pretrained") in result.stderr, result.stderr[-2000:]
    assert hashlib.sha256(first.read_bytes()).hexdigest() == digest
    assert not list((tmp_path / 'other' / 'checkpoints').glob('*.pt'))


def test_a_remote_checkpoint_is_checked_as_a_local_one(shapes, drrho_run, tmp_path):
    """--remote-sync's --resume latest is a URL, which OpenCLIP reads itself: its loss state is checked when it
    arrives (a run resumed another loss's state without a word). Here the same state entries as drrho's."""
    copy_run(drrho_run, tmp_path)
    url = (tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt').as_uri()
    result = run_openclip(train_args(shapes, tmp_path, 'other', '--loss', 'sogclr', '--gamma', '0.5',
                                     '--gamma-decay-epochs', '2', '--learn-temperature', '--resume', url, epochs=2),
                          check=False)
    assert result.returncode != 0
    assert f"--resume '{url}' was trained with --loss drrho, this run's is --loss sogclr." in result.stderr, \
        result.stderr[-2000:]
    assert not list((tmp_path / 'other' / 'checkpoints').glob('*.pt'))


def test_a_refused_resume_announces_no_change_first(shapes, drrho_run, tmp_path):
    """--gamma 1 keeps no u, so a drrho checkpoint's state does not fit: the run stops, without first warning that
    it resumes with --gamma 1."""
    copy_run(drrho_run, tmp_path)
    first = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    result = run_openclip(train_args(shapes, tmp_path, 'other', '--loss', 'drrho', '--gamma', '1', '--ref-features',
                                     shapes['ref'], '--resume', first, epochs=2), check=False)
    assert result.returncode != 0 and f"--resume '{first}' holds the loss state of another loss" in result.stderr
    assert 'resuming with' not in result.stderr


def test_a_moved_dataset_reads_its_store_and_resumes(shapes, drrho_run, tmp_path, capsys):
    """Copying the images elsewhere (a node's local disk) keeps each row's file below another folder: the store and
    the checkpoint of the same rows still apply, with a warning naming both folders; a checkpoint that recorded the
    paths as written (before 2026-11-29) resumes on them as before. A renamed CSV says a CSV's shard is its file
    name."""
    copy_run(drrho_run, tmp_path)
    first = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    lines = shapes['csv'].read_text().splitlines()
    images = [line.split('\t')[0] for line in lines[1:]]
    old_folder = Path(images[0]).parent
    (tmp_path / 'local_disk').symlink_to(old_folder, target_is_directory=True)
    moved = tmp_path / 'moved' / 'train.csv'  # the store's shard name: the CSV's file name
    moved.parent.mkdir()
    moved.write_text(shapes['csv'].read_text().replace(str(old_folder), str(tmp_path / 'local_disk')))
    args = train_args(shapes, tmp_path, 'resumed', *DRRHO, '--ref-features', shapes['ref'], '--resume', first,
                      epochs=2)
    args[args.index('--train-data') + 1] = moved
    result = run_openclip(args)
    assert (f"the images of '{moved}' are below '{tmp_path / 'local_disk'}', where '{shapes['ref']}' was written for "
            f"them below '{old_folder}': the same files in the same order, read as a moved dataset") in result.stderr
    assert 'rows are other samples' not in result.stderr
    assert (tmp_path / 'resumed' / 'checkpoints' / 'epoch_2.pt').exists()
    assert precompute.main(['verify', str(shapes['ref']), '--train-data', str(moved)]) == 0
    assert f"the same files below '{tmp_path / 'local_disk'}' (written below '{old_folder}': a moved dataset" in \
        capsys.readouterr().out

    saved = torch.load(first, map_location='cpu', weights_only=False)
    saved['loss_state'][RUN_KEY]['samples'] = hashlib.sha256(''.join(f'{p}\0' for p in images).encode()).hexdigest()
    torch.save(saved, first)
    run_openclip(train_args(shapes, tmp_path, 'as_written', *DRRHO, '--ref-features', shapes['ref'], '--resume',
                            first, epochs=2))

    renamed = tmp_path / 'renamed.csv'
    renamed.write_text(shapes['csv'].read_text())
    args = train_args(shapes, tmp_path, 'renamed', *DRRHO, '--ref-features', shapes['ref'])
    args[args.index('--train-data') + 1] = renamed
    result = run_openclip(args, check=False)
    assert result.returncode != 0
    assert f"has no shard 'renamed', the file name of '{renamed}' (a CSV's shard is named after its file" in \
        result.stderr, result.stderr[-2000:]


def test_the_advice_after_a_refused_resume_is_one_that_can_work(tmp_path):
    """--pretrained loads a checkpoint's weights into a hub or built-in model, strictly: not into a local-dir:
    model (OpenCLIP ignores it there), nor a model trained with TempNet's networks attached."""
    plain = {'visual.proj': torch.zeros(1)}  # a checkpoint's model weights, without DDP's 'module.'
    tempnet = {**plain, 'loss_temperature.w': torch.zeros(1)}
    args = SimpleNamespace(model='ViT-B-32', resume='run/epoch_1.pt')
    assert _new_run(args, plain).endswith("; --pretrained 'run/epoch_1.pt' starts it from those weights")
    assert _new_run(args, tempnet).endswith(
        "; its model also holds TempNet's networks, which --pretrained does not load")
    local = SimpleNamespace(model='local-dir:m', resume='run/epoch_1.pt')
    assert 'from its folder, not from --pretrained' in _new_run(local, plain)


def test_a_plain_clip_checkpoint_is_named_and_the_advice_to_start_from_it_works(shapes, tmp_path):
    """OpenCLIP's own --loss clip keeps no loss state: resuming it with a stateful loss says so, and its advice for
    a local-dir: model (the checkpoint in a copy of the folder) gives a model with the checkpoint's weights."""
    import shutil
    run_openclip(train_args(shapes, tmp_path, 'clip', '--loss', 'clip'))
    first = tmp_path / 'clip' / 'checkpoints' / 'epoch_1.pt'
    result = run_openclip(train_args(shapes, tmp_path, 'other', '--loss', 'sogclr', '--resume', first, epochs=2),
                          check=False)
    assert result.returncode != 0
    assert (f"--resume '{first}' holds no loss state (a run of OpenCLIP's own --loss clip, or of a loss without "
            f"per-sample state), which this run's --loss sogclr keeps") in result.stderr, result.stderr[-2000:]
    assert "put the checkpoint in the copy as open_clip_pytorch_model.bin" in result.stderr
    # the model's weights alone, which OpenCLIP's --resume loads to start a new run: no loss state is read or needed
    weights = tmp_path / 'weights.pt'
    torch.save(torch.load(first, map_location='cpu', weights_only=False)['state_dict'], weights)
    result = run_openclip(train_args(shapes, tmp_path, 'from_weights', '--loss', 'sogclr', '--resume', weights))
    assert "holds a model's weights only (no epoch): OpenCLIP starts a new run from them" in result.stderr
    assert checkpoint(tmp_path, 'from_weights', 1)['epoch'] == 1
    # saved from a DDP model: OpenCLIP loads weights alone as written, so one process cannot read them
    prefixed = tmp_path / 'ddp_weights.pt'
    torch.save({f'module.{k}': v for k, v in torch.load(weights, weights_only=True).items()}, prefixed)
    result = run_openclip(train_args(shapes, tmp_path, 'from_ddp', '--loss', 'sogclr', '--resume', prefixed),
                          check=False)
    assert result.returncode != 0 and (f"--resume '{prefixed}' holds a model's weights alone, with DDP's 'module.' "
                                       f"prefix, which OpenCLIP loads into this run's model as written, and fails. "
                                       f"OpenCLIP reads a local-dir: model's weights from its folder") in result.stderr
    copy = tmp_path / 'tiny_from_clip'
    shutil.copytree(shapes['model'].removeprefix('local-dir:'), copy)
    shutil.copy(first, copy / 'open_clip_pytorch_model.bin')
    started = open_clip.create_model(f'local-dir:{copy}').state_dict()
    trained = torch.load(first, map_location='cpu', weights_only=False)['state_dict']
    assert started.keys() == trained.keys()
    assert all(torch.equal(started[k], trained[k]) for k in trained)


def test_distillation_can_be_added_or_dropped_on_resume_whatever_its_teacher_scale(shapes, tmp_path):
    """KD's 'auto' teacher scale is chosen on the first batch, no state of the samples: adding KD to a run chooses it
    then, dropping KD leaves it; both resumed only where the scale was a given number."""
    kd = ('--loss', 'clip', '--distill-weight', '0.5', '--ref-features', shapes['ref'])
    run_openclip(train_args(shapes, tmp_path, 'plain', '--loss', 'clip'))
    added = run_openclip(train_args(shapes, tmp_path, 'kd', *kd, '--resume',
                                    tmp_path / 'plain' / 'checkpoints' / 'epoch_1.pt', epochs=2))
    assert 1 < checkpoint(tmp_path, 'kd', 2)['loss_state']['teacher_logit_scale.value'] < 100, added.stderr[-2000:]
    dropped = run_openclip(train_args(shapes, tmp_path, 'dropped', '--loss', 'clip', '--resume',
                                      tmp_path / 'kd' / 'checkpoints' / 'epoch_2.pt', epochs=3))
    assert checkpoint(tmp_path, 'dropped', 3)['epoch'] == 3
    # a change of options, said as one; clip keeps no per-sample state for the reference to have shifted
    assert 'resuming with --distill-weight 0.5 -> 0' in dropped.stderr, dropped.stderr[-2000:]
    assert 'per-sample state' not in dropped.stderr


def test_a_checkpoint_without_the_run_it_records_names_the_state_that_differs(shapes, drrho_run, tmp_path):
    """Checkpoints written before they recorded their run: the loss state's entries tell another loss."""
    copy_run(drrho_run, tmp_path)
    first = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    saved = torch.load(first, weights_only=False)
    del saved['loss_state'][RUN_KEY]
    torch.save(saved, first)
    result = run_openclip(train_args(shapes, tmp_path, 'other', '--loss', 'sogclr', '--gamma', '0.5', '--resume',
                                     first, epochs=2), check=False)
    assert result.returncode != 0
    assert (f"--resume '{first}' holds the loss state of another loss or other flags than this run's --loss "
            f"sogclr (differing: temperature.exp_avg") in result.stderr, result.stderr[-2000:]


def test_resuming_onto_other_samples_stops_and_other_settings_are_named(shapes, drrho_run, tmp_path):
    """The per-sample state's rows are the CSV's rows: the same rows in another order would give each sample
    another's u. Another reference model or other options resume, with a warning naming them."""
    copy_run(drrho_run, tmp_path)
    first = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    lines = shapes['csv'].read_text().splitlines()
    store = FeatureStore.open(shapes['ref'])
    features = store.shard_features('train')  # [n, 2, d]

    def write_store(root, model, order):
        writer = FeatureStoreWriter(root, model=model, pretrained='', dim=store.dim)
        writer.add_shard('train', [lines[1:][i].split('\t')[0] for i in order], features[order, 0],
                         features[order, 1])
        writer.close()

    reordered = tmp_path / 'reordered' / 'train.csv'  # with its own store, so that the store's row check passes
    reordered.parent.mkdir()
    reordered.write_text('\n'.join([lines[0]] + lines[1:][::-1]) + '\n')
    write_store(tmp_path / 'reordered_ref', 'test', list(range(len(lines) - 1))[::-1])
    args = train_args(shapes, tmp_path, 'other', *DRRHO, '--ref-features', tmp_path / 'reordered_ref', '--resume',
                      first, epochs=2)
    args[args.index('--train-data') + 1] = reordered
    result = run_openclip(args, check=False)
    assert result.returncode != 0
    assert (f"--resume '{first}' holds per-sample state whose rows are other samples than this run's"
            in result.stderr), result.stderr[-2000:]
    assert not list((tmp_path / 'other' / 'checkpoints').glob('*.pt'))

    write_store(tmp_path / 'another_ref', 'another', list(range(len(lines) - 1)))
    result = run_openclip(train_args(shapes, tmp_path, 'run', *DRRHO, '--reference-weight', '1', '--ref-features',
                                     tmp_path / 'another_ref', '--resume', 'latest', batch_size=16, epochs=2))
    log = result.stdout + result.stderr
    assert (f"--resume '{first}' was trained with --ref-features of test, dim 16, this run reads --ref-features "
            f"of another, dim 16") in log, log[-3000:]
    assert (f"--resume '{first}' was trained with other --loss drrho options; resuming with --reference-weight "
            f"0.25 -> 1.0") in log
    assert (f"--resume '{first}' was trained at global batch 8, this run's is 16 (--batch-size × --accum-freq × "
            f"processes)") in log
    assert checkpoint(tmp_path, 'run', 2)['loss_state'][RUN_KEY]['options']['reference_weight'] == 1.0


@pytest.mark.parametrize('loss, options, restored', [
    ('drrho', dict(learn_temperature=True), True),   # log τ is the loss's state
    ('isogclr', dict(), True),                       # the per-sample τ's are its tables
    ('balanced', dict(learn_temperature=True), True),  # the model's logit_scale
    ('sogclr', dict(learn_temperature=False), False),  # a fixed τ is this run's flag
])
def test_a_changed_start_of_a_learned_temperature_is_said_not_to_apply(caplog, loss, options, restored):
    from drrho_openclip.openclip import checkpoints
    saved = {'options': dict(options, temperature=0.07)}
    run = SimpleNamespace(loss_name=loss, provenance={'options': dict(options, temperature=0.03)})
    with caplog.at_level('WARNING'):
        checkpoints._warn_of_changes(saved, run, SimpleNamespace(resume='epoch_1.pt', epochs=None), False)
    assert 'resuming with --temperature 0.07 -> 0.03' in caplog.text
    assert ("a learned τ resumes from the checkpoint's, so --temperature, the start of a new run, does not apply"
            in caplog.text) is restored


def test_no_u_table_when_gamma_stays_one(shapes, tmp_path):
    # with a fixed τ too there is nothing to save (a learned τ's three buffers would be the loss's state)
    run_openclip(train_args(shapes, tmp_path, 'run', '--loss', 'drrho', '--gamma', '1', '--no-learn-temperature',
                            '--ref-features', shapes['ref']))
    assert set(checkpoint(tmp_path, 'run', 1)['loss_state']) == {RUN_KEY}  # the run it records, no state


def loss_args(shapes, name):
    """Command-line flags of a stateful configuration of each loss (γ < 1 from epoch 1 on, JEST's selection count)."""
    ref = ('--ref-features', shapes['ref'])
    return {
        'drrho': (*DRRHO, *ref),
        'drrho-no-column': (*DRRHO, '--no-column-step', *ref),  # the DRO without the column step (the paper's)
        'sogclr': ('--loss', 'sogclr', '--gamma', '0.5'),
        'fastclip+kd': ('--loss', 'fastclip', '--gamma', '0.5', '--distill-weight', '0.25', *ref),
        'isogclr': ('--loss', 'isogclr', '--gamma', '0.5', '--lr-tau', '0.01'),
        'tempnet': ('--loss', 'tempnet', '--gamma', '0.5', '--tempnet-width', '16', '--tempnet-prototypes', '8'),
        'jest': ('--loss', 'jest', '--selection-ratio', '0.5', *ref),  # random draws, whose count is its state
    }[name]


def test_a_checkpoint_is_evaluated_without_training_data(shapes, tmp_path):
    """--val-data with --resume and no --train-data only evaluates: OpenCLIP reads no loss state, and a stateful
    loss has no training data to size its state by (it crashed reading the CSV of --train-data, None); a TempNet
    checkpoint's model holds the modules its loss attached, which a plain --loss clip model lacks."""
    def evaluate(name, checkpoint_file, *loss, check=True):
        args = train_args(shapes, tmp_path, name, '--resume', checkpoint_file, *loss)
        args[args.index('--train-data')] = '--val-data'
        return run_openclip(args, check=check)
    for name in ('sogclr', 'tempnet'):
        run_openclip(train_args(shapes, tmp_path, name, *loss_args(shapes, name)))
        saved = tmp_path / name / 'checkpoints' / 'epoch_1.pt'
        result = evaluate(f'{name}_eval', saved, *loss_args(shapes, name))
        assert 'image_to_text_R@1' in result.stdout + result.stderr
    result = evaluate('plain', tmp_path / 'sogclr' / 'checkpoints' / 'epoch_1.pt')  # its loss state is not read
    assert 'image_to_text_R@1' in result.stdout + result.stderr
    for name, loss in (('tempnet_plain', ()), ('tempnet_as_sogclr', loss_args(shapes, 'sogclr'))):
        result = evaluate(name, tmp_path / 'tempnet' / 'checkpoints' / 'epoch_1.pt', *loss, check=False)
        assert result.returncode != 0 and ("holds the model of a loss that attached loss_temperature to it (TempNet's: "
                                           "--loss tempnet)") in result.stderr
    # evaluating calls no loss: a loss that trains with reference features evaluates without them
    result = evaluate('as_drrho', tmp_path / 'sogclr' / 'checkpoints' / 'epoch_1.pt', '--loss', 'drrho')
    assert 'image_to_text_R@1' in result.stdout + result.stderr
    # TempNet's networks of another size: named before the model's strict load fails on them
    tempnet = tmp_path / 'tempnet' / 'checkpoints' / 'epoch_1.pt'
    wider = [*loss_args(shapes, 'tempnet')]
    wider[wider.index('--tempnet-width') + 1] = '32'
    result = evaluate('tempnet_wider', tempnet, *wider, check=False)
    assert result.returncode != 0 and f"--resume '{tempnet}' holds loss_temperature." in result.stderr
    assert "give the --tempnet-width and --tempnet-prototypes it was trained with" in result.stderr


@pytest.mark.parametrize('name', ['drrho', 'isogclr', 'tempnet', 'jest'])
def test_killed_run_resumes_exactly(shapes, tmp_path, name):
    # one with timm's augmentation, which draws from Python's and numpy's generators (it resumed to other images)
    augmentation = ('--aug-cfg', 'use_timm=True') if name == 'drrho' else ()
    args = lambda run, *extra: train_args(shapes, tmp_path, run, *loss_args(shapes, name), *augmentation, *extra,
                                          epochs=2)
    run_openclip(args('full'))
    # the same run, killed once epoch 1 is saved, then continued with --resume latest
    process = start_openclip(args('split'), tmp_path / 'split_output')
    first, second = (tmp_path / 'split' / 'checkpoints' / f'epoch_{e}.pt' for e in (1, 2))
    while not first.exists() and process.poll() is None:  # however long the machine takes
        time.sleep(0.05)
    process.kill()
    process.wait()
    assert first.exists()
    second.unlink(missing_ok=True)  # had it got that far, resume from epoch 1 all the same
    run_openclip(args('split', '--resume', 'latest'))
    a, b = checkpoint(tmp_path, 'full', 2), checkpoint(tmp_path, 'split', 2)
    a_state, b_state = loss_tensors(a), loss_tensors(b)
    assert a_state.keys() == b_state.keys()
    assert_same_weights(a, b)  # TempNet's parameters included
    epoch_1 = checkpoint(tmp_path, 'full', 1)['state_dict']  # and the second epoch trained: resumed, not restored
    assert any(not torch.equal(value, epoch_1[key]) for key, value in a['state_dict'].items())
    for key in a_state:  # u, and isogclr's τ tables and their Adam moments
        assert_same(a_state[key], b_state[key])
    assert a['loss_state'][RUN_KEY] == b['loss_state'][RUN_KEY]


@pytest.mark.parametrize('name', ['drrho', 'drrho-no-column', 'sogclr', 'fastclip+kd', 'isogclr', 'tempnet'])
def test_two_ranks_equal_one_rank_with_same_global_batch(shapes, tmp_path, name):
    loss = loss_args(shapes, name)
    run_openclip(train_args(shapes, tmp_path, 'one', *loss, *SGD, batch_size=8, epochs=2))
    two = run_openclip(train_args(shapes, tmp_path, 'two', *loss, *SGD, '--local-loss', '--gather-with-grad',
                                  batch_size=4, epochs=2), nproc=2)
    one = checkpoint(tmp_path, 'one', 2)
    assert_equivalent_runs(one, checkpoint(tmp_path, 'two', 2), prefix='module.')
    assert_training_moved(checkpoint(tmp_path, 'one', 1), one)
    # both processes log (OpenCLIP's line for each), the plugin's lines about the whole run come once, not per rank
    log = two.stdout + two.stderr
    assert all(f"Process (global: {rank}, local {rank}), total 2" in log for rank in (0, 1))
    assert log.count(f"drrho-openclip: --loss {loss[loss.index('--loss') + 1]} (") == 1


def test_resuming_a_finished_run_says_it_trains_nothing(shapes, tmp_path):
    """OpenCLIP ends without a word when the checkpoint is at the last epoch: a variant launched under the run's
    --name (the launch scripts' fixed NAME) would seem to have trained."""
    args = train_args(shapes, tmp_path, 'run', '--loss', 'sogclr', epochs=1)
    run_openclip(args)
    first = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    again = [*args, '--resume', first]
    again[again.index('--name') + 1] = 'again'
    result = run_openclip(again)
    assert (f"--resume '{first}' is at epoch 1 of --epochs 1: the run is complete and trains nothing more"
            in result.stdout + result.stderr)
    assert not (tmp_path / 'again' / 'checkpoints' / 'epoch_2.pt').exists()
    again[again.index('--epochs') + 1] = '2'  # extended: trains on, its schedules stretched, which it says
    again[again.index('--name') + 1] = 'longer'
    result = run_openclip(again)
    assert (f"--resume '{first}' was trained with --epochs 1, this run's is 2: the schedules that follow the run's "
            f"length start over at its new length") in result.stdout + result.stderr
    assert (tmp_path / 'longer' / 'checkpoints' / 'epoch_2.pt').exists()


def test_resume_latest_takes_the_newest_complete_checkpoint_over_what_openclip_picks(shapes, tmp_path):
    """OpenCLIP's --resume latest with --save-most-recent is epoch_latest.pt, an epoch behind epoch_N.pt when a save
    was killed while writing it (through tmp.pt), and none once it is gone (the run then started from scratch over
    the epochs there); without --save-most-recent, the last *.pt by name: a tmp.pt, or a stale epoch_latest.pt before
    later epochs. Each was refused, or trained over good epochs; the run now resumes from its newest whole file."""
    args = train_args(shapes, tmp_path, 'run', '--loss', 'sogclr', '--save-most-recent', '--resume', 'latest',
                      epochs=2)
    run_openclip(args)
    folder = tmp_path / 'run' / 'checkpoints'
    digest = hashlib.sha256((folder / 'epoch_2.pt').read_bytes()).hexdigest()
    # killed while saving epoch 2's epoch_latest.pt: epoch_2.pt written, epoch_latest.pt still epoch 1's
    (folder / 'epoch_latest.pt').write_bytes((folder / 'epoch_1.pt').read_bytes())
    (folder / 'tmp.pt').write_bytes(b'half a checkpoint')
    again = [*args]
    again[again.index('--epochs') + 1] = '3'
    for without in ((), ('--save-most-recent',)):
        result = run_openclip([a for a in again if a not in without])
        assert (f"--resume latest resumes from '{folder / 'epoch_2.pt'}', the newest complete checkpoint of the run, "
                f"where OpenCLIP picked '{folder / ('epoch_latest.pt' if not without else 'tmp.pt')}'") in \
            result.stderr, result.stderr[-2000:]
        assert checkpoint(tmp_path, 'run', 3)['epoch'] == 3
        assert hashlib.sha256((folder / 'epoch_2.pt').read_bytes()).hexdigest() == digest
        (folder / 'epoch_3.pt').unlink()
        (folder / 'epoch_latest.pt').write_bytes((folder / 'epoch_1.pt').read_bytes())
        (folder / 'tmp.pt').write_bytes(b'half a checkpoint')  # the finished save renamed the last one
    # --save-most-recent and no epoch_latest.pt: from epoch_2.pt, not from scratch over it
    (folder / 'epoch_latest.pt').unlink()
    result = run_openclip(again)
    assert "where OpenCLIP picked none" in result.stderr and checkpoint(tmp_path, 'run', 3)['epoch'] == 3
    assert hashlib.sha256((folder / 'epoch_2.pt').read_bytes()).hexdigest() == digest
    # a killed first save and nothing else: a start from scratch (it was torch's traceback)
    fresh = tmp_path / 'fresh' / 'checkpoints'
    fresh.mkdir(parents=True)
    (fresh / 'tmp.pt').write_bytes(b'half a checkpoint')
    result = run_openclip(train_args(shapes, tmp_path, 'fresh', '--loss', 'sogclr', '--resume', 'latest'))
    assert '--resume latest starts from scratch: the run has no complete checkpoint' in result.stderr
    assert checkpoint(tmp_path, 'fresh', 1)['epoch'] == 1


def test_the_resumed_checkpoint_is_not_kept_beside_the_model_and_the_loss(shapes, tmp_path):
    """The checkpoint's copy of the per-sample tables is dropped once the loss holds them, and of the model's weights
    once they are loaded: they stayed in host memory for the whole run (the per-sample tables: 8 bytes a sample for
    u, 32 for isogclr's, on every rank). The optimizer keeps the tensors of its state it loads, in use."""
    run_openclip(train_args(shapes, tmp_path, 'run', *loss_args(shapes, 'isogclr'), epochs=1))
    watch = ("import gc, runpy, sys, weakref\n"
             "import torch\n"
             "from drrho_openclip.openclip import checkpoints\n"
             "from open_clip_train import file_utils\n"
             "from torch.utils._pytree import tree_leaves\n"
             "load, resolve = file_utils.pt_load, checkpoints.resolve_loss_state\n"
             "save, resumed = checkpoints.checkpoint_loss_state, []\n"
             "def watch(tree):\n"
             "    resumed.extend(weakref.ref(v) for v in tree_leaves(tree) if isinstance(v, torch.Tensor))\n"
             "    return tree\n"
             "def load_and_watch(*args, **kwargs):\n"
             "    checkpoint = load(*args, **kwargs)\n"
             "    watch(checkpoint['state_dict'])  # the model's weights\n"
             "    return checkpoint\n"
             "file_utils.pt_load = load_and_watch\n"
             "checkpoints.resolve_loss_state = lambda run, loss, state, args: resolve(run, loss, watch(state), args)\n"
             "def save_and_count(run, loss, state, *rest):\n"
             "    gc.collect()\n"
             "    print('resumed tensors alive:', sum(r() is not None for r in resumed), 'of', len(resumed))\n"
             "    return save(run, loss, state, *rest)\n"
             "checkpoints.checkpoint_loss_state = save_and_count\n"
             "sys.argv = ['main'] + sys.argv[1:]\n"
             "runpy.run_module('open_clip_train.main', run_name='__main__')\n")
    args = train_args(shapes, tmp_path, 'run', *loss_args(shapes, 'isogclr'), '--resume', 'latest', epochs=2)
    result = subprocess.run([sys.executable, '-c', watch, *map(str, args)], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    alive = re.search(r'resumed tensors alive: (\d+) of (\d+)', result.stdout)
    assert alive and int(alive.group(2)) > 0 and alive.group(1) == '0', result.stdout[-2000:]


def test_a_one_process_checkpoint_resumes_on_two_ranks(shapes, tmp_path):
    """Epoch 1 in one process, epoch 2 on two ranks with the same global batch: the model and the per-sample state
    end as in the one-process run (OpenCLIP 3.3.0's ranks stopped at loading a checkpoint without DDP's prefix)."""
    loss = [*DRRHO, '--ref-features', shapes['ref'], *SGD]
    run_openclip(train_args(shapes, tmp_path, 'one', *loss, batch_size=8, epochs=2))
    first = tmp_path / 'one' / 'checkpoints' / 'epoch_1.pt'
    run_openclip(train_args(shapes, tmp_path, 'two', *loss, '--local-loss', '--gather-with-grad', '--resume', first,
                            batch_size=4, epochs=2), nproc=2)
    assert_equivalent_runs(checkpoint(tmp_path, 'one', 2), checkpoint(tmp_path, 'two', 2), prefix='module.')
    assert_training_moved(checkpoint(tmp_path, 'one', 1), checkpoint(tmp_path, 'one', 2))


def test_gradient_accumulation_equals_the_large_batch(shapes, tmp_path):
    loss = [*DRRHO, '--ref-features', shapes['ref'], *SGD]
    run_openclip(train_args(shapes, tmp_path, 'big', *loss, batch_size=8, epochs=2))
    run_openclip(train_args(shapes, tmp_path, 'accum', *loss, '--accum-freq', '2', batch_size=4, epochs=2))
    assert_equivalent_runs(checkpoint(tmp_path, 'big', 2), checkpoint(tmp_path, 'accum', 2))


@pytest.mark.parametrize('name', ['tempnet', 'balanced', 'drrho-default', 'clip+kd'])
def test_two_ranks_accumulating_gradients_equal_one_rank_with_the_large_batch(shapes, tmp_path, name):
    """The losses whose τ is a model parameter (TempNet's weights, the model's logit_scale): a later call of an
    accumulation window takes τ as the first call's constant, yet under DDP the parameter must still take part in
    its backward (the runs stopped at their second step). drrho's default is one: its τ the model's logit_scale, and
    its ε 1/(B − 1) of the global batch, the window's."""
    ref = ('--ref-features', shapes['ref'])
    loss = {'tempnet': loss_args(shapes, 'tempnet'),
            'balanced': ('--loss', 'balanced'),
            'drrho-default': ('--loss', 'drrho', *ref),
            'clip+kd': ('--loss', 'clip', '--distill-weight', '0.5', *ref)}[name]
    run_openclip(train_args(shapes, tmp_path, 'one', *loss, *SGD, batch_size=8, epochs=2))
    run_openclip(train_args(shapes, tmp_path, 'two', *loss, *SGD, '--local-loss', '--gather-with-grad',
                            '--accum-freq', '2', batch_size=2, epochs=2), nproc=2)
    one = checkpoint(tmp_path, 'one', 2)
    # balanced: each of its k Sinkhorn half-steps normalises by sums that two ranks add in another order, and the
    # float32 rounding it amplifies reaches 2·10⁻⁵ in a few weights (its float64 test holds two ranks to one at
    # 1e-9, test_losses_distributed); a rank's missing or doubled share would move weights by the training's 10⁻³
    atol = 3e-5 if name == 'balanced' else 1e-5
    assert_equivalent_runs(one, checkpoint(tmp_path, 'two', 2), prefix='module.', atol=atol)
    assert_training_moved(checkpoint(tmp_path, 'one', 1), one)


def assert_training_moved(before, after):
    """Guards the equivalence tests against runs that agree only because nothing was learnt."""
    change = max((after['state_dict'][k] - before['state_dict'][k]).abs().max().item() for k in after['state_dict'])
    assert change > 1e-3


def test_tiled_core_trains_like_the_untiled_one(shapes, tmp_path):
    loss = [*DRRHO, '--ref-features', shapes['ref'], *SGD]
    run_openclip(train_args(shapes, tmp_path, 'untiled', *loss, batch_size=8, epochs=2))
    run_openclip(train_args(shapes, tmp_path, 'tiled', *loss, '--tile-size', '3', batch_size=8, epochs=2))
    assert_equivalent_runs(checkpoint(tmp_path, 'untiled', 2), checkpoint(tmp_path, 'tiled', 2))


@pytest.mark.parametrize('name, extra', [*((name, ()) for name in list_losses()), ('drrho', ('--tile-size', '3')),
                                          ('drrho', ('--no-column-step', '--tile-size', '3'))])
def test_every_loss_trains_under_bf16_autocast(shapes, tmp_path, name, extra):
    # --precision amp_bf16, the launch scripts' default: the model hands the loss bf16 features under autocast;
    # the per-sample state, τ and weights must come out finite after two epochs (epoch 1 reads the state back)
    ref = ('--ref-features', shapes['ref']) if get_loss_spec(name).reference == 'required' else ()
    run_openclip(train_args(shapes, tmp_path, 'bf16', '--loss', name, *ref, *extra, '--precision', 'amp_bf16',
                            epochs=2))
    saved = checkpoint(tmp_path, 'bf16', 2)
    tensors = {**saved['state_dict'], **loss_tensors(saved)}
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


@pytest.mark.parametrize('precision', ['fp32', 'pure_bf16'])
def test_online_reference_model_runs(shapes, tmp_path, precision):
    # pure_bf16: the loop hands the reference bf16 images, which a float32 reference could not read
    run_openclip(train_args(shapes, tmp_path, 'online', '--loss', 'drrho', '--ref-model', shapes['model'],
                            '--precision', precision))
    assert checkpoint(tmp_path, 'online', 1)['epoch'] == 1


# ---- bad input: a clear error, a non-zero exit, nothing good overwritten


def test_unknown_loss_lists_the_known_ones(shapes, tmp_path, capsys):
    said = refused_at_parsing(train_args(shapes, tmp_path, 'x', '--loss', 'nope'), capsys)
    assert "invalid choice: 'nope'" in said and 'drrho' in said and 'sogclr' in said


def test_drrho_without_reference_features_fails(shapes, tmp_path, capsys):
    said = refused_at_parsing(train_args(shapes, tmp_path, 'x', '--loss', 'drrho'), capsys)
    assert 'needs reference features' in said


def test_missing_reference_directory_is_named(shapes, tmp_path, capsys):
    missing = tmp_path / 'nowhere'
    assert str(missing) in refused_at_parsing(train_args(shapes, tmp_path, 'x', '--loss', 'drrho', '--ref-features',
                                                         missing), capsys)


def test_features_of_another_csv_are_rejected(shapes, tmp_path, capsys):
    other = tmp_path / 'train.csv'  # same shard name, rows in another order
    lines = shapes['csv'].read_text().splitlines()
    other.write_text('\n'.join([lines[0]] + lines[1:][::-1]) + '\n')
    args = train_args(shapes, tmp_path, 'x', '--loss', 'drrho', '--ref-features', shapes['ref'])
    args[args.index('--train-data') + 1] = other
    said = refused_at_parsing(args, capsys)
    assert 'computed for another CSV: row 0' in said and '--ref-features was not written for --train-data' in said


def test_a_store_of_other_captions_stops_training_and_fails_verify(shapes, tmp_path, capsys):
    """A CSV's store is keyed by image paths; its text features are of the captions it was written from, which
    another --csv-caption-key (or an edited file) would change under the same paths."""
    store = str(tmp_path / 'ref')
    data = ['--train-data', str(shapes['csv']), '--csv-separator', '\t', '--csv-img-key', 'filepath']
    assert precompute.main(['--model', shapes['model'], *data, '--csv-caption-key', 'title', '--output', store,
                            '--batch-size', '16', '--workers', '0']) == 0
    assert precompute.verify([store, *data, '--csv-caption-key', 'title']) == 0
    assert precompute.verify([store, *data, '--csv-caption-key', 'label']) == 1
    assert ("PROBLEM: shard 'train' was written from other captions than column 'label' of "
            f"'{shapes['csv']}' holds") in capsys.readouterr().out
    # a store that records none (written before stores did) passes, saying that its captions went unchecked
    assert precompute.verify([str(shapes['ref']), *data, '--csv-caption-key', 'label']) == 0
    assert "WARNING: shard 'train' records no captions" in capsys.readouterr().out
    args = train_args(shapes, tmp_path, 'x', *DRRHO, '--ref-features', store)
    args[args.index('--csv-caption-key') + 1] = 'label'
    assert ("--ref-features was not written for --train-data: shard 'train' was written from other captions than "
            "column 'label'") in refused_at_parsing(args, capsys)


@pytest.mark.parametrize('writer', ['precompute', 'import'])
def test_a_relative_csv_read_from_another_folder_is_not_given_the_stores_features(shapes, tmp_path, monkeypatch,
                                                                                  writer):
    """A CSV's image paths relative to the working directory: the same CSV run from another folder names other
    image files by the same paths, which the store's keys (the paths as written) cannot tell; it recorded the sizes
    of some of them, whether computed or imported. A dataset moved with the store, the same files, trains."""
    import shutil
    lines = shapes['csv'].read_text().splitlines()
    rows = [line.split('\t') for line in lines[1:]]
    for folder, order in (('written', rows), ('other', rows[1:] + rows[:1])):  # the other folder: others' images
        (tmp_path / folder / 'img').mkdir(parents=True)
        for (path, *_), (source, *_) in zip(rows, order):
            shutil.copy(source, tmp_path / folder / 'img' / Path(path).name)
        (tmp_path / folder / 'rel.csv').write_text('\n'.join(
            [lines[0]] + ['\t'.join([f'img/{Path(path).name}', *rest]) for path, *rest in rows]) + '\n')
    store = tmp_path / 'ref'
    monkeypatch.chdir(tmp_path / 'written')
    data = ['--train-data', 'rel.csv', '--csv-separator', '\t', '--csv-img-key', 'filepath', '--csv-caption-key',
            'title', '--output', store]
    if writer == 'precompute':
        assert precompute.main(['--model', shapes['model'], *data, '--batch-size', '16', '--workers', '0']) == 0
    else:
        features = np.random.default_rng(0).normal(size=(2, len(rows), 16))
        features /= np.linalg.norm(features, axis=-1, keepdims=True)
        np.savez(tmp_path / 'rel.npz', image_features=features[0], text_features=features[1])
        assert precompute.main(['import', tmp_path / 'rel.npz', *data]) == 0
    args = train_args(shapes, tmp_path, 'x', *DRRHO, '--ref-features', store)
    args[args.index('--train-data') + 1] = 'rel.csv'
    result = run_openclip(args, check=False, cwd=tmp_path / 'other')
    assert result.returncode == 2 and (
        "--ref-features was not written for --train-data: row 0 (from 0, the header not counted) of 'rel.csv' "
        "names 'img/") in result.stderr, \
        result.stderr[-2000:]
    assert f"(a relative path is read from the working directory, here '{tmp_path / 'other'}')" in result.stderr
    shutil.copytree(tmp_path / 'written', tmp_path / 'moved')  # the same files elsewhere: trains
    run_openclip(args, cwd=tmp_path / 'moved')


def test_a_csv_of_several_captions_per_image_gets_a_store_and_trains(shapes, tmp_path, capsys):
    """COCO and Flickr30k give each image several captions: a CSV repeats its path, and the store (whose CSV keys are
    the image paths, row by row: the row is the index) repeats it too."""
    lines = shapes['csv'].read_text().splitlines()
    rows = [r.split('\t') for r in lines[1:17]]
    coco = tmp_path / 'coco.csv'
    coco.write_text('\n'.join([lines[0]] + [f'{p}\t{t}{variant}\t{c}' for p, t, c in rows
                                             for variant in ('', ', again')]) + '\n')
    store = tmp_path / 'coco_ref'
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'],
                             '--train-data', str(coco), '--output', str(store), '--workers', '0'],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert precompute.main(['verify', str(store), '--train-data', str(coco)]) == 0
    assert 'coco: 32 samples, keys repeated (image paths of several rows)' in capsys.readouterr().out
    # without the CSV too: the store records its captions, so its shard is a CSV's
    assert precompute.main(['verify', str(store)]) == 0
    assert 'coco: 32 samples, keys repeated (image paths of several rows)' in capsys.readouterr().out
    # a CSV's rows are compared in order, as training's start-up check does: the same rows reversed do not match
    reversed_rows = tmp_path / 'reversed' / 'coco.csv'
    reversed_rows.parent.mkdir()
    text = coco.read_text().splitlines()
    reversed_rows.write_text('\n'.join([text[0]] + text[1:][::-1]) + '\n')
    assert precompute.main(['verify', str(store), '--train-data', str(reversed_rows)]) == 1
    assert "file 'coco.keys.npy': row 0 is '" in capsys.readouterr().out
    args = train_args(shapes, tmp_path, 'run', *DRRHO, '--ref-features', store)
    args[args.index('--train-data') + 1] = coco
    run_openclip(args)
    assert torch.isfinite(checkpoint(tmp_path, 'run', 1)['loss_state']['state.log_u_image']).all()


def test_training_names_what_is_wrong_with_a_csv(shapes, tmp_path, capsys):
    """A comma-separated CSV read with OpenCLIP's default tab: pandas' "Usecols do not match columns" said it."""
    lines = shapes['csv'].read_text().splitlines()
    comma = tmp_path / 'comma.csv'
    comma.write_text('\n'.join(line.replace('\t', ',') for line in lines) + '\n')
    args = train_args(shapes, tmp_path, 'run', '--loss', 'sogclr', '--gamma', '0.5')
    args[args.index('--train-data') + 1] = comma
    result = run_openclip(args, check=False)
    assert result.returncode != 0
    assert (f"{comma}: no column 'filepath' (columns with --csv-separator '\\t': 'filepath,title,label'; is the file "
            f"separated by another character?)") in result.stderr
    args[args.index('--train-data') + 1] = missing = tmp_path / 'missing.csv'  # a traceback of pandas' before
    assert f"--train-data: no such file '{missing}'" in refused_at_parsing(args, capsys)
    from open_clip_train.params import parse_args
    header = tmp_path / 'header.csv'  # no samples: as precompute says it
    header.write_text(lines[0] + '\n')
    args[args.index('--train-data') + 1] = header
    with pytest.raises(SystemExit, match=f"{header}: no rows below its header"):
        parse_args([str(a) for a in args])


@pytest.mark.parametrize('content, message', [
    (b'', "cannot be read as a CSV with --csv-separator '\\t' (EmptyDataError: No columns to parse from file)"),
    (b'filepath\ttitle\na.png\tcaf\xe9\n', "(UnicodeDecodeError: "),
    (b'filepath\ttitle\na.png\tone\nb.png\ttwo\tthree\n', "(ParserError: Error tokenizing data. C error: "
                                                           "Expected 2 fields in line 3, saw 3"),
])
def test_a_csv_pandas_cannot_read_is_named_at_start_up(shapes, tmp_path, content, message):
    """Pandas' traceback named neither the file nor, for the last, the cause: a caption holding the separator."""
    from open_clip_train.params import parse_args
    bad = tmp_path / 'bad.csv'
    bad.write_bytes(content)
    with pytest.raises(SystemExit) as stop:
        parse_args(['--loss', 'sogclr', '--train-data', str(bad), '--dataset-type', 'csv',
                    '--csv-caption-key', 'title'])
    assert str(stop.value).startswith(f"{bad}: cannot be read as a CSV") and message in str(stop.value), stop.value
    if content:  # and the same from precompute, before it loads the reference
        with pytest.raises(SystemExit) as stop:
            precompute.main(['--model', shapes['model'], '--train-data', bad, '--csv-caption-key', 'title',
                             '--output', tmp_path / 'ref'])
        assert message in str(stop.value) and not (tmp_path / 'ref.partial').exists()


def test_precompute_names_what_is_wrong_with_a_csv(shapes, tmp_path, capsys):
    lines = shapes['csv'].read_text().splitlines()
    comma = tmp_path / 'comma.csv'
    comma.write_text('\n'.join(line.replace('\t', ',') for line in lines[:9]) + '\n')
    with pytest.raises(SystemExit, match=r"no column 'filepath' \(columns with --csv-separator '\\t': "
                                         r"'filepath,title,label'; is the file separated by another character\?\)"):
        precompute.main(['--model', shapes['model'], '--train-data', comma, '--output', tmp_path / 'a',
                         '--workers', '0'])
    assert not (tmp_path / 'a.partial').exists()  # nothing started
    header = tmp_path / 'header.csv'  # an IndexError before
    header.write_text(lines[0] + '\n')
    with pytest.raises(SystemExit, match=f"{header}: no rows below its header"):
        precompute.main(['--model', shapes['model'], '--train-data', header, '--output', tmp_path / 'a'])
    assert not (tmp_path / 'a.partial').exists()
    broken = tmp_path / 'broken.png'
    broken.write_bytes(b'not an image')
    rows = lines[1:9]
    rows[3] = '\t'.join([str(broken)] + rows[3].split('\t')[1:])
    bad = tmp_path / 'bad.csv'
    bad.write_text('\n'.join([lines[0]] + rows) + '\n')
    for workers in ('0', '2'):  # from a loader worker, torch's message held the worker's traceback
        gc.disable()  # what frees the loader's workers is the stop itself, not a collection that happens to run
        try:
            with pytest.raises(SystemExit) as stop:
                precompute.main(['--model', shapes['model'], '--train-data', bad, '--output', tmp_path / 'b',
                                 '--workers', workers])
            assert not [o for o in gc.get_objects() if type(o) is _MultiProcessingDataLoaderIter and
                        not o._shutdown]  # left to a collection at exit, its join of the workers was interrupted
            # nor the progress bar, which printed itself at exit
            assert not [o for o in gc.get_objects() if type(o) is tqdm and not o.disable]
        finally:
            gc.enable()
        assert str(stop.value).startswith(f"CSV row 3 (from 0, the header not counted): image '{broken}' cannot "
                                          f"be read (UnidentifiedImageError: ")
        assert '\n' not in str(stop.value)


def test_features_cannot_describe_synthetic_data(shapes, tmp_path, capsys):
    args = train_args(shapes, tmp_path, 'x', '--loss', 'drrho', '--ref-features', shapes['ref'], '--dataset-type',
                      'synthetic', '--train-num-samples', '16')
    assert '--dataset-type synthetic has no samples a store can describe' in refused_at_parsing(args, capsys)


def test_corrupt_feature_file_names_the_shard(shapes, tmp_path, capsys):
    import shutil
    broken = tmp_path / 'ref'
    shutil.copytree(shapes['ref'], broken)
    path = broken / 'train.features.npy'
    content = path.read_bytes()
    path.write_bytes(content[:200])  # cut short: found at start-up
    said = refused_at_parsing(train_args(shapes, tmp_path, 'x', '--loss', 'drrho', '--ref-features', broken), capsys)
    assert f"shard 'train' of '{broken}': file 'train.features.npy' is cut short (200 bytes, its " in said
    whole = np.load(shapes['ref'] / 'train.features.npy')
    np.save(path, whole[:, :, :whole.shape[2] // 2])  # whole, of another reference: said so (it said "cut short")
    with pytest.raises(FeatureStoreError, match=re.escape(
            f"file 'train.features.npy' has shape {(len(whole), 2, whole.shape[2] // 2)}, the manifest says "
            f"{whole.shape}: features of another reference?")):
        FeatureStore.open(broken)
    path.write_bytes(b'x' * len(content))  # not a .npy file: found where the shard is read
    result = run_openclip(train_args(shapes, tmp_path, 'x', '--loss', 'drrho', '--ref-features', broken), check=False)
    assert result.returncode != 0 and "shard 'train'" in result.stderr and 'train.features.npy' in result.stderr


def test_resume_without_u_state_fails_and_keeps_the_checkpoint(shapes, tmp_path):
    # the default γ = 1 keeps no state; continuing with γ < 1 would silently restart every estimator
    run_openclip(train_args(shapes, tmp_path, 'run', '--loss', 'drrho', '--ref-features', shapes['ref']))
    saved = tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt'
    digest = hashlib.sha256(saved.read_bytes()).hexdigest()
    result = run_openclip(train_args(shapes, tmp_path, 'run', '--loss', 'drrho', '--gamma', '0.5',
                                     '--ref-features', shapes['ref'], '--resume', 'latest', epochs=2), check=False)
    assert result.returncode != 0
    assert 'holds no per-sample state' in result.stderr and str(saved) in result.stderr
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == digest
    assert not (tmp_path / 'run' / 'checkpoints' / 'epoch_2.pt').exists()


def test_loss_clip_through_the_plugin_is_openclips_own_run(shapes, tmp_path):
    import subprocess
    import sys
    from conftest import ENV
    run_openclip(train_args(shapes, tmp_path, 'plugin', '--loss', 'clip', epochs=2))
    # the same run on unpatched OpenCLIP: drop the import hook before open_clip_train is imported
    stock = ("import sys, runpy\n"
             "hooks = ('_DeferredHook', '_PatchingFinder')\n"
             "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ not in hooks]\n"
             "sys.argv = ['main'] + sys.argv[1:]\n"
             "runpy.run_module('open_clip_train.main', run_name='__main__')\n"
             "print('patched modules:', [n for n, m in list(sys.modules.items()) if '__drrho_patched__' in vars(m)])\n")
    args = [str(a) for a in train_args(shapes, tmp_path, 'stock', epochs=2)]
    result = subprocess.run([sys.executable, '-c', stock, *args], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    # the stock run imported no module through the plugin's patching (its output may still name the checkout's
    # path, which holds "drrho-openclip", in a library's warning)
    assert 'patched modules: []' in result.stdout, result.stdout[-3000:]
    a, b = checkpoint(tmp_path, 'plugin', 2), checkpoint(tmp_path, 'stock', 2)
    assert 'loss_state' not in a
    assert_same_weights(a, b)
