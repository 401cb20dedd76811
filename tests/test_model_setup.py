"""The loss a run builds: on the model's device with everything it holds, and the start-up warning for OpenCLIP's
loss flags a loss does not read."""
import json
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import open_clip
import PIL.Image
import pytest
import torch

from conftest import run_openclip, train_args
from drrho_openclip import openclip as plugin


def parse(*argv):
    from open_clip_train.params import parse_args
    args = parse_args([str(a) for a in argv])
    args.rank, args.world_size = 0, 1  # what init_distributed_device sets for one process
    return args


@pytest.mark.parametrize('extra', [
    ('--loss', 'isogclr', '--gamma', '0.5'),  # u, τ_i and their Adam moments: per-sample tables
    ('--loss', 'tempnet', '--tempnet-width', '8', '--tempnet-prototypes', '4'),  # networks attached to the model
    ('--loss', 'drrho', '--gamma', '0.5', '--ref-model', '{model}'),  # the online reference model
])
def test_the_loss_and_what_it_holds_go_to_the_models_device(shapes, extra):
    # OpenCLIP creates the model on its device before the hook runs; 'meta' stands in for an accelerator
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16,
                 *(e.format(model=shapes['model']) for e in extra))
    model = open_clip.create_model(shapes['model'], device='meta')
    plugin.configure_model(model, args)
    loss = plugin.create_loss(args)
    tensors = dict(loss.state_dict(keep_vars=True))
    assert tensors  # per-sample tables (u, τ_i), TempNet's parameters
    tensors.update(model.state_dict(keep_vars=True))  # with the modules attached to it
    if loss.reference_encoder is not None:
        tensors.update({f'reference.{k}': v for k, v in loss.reference_encoder.model.state_dict().items()})
    assert {name: t.device.type for name, t in tensors.items() if t.device.type != 'meta'} == {}
    if args.loss == 'tempnet':
        assert any(name.startswith('loss_') for name, _ in model.named_children())


@pytest.mark.parametrize('loss', ['clip', 'drrho'])
def test_what_openclip_refuses_with_status_0_stops_at_parsing(shapes, tmp_path, loss, capsys):
    """OpenCLIP's main refuses these by printing a line and returning, so the process ends with status 0 (and, for
    an existing run, on rank 0 only); the plugin stops them at parsing, every rank, with status 2."""
    base = ('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss', loss,
            '--logs', tmp_path, '--name', 'run', *(('--ref-model', shapes['model']) if loss == 'drrho' else ()))
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'out.log').write_text('')
    with pytest.raises(SystemExit) as stopped:
        parse(*base)
    assert stopped.value.code == 2
    assert f"--name run: '{tmp_path / 'run' / 'out.log'}' exists, a run of that name" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # logging per node: OpenCLIP looked for out-<rank> only, and went on
        parse(*base, '--log-local')
    assert f"--name run: '{tmp_path / 'run' / 'out.log'}' exists, a run of that name" in capsys.readouterr().err
    (tmp_path / 'run' / 'out.log').rename(tmp_path / 'run' / 'out-1')  # a run that logged per node
    for local in ((), ('--log-local',)):
        with pytest.raises(SystemExit):
            parse(*base, *local)
        assert f"--name run: '{tmp_path / 'run' / 'out-1'}' exists, a run of that name" in capsys.readouterr().err
    parse(*base, '--resume', 'latest')  # continuing it is what the name is for
    for extra, said in ((('--save-most-recent',), 'cannot take --save-most-recent'),
                        (('--remote-sync-protocol', 'fsspec'), 'lists the remote')):
        with pytest.raises(SystemExit):
            parse(*base, '--resume', 'latest', '--remote-sync', tmp_path / 'remote', *extra)
        assert said in capsys.readouterr().err


def test_a_resume_that_cannot_resume_stops_naming_why(tmp_path, capsys, monkeypatch):
    """OpenCLIP's load raised after the model was built (a missing file, a folder), and torch's named no file (one
    cut short) or advised saving it again (one that is no checkpoint)."""
    from drrho_openclip.openclip.checkpoints import _resumed_checkpoint
    for resume, said in ((tmp_path / 'epoch_9.pt', f"--resume {tmp_path / 'epoch_9.pt'}: no such file"),
                         (tmp_path, f"--resume {tmp_path} is a folder: give a checkpoint file"),
                         ('latest', "--resume latest continues the run that --name names, and none is given")):
        with pytest.raises(SystemExit):
            parse('--loss', 'sogclr', '--dataset-type', 'synthetic', '--train-num-samples', 16, '--resume', resume)
        assert said in capsys.readouterr().err
    parse('--loss', 'sogclr', '--dataset-type', 'synthetic', '--train-num-samples', 16, '--resume',
          'file:///remote/epoch_1.pt')  # a URL is OpenCLIP's to fetch
    whole = tmp_path / 'whole.pt'
    torch.save({'epoch': 1, 'state_dict': {'w': torch.zeros(1000)}}, whole)
    monkeypatch.setenv('HOME', str(tmp_path))  # '~' unexpanded (--resume=~/..., quoted), which OpenCLIP expands
    assert parse('--loss', 'sogclr', '--dataset-type', 'synthetic', '--train-num-samples', 16,
                 '--resume', '~/whole.pt').resume == str(whole)
    assert _resumed_checkpoint(whole)['epoch'] == 1
    cut, text = tmp_path / 'cut.pt', tmp_path / 'notes.pt'
    cut.write_bytes(whole.read_bytes()[:2000])
    text.write_text('not a checkpoint')
    for bad in (cut, text):
        with pytest.raises(SystemExit, match=f"--resume '{bad}' cannot be read as a checkpoint \\(a checkpoint is "
                                             f"the zip archive torch.save writes, and this file is none: cut short"):
            _resumed_checkpoint(bad)


@pytest.mark.parametrize('loss', ['drrho-paper', 'sogclr', 'balanced'])
def test_an_evaluation_leaves_the_models_logit_scale_as_loaded(shapes, tmp_path, loss):
    """Training starts the logit_scale at 1/--temperature; evaluating a model (--val-data alone, e.g. of
    --pretrained weights) must not, or its validation loss would depend on a loss that never trains."""
    reference = ('--ref-model', shapes['model']) if loss == 'drrho-paper' else ()
    evaluation = parse('--model', shapes['model'], '--val-data', tmp_path / 'val.csv', '--loss', loss, *reference)
    training = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16,
                     '--loss', loss, *reference)
    for args, scale in ((evaluation, 3.0), (training, math.log(1 / training.temperature))):
        model = open_clip.create_model(shapes['model'])
        with torch.no_grad():
            model.logit_scale.fill_(3.0)  # as loaded
        plugin.configure_model(model, args)
        assert model.logit_scale.item() == pytest.approx(scale)


@pytest.mark.parametrize('loss', ['sogclr', 'isogclr', 'balanced'])
def test_a_models_logit_bias_is_frozen_and_passed_over(shapes, loss, caplog):
    """A SigLIP-style model (init_logit_bias) returns its logit_bias with the features, and OpenCLIP's loop passes it
    to the loss: every plugin loss takes it and leaves it alone (one number added to every logit cancels in each
    softmax), and the model's bias is frozen, so DDP does not wait for a gradient it never gets."""
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss', loss)
    model = open_clip.create_model(shapes['model'], init_logit_bias=-10.0, output_dict=True)
    with caplog.at_level(logging.INFO):
        plugin.configure_model(model, args)
    assert not model.logit_bias.requires_grad and "the model's logit_bias is frozen" in caplog.text
    training_loss = plugin.create_loss(args)
    size = open_clip.get_model_config(shapes['model'])['vision_cfg']['image_size']
    outputs = model(torch.randn(8, 3, size, size), torch.randint(0, 1000, (8, 16)))
    assert 'logit_bias' in outputs
    total = sum(training_loss(**outputs, index=torch.arange(8), output_dict=True).values())
    total.backward()
    assert torch.isfinite(total) and model.logit_bias.grad is None


@pytest.mark.parametrize('epochs, logged', [
    (3, "γ falls from 1 to --gamma 0.2 over --gamma-decay-epochs 16; this run's last epoch has γ = 0.97 "
        "(--gamma-decay-epochs 2 reaches --gamma in its last epoch)"),
    (1, "this run's last epoch has γ = 1 (γ is 1 in a run's first epoch"),
    (17, None)])
def test_a_run_too_short_for_the_gamma_schedule_says_where_it_ends(shapes, epochs, logged, caplog):
    """fastclip's γ follows the paper's 16-epoch schedule: a shorter run never reaches --gamma."""
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss',
                 'fastclip', '--epochs', epochs)
    with caplog.at_level(logging.INFO):
        plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    assert (logged in caplog.text) if logged else 'γ falls from 1' not in caplog.text


@pytest.mark.parametrize('loss, batch, said', [('fastclip', 8, True), ('fastclip', 10, False), ('isogclr', 4, True),
                                              ('sogclr', 8, False)])  # a fixed τ: no ρ
def test_a_batch_too_small_for_the_auto_rho_says_so(shapes, loss, batch, said, caplog):
    """ρ = log((B − 1)/k) is clamped at 0 where the batch has no more than k negatives: τ then rises, against the
    README's k effective negatives "at any batch", which a run at such a batch should hear at start-up."""
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss',
                 loss, '--batch-size', batch)
    with caplog.at_level(logging.INFO):
        plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    assert (f"--rho auto is 0 at this run's global batch {batch}: its {batch - 1} negatives per anchor are no more "
            f"than --target-negatives 8" in caplog.text) == said


@pytest.mark.parametrize('accum_freq, tiled', [(1, False), (4, True)])
def test_the_global_batch_of_an_accumulating_run_is_its_whole_window(shapes, accum_freq, tiled):
    """With --accum-freq the loop calls the loss on the whole window: 4 batches of 4096 on one process are 16384
    anchors against 16384 candidates, past what the untiled core holds on the CPU, so an automatic --tile-size tiles;
    and the run records that global batch, which resume compares."""
    from drrho_openclip.openclip import run
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss',
                 'sogclr', '--batch-size', 4096, '--accum-freq', accum_freq)
    plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    assert (run.active().options['tile_size'] > 0) == tiled
    assert run.active().provenance['global_batch'] == 4096 * accum_freq


@pytest.mark.parametrize('loss, lr_tau', [('drrho', None), ('fastclip', None), ('drrho', '0.003'), ('sogclr', None)])
def test_the_run_tells_the_loss_its_optimiser_steps(shapes, loss, lr_tau, caplog):
    """A learned τ's --lr-tau auto is 1/(the run's optimiser steps), counted as OpenCLIP's scheduler counts them:
    batches per epoch // --accum-freq × --epochs, and logged; a given --lr-tau is kept, and a fixed τ (sogclr) has
    none, so neither logs one. (drrho's τ is its own Adam's with --temperature-optimizer loss.)"""
    from open_clip_train.data import DataInfo
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss', loss,
                 '--epochs', 3, '--accum-freq', 2, *(('--lr-tau', lr_tau) if lr_tau else ()),
                 *(('--ref-model', shapes['model'], '--temperature-optimizer', 'loss') if loss == 'drrho' else ()))
    plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    loader = SimpleNamespace(num_batches=7)  # a loader without a map-style dataset, as WebDataset's
    with caplog.at_level(logging.INFO):
        plugin.wrap_data({'train': DataInfo(loader)}, args)
    auto = loss != 'sogclr' and lr_tau is None
    assert ('--lr-tau auto' in caplog.text) == auto
    assert ('the run has 9 optimiser steps, so --lr-tau auto is 1/9 = 0.111' in caplog.text) == auto
    if loss != 'sogclr':
        assert plugin.create_loss(args).temperature.lr == (float(lr_tau) if lr_tau else 1 / (7 // 2 * 3))
    with pytest.raises(SystemExit, match=r'no optimiser step: 1 training batches per epoch // --accum-freq 2'):
        plugin.wrap_data({'train': DataInfo(SimpleNamespace(num_batches=1))}, args)


@pytest.mark.parametrize('loss', ['jest', 'balanced'])
def test_a_run_without_an_optimiser_step_stops_for_a_loss_without_a_learning_rate(shapes, loss):
    """Also where no 'auto' rate needs the count: such a run trained nothing and saved a checkpoint as if it had."""
    from open_clip_train.data import DataInfo
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss', loss,
                 '--epochs', 0, *(('--ref-model', shapes['model']) if loss == 'jest' else ()))
    plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    with pytest.raises(SystemExit, match=r'no optimiser step: 7 training batches per epoch // --accum-freq 1 × '
                                         r'--epochs 0 = 0'):
        plugin.wrap_data({'train': DataInfo(SimpleNamespace(num_batches=7))}, args)


def test_openclip_loss_flags_a_loss_does_not_read_are_warned_about(shapes, caplog):
    def start_up_log(*argv):
        """What the run logs up to its loss (configure_model and create_loss: the hooks after OpenCLIP's logging
        is set up)."""
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, *argv)
            assert 'does not read' not in caplog.text  # parsing logs nothing (see the next test)
            plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
            plugin.create_loss(args)
        return caplog.text

    assert ("--loss sogclr does not read --local-loss and --gather-with-grad: its anchors are always the local "
            "samples and its candidates the global batch, gathered with gradient"
            ) in start_up_log('--loss', 'sogclr', '--local-loss', '--gather-with-grad')
    assert 'does not read' not in start_up_log('--loss', 'clip', '--local-loss', '--gather-with-grad')
    assert 'does not read' not in start_up_log('--loss', 'jest', '--ref-model', shapes['model'], '--local-loss')


def test_the_warning_does_not_double_the_runs_log_lines(shapes, tmp_path):
    """A logging call while OpenCLIP parses its flags, before it sets up logging, would give the root logger a
    handler of its own: every later line printed twice, once as 'INFO:root:...'."""
    result = run_openclip(train_args(shapes, tmp_path, 'run', '--loss', 'sogclr', '--local-loss'))
    log = result.stdout + result.stderr
    assert 'does not read --local-loss' in log and 'INFO:root:' not in log and 'WARNING:root:' not in log


@pytest.mark.parametrize('loss, compiles, logged', [('drrho', True, True), ('drrho', False, False),
                                                     ('balanced', True, True), ('jest', True, False)])
def test_the_run_says_when_the_loss_compiles_at_its_first_step(shapes, loss, compiles, logged, monkeypatch, caplog):
    """On a GPU the DRO losses and the balanced loss compile their passes during the first step: the start-up log
    says so, instead of a silent pause. Losses without such passes (jest) and devices where they run eagerly log
    nothing of it."""
    from drrho_openclip.openclip import model as boundary
    monkeypatch.setattr(boundary, 'compiles_for', lambda device: compiles)
    args = parse('--model', shapes['model'], '--dataset-type', 'synthetic', '--train-num-samples', 16, '--loss', loss,
                 *(('--ref-model', shapes['model']) if loss in ('drrho', 'jest') else ()))
    with caplog.at_level(logging.INFO):
        plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    assert ('compiled by TorchInductor during the first training step' in caplog.text) == logged


def test_an_online_reference_reads_the_learners_batches_as_its_own(shapes, tmp_path):
    """Built in the run's --precision from --cache-dir; sizes compared as both models were built (--force-* flags
    included); images normalised with the learner's mean and std re-normalised to the reference's own."""
    import torch
    from drrho_openclip.openclip.reference import OnlineReference
    reference_dir = tmp_path / 'ref'
    reference_dir.mkdir()
    config = json.loads((Path(shapes['model'].split(':', 1)[1]) / 'open_clip_config.json').read_text())
    config['preprocess_cfg'] = {'mean': [0.5, 0.5, 0.5], 'std': [0.5, 0.5, 0.5]}  # as SigLIP's
    (reference_dir / 'open_clip_config.json').write_text(json.dumps(config))
    checkpoint = tmp_path / 'ref.pt'
    torch.save(open_clip.create_model(f'local-dir:{reference_dir}').state_dict(), checkpoint)
    args = parse('--model', shapes['model'], '--loss', 'drrho', '--ref-model', f'local-dir:{reference_dir}',
                 '--ref-pretrained', checkpoint, '--cache-dir', tmp_path / 'cache', '--precision', 'pure_bf16')
    learner, _, learner_preprocess = open_clip.create_model_and_transforms(shapes['model'])
    reference = OnlineReference(learner, args, 'cpu')
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}  # --precision pure_bf16
    picture = PIL.Image.new('RGB', (40, 40), (200, 30, 90))
    _, _, reference_preprocess = open_clip.create_model_and_transforms(f'local-dir:{reference_dir}')
    tokens = open_clip.get_tokenizer(shapes['model'])(['a red square'])
    got = reference(learner_preprocess(picture)[None].bfloat16(), tokens)[0]
    want = reference.model.encode_image(reference_preprocess(picture)[None].bfloat16(), normalize=True)
    assert torch.allclose(got.float(), want.float(), atol=2e-2)
    unnormalised = reference.model.encode_image(learner_preprocess(picture)[None].bfloat16(), normalize=True)
    assert not torch.allclose(unnormalised.float(), want.float(), atol=2e-2)  # the test can tell the two apart

    captured = {}
    real = open_clip.create_model_and_transforms

    def recording(*a, **kw):
        captured.update(kw)
        return real(*a, **kw)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(open_clip, 'create_model_and_transforms', recording)
        OnlineReference(learner, args, 'cpu')
    assert captured['cache_dir'] == str(tmp_path / 'cache')  # a hub reference's weights come from --cache-dir

    # the same statistics written as JSON lists (a local-dir: config) against OpenCLIP's tuples: nothing to map
    config['preprocess_cfg'] = {k: list(learner.visual.preprocess_cfg[k]) for k in ('mean', 'std')}
    (reference_dir / 'open_clip_config.json').write_text(json.dumps(config))
    assert OnlineReference(learner, args, 'cpu').renormalize is None

    forced = open_clip.create_model(shapes['model'], force_image_size=48)
    # a start-up error, as the reference's failed load is (not a traceback)
    with pytest.raises(SystemExit, match=r"has image_size \(32, 32\), the learner \(48, 48\) \(with --force-\* "
                                         r"flags applied\): it cannot read the learner's batches"):
        OnlineReference(forced, args, 'cpu')
    with pytest.raises(SystemExit, match=r"has context_length 16, the learner 8"):
        OnlineReference(open_clip.create_model(shapes['model'], force_context_length=8), args, 'cpu')


def test_a_reference_is_built_as_its_pretrained_weights_were_trained(monkeypatch, caplog, tmp_path):
    """OpenAI's weights under a plain name (`ViT-B-32` with `openai`, as the README's precompute command reads) were
    trained with QuickGELU, which OpenCLIP only warns about while it builds GELU: every reference feature was of
    another function. A hub or folder model says it has its weights from there (it was reported as random)."""
    from drrho_openclip.openclip.reference import built_model, create_model, needs_quick_gelu
    assert needs_quick_gelu('ViT-B-32', 'openai') and needs_quick_gelu('RN50', 'openai')
    assert needs_quick_gelu('ViT-B/32', 'openai')  # the name as OpenCLIP also reads it
    assert not needs_quick_gelu('ViT-B-32-quickgelu', 'openai')
    assert not needs_quick_gelu('ViT-B-32', 'laion2b_s34b_b79k')
    assert not needs_quick_gelu('ViT-B-32', None) and not needs_quick_gelu('local-dir:/x', 'openai')
    # what stores and runs record: one written by an earlier version, GELU under the plain name, reads as another
    assert built_model('ViT-B/32', 'openai') == built_model('ViT-B-32', 'openai') == 'ViT-B-32-quickgelu'
    assert built_model('ViT-B-32', 'laion2b_s34b_b79k') == 'ViT-B-32' and built_model('m', None) == 'm'
    built, real = [], open_clip.create_model_and_transforms

    def recording(name, **kwargs):  # nothing downloads: the model is built without weights
        built.append((name, kwargs))
        return real(name, force_quick_gelu=kwargs['force_quick_gelu'])
    monkeypatch.setattr(open_clip, 'create_model_and_transforms', recording)
    with caplog.at_level(logging.INFO):
        model, _ = create_model('RN50', 'openai')
    assert built[-1][1]['force_quick_gelu'] and built[-1][1]['pretrained'] == 'openai'
    assert type(model.transformer.resblocks[0].mlp.gelu).__name__ == 'QuickGELU'
    assert "reference model RN50 is built with QuickGELU, as its 'openai' weights were trained" in caplog.text
    monkeypatch.setattr(open_clip, 'create_model_and_transforms',
                        lambda name, **kwargs: built.append((name, kwargs)) or (torch.nn.Linear(1, 1), None, None))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        create_model('hf-hub:org/model')
    assert not built[-1][1]['force_quick_gelu'] and 'random weights' not in caplog.text
    assert "reference model hf-hub:org/model, weights as OpenCLIP loads them for it" in caplog.text
    folder = tmp_path / 'model'
    folder.mkdir()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        create_model(f'local-dir:{folder}')  # a config alone: OpenCLIP initialises it randomly
    assert f"reference model local-dir:{folder} has random weights" in caplog.text
    (folder / 'open_clip_pytorch_model.bin').write_bytes(b'')
    caplog.clear()
    with caplog.at_level(logging.INFO):
        create_model(f'local-dir:{folder}')
    assert 'random weights' not in caplog.text and "weights as OpenCLIP loads them for it" in caplog.text


@pytest.mark.parametrize('precision, dtype', [('amp_bf16', 'bfloat16'), ('fp32', 'float32')])
def test_an_online_reference_runs_under_the_runs_autocast(shapes, precision, dtype):
    """Under --precision amp_bf16 (or amp) the reference's forward runs in OpenCLIP's autocast, as the learner's
    does and as OpenCLIP runs its own --distill-model teacher: the loop asks for the reference features before it
    enters its autocast, so without one of its own the reference ran in float32, at float32's time and memory."""
    import torch
    from drrho_openclip.openclip.reference import OnlineReference
    args = parse('--model', shapes['model'], '--loss', 'drrho', '--ref-model', shapes['model'], '--precision', precision)
    learner = open_clip.create_model(shapes['model'])
    reference = OnlineReference(learner, args, 'cpu')
    assert {p.dtype for p in reference.model.parameters()} == {torch.float32}  # amp keeps float32 weights
    tokens = open_clip.get_tokenizer(shapes['model'])(['a red square'])
    image_features, text_features = reference(torch.zeros(1, 3, 32, 32), tokens)
    assert image_features.dtype == text_features.dtype == getattr(torch, dtype)


@pytest.mark.parametrize('data, checked', [(('--dataset-type', 'synthetic', '--train-num-samples', 16), True),
                                           (('--val-data', 'val.csv'), False)])
def test_a_sharded_run_checks_that_its_ranks_share_the_checkpoint_folder_when_it_trains(shapes, monkeypatch, data,
                                                                                        checked):
    """Each rank writes its block of the state next to rank 0's checkpoints; an evaluation writes none, so it does
    not ask every rank to see the folder (`check_checkpoint_folder_shared`, tested on two ranks elsewhere)."""
    from drrho_openclip.openclip import model as setup
    calls = []
    monkeypatch.setattr(setup, 'check_checkpoint_folder_shared', lambda args, device: calls.append(device))
    args = parse('--model', shapes['model'], *data, '--loss', 'sogclr', '--gamma', '0.5', '--state-layout', 'sharded')
    args.world_size = 2  # rank 0 of two: the state is sharded
    plugin.configure_model(open_clip.create_model(shapes['model'], device='meta'), args)
    assert calls == ([torch.device('meta')] if checked else [])


@pytest.mark.parametrize('name, scale_option, key', [
    ('jest', {}, 'reference_logit_scale.value'),  # JEST's scoring scale
    ('clip', {'distill_weight': 0.5}, 'teacher_logit_scale.value'),  # KD's teacher scale
])
def test_a_reference_scale_resumes_given_or_auto_either_way(tmp_path, name, scale_option, key):
    """'auto' keeps the scale chosen on the first batch as state, a given number keeps none: a resume that switches
    between them is a change of options, not another run (JEST's scale, under another name than KD's, stopped the
    run as 'the loss state of another loss')."""
    from drrho_openclip.losses import create_loss
    from drrho_openclip.openclip.checkpoints import check_loss_state, resolve_loss_state
    from drrho_openclip.openclip.run import Run
    features = torch.nn.functional.normalize(torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    resume = tmp_path / 'epoch_1.pt'
    resume.write_bytes(b'')  # a local file: resumed as one
    args = SimpleNamespace(resume=str(resume), epochs=1, model='tiny', loss=name)
    for saved_scale, resumed_scale in (('auto', 50.0), (50.0, 'auto')):
        saved_loss = create_loss(name, reference_logit_scale=saved_scale, **scale_option)
        saved_loss(*features, torch.tensor(10.0), *features, index=torch.arange(16))
        saved = saved_loss.state_dict()
        assert (key in saved) == (saved_scale == 'auto')
        loss = create_loss(name, reference_logit_scale=resumed_scale, **scale_option)
        run = Run(loss_name=name, plain_clip=False)
        check_loss_state(saved, loss, run, args, weights={})
        loss.load_state_dict(resolve_loss_state(run, loss, saved, args))
        if resumed_scale == 'auto':  # chosen anew on the first batch
            assert torch.isnan(loss.state_dict()[key])
        else:
            assert key not in loss.state_dict()


def test_the_run_supplies_every_run_option_a_loss_can_take():
    """A run option added to the registry and not to the boundary's values was a KeyError at start-up."""
    from drrho_openclip.losses.registry import RUN_OPTION_DEFAULTS
    from drrho_openclip.openclip.flags import loss_run_options
    args = parse('--loss', 'sogclr', '--dataset-type', 'synthetic', '--train-num-samples', 16, '--seed', 5)
    values = loss_run_options(args, tuple(RUN_OPTION_DEFAULTS), num_samples=16, rank=1, world_size=2, embed_dim=8)
    assert values == dict(num_samples=16, rank=1, world_size=2, embed_dim=8, local_loss=False,
                          gather_with_grad=False, seed=5)


def test_the_tile_size_help_says_what_the_run_chooses():
    """--tile-size's help gives the batch where a run starts tiling: its numbers are the policy's own."""
    from drrho_openclip.openclip.model import auto_tile_size, auto_tile_size_help
    said = auto_tile_size_help()
    cpu = int(re.search(r'one process below a batch of (\d+) ', said).group(1))
    assert auto_tile_size(cpu - 1, cpu - 1) == 0 and auto_tile_size(cpu, cpu) > 0
    kd = int(re.search(r'\((\d+)k with KD\); ', said).group(1)) * 1000
    assert auto_tile_size(kd, kd, distills=True) == 0 and auto_tile_size(kd + 1000, kd + 1000, distills=True) > 0
