"""Every registered loss trains through OpenCLIP's own entry point, logs its true objective and diagnostics, and
bad flag combinations stop at start-up saying what to change."""
import pytest
import torch

from conftest import checkpoint, loss_tensors, refused_at_parsing, run_openclip, train_args
from drrho_openclip.losses import list_losses

# flags per configuration; {ref} is replaced by the reference-feature store
CONFIGS = {
    'clip+kd': ('--loss', 'clip', '--distill-weight', '0.5', '{ref}'),
    'drrho': ('--loss', 'drrho', '{ref}'),
    'drrho+auto': ('--loss', 'drrho', '--temperature-optimizer', 'loss', '--temperature', 'auto', '{ref}'),
    'drrho+kd+learnable': ('--loss', 'drrho', '--learn-temperature', '--distill-weight', '0.25', '{ref}'),
    'drrho-paper': ('--loss', 'drrho-paper', '{ref}'),
    'sogclr': ('--loss', 'sogclr'),
    'fastclip': ('--loss', 'fastclip'),
    'isogclr': ('--loss', 'isogclr'),
    'tempnet+shift': ('--loss', 'tempnet', '--reference-shift', '{ref}'),
    'adnce': ('--loss', 'adnce'),
    'balanced': ('--loss', 'balanced', '--balance-steps', '3'),
    'balanced+shift+kd': ('--loss', 'balanced', '--reference-shift', '--distill-weight', '0.5', '{ref}'),
    'jest': ('--loss', 'jest', '--selection-ratio', '0.5', '{ref}'),
    'jest-topk': ('--loss', 'jest-topk', '--selection-ratio', '0.5', '{ref}'),
}


def flags(shapes, config):
    out = []
    for flag in CONFIGS[config]:
        out += ['--ref-features', shapes['ref']] if flag == '{ref}' else [flag]
    return out


def test_every_registered_loss_has_a_training_run_here():
    assert {c.split('+')[0] for c in CONFIGS} | {'clip'} == set(list_losses())


@pytest.mark.parametrize('config', sorted(CONFIGS))
def test_loss_trains_through_openclip(shapes, tmp_path, config):
    result = run_openclip(train_args(shapes, tmp_path, 'run', *flags(shapes, config), '--log-every-n-steps', '1'))
    log = result.stdout + result.stderr
    assert f"drrho-openclip: --loss {config.split('+')[0]}" in log
    ckpt = checkpoint(tmp_path, 'run', 1)
    for key, tensor in ckpt['state_dict'].items():
        assert not tensor.is_floating_point() or torch.isfinite(tensor).all(), key
    for key, tensor in loss_tensors(ckpt).items():  # NaN marks a sample not visited yet (a table's Adam moments)
        assert not torch.isinf(tensor).any(), key
    assert 'Loss metrics:' in log  # the loss's own diagnostics reach OpenCLIP's logger
    if config.startswith('tempnet'):
        assert any(k.startswith('loss_temperature.') for k in ckpt['state_dict'])


@pytest.mark.parametrize('flags_, message', [
    (('--loss', 'jest'), 'needs reference features'),
    (('--loss', 'sogclr', '--distill-weight', '0.5'), '--distill-weight: no such option for --loss sogclr'),
    (('--loss', 'drrho', '--no-learn-temperature', '--rho', '3', '--ref-model', 'x'),
     '--rho has no effect for --loss drrho with these flags (a fixed τ; learn it with --learn-temperature'),
    (('--loss', 'drrho', '--temperature', 'auto', '--temperature-optimizer', 'model', '--ref-model', 'x'),
     'give the initial τ'),
    (('--loss', 'sogclr', '--temperature', 'auto'), "which this loss does not shift by"),
    (('--loss', 'adnce', '--epsilon', '0.1'), '--epsilon: no such option for --loss adnce'),
    (('--loss', 'clip', '--temperature', '0.1'), '--temperature: no such option for --loss clip'),
    (('--loss', 'sogclr', '--ref-model', 'x'), 'does not read reference features'),
    (('--loss', 'clip', '--ref-model', 'x'), 'drop --ref-features/--ref-model or distill from them with --distill-weight'),
    # a bad value is named as such, before whether the reference is read
    (('--loss', 'clip', '--distill-weight', '-0.5', '--ref-model', 'x'), '--distill-weight λ must be in [0, 1]'),
    (('--loss', 'drrho', '--gamma', '1.5', '--ref-model', 'x'), 'gamma'),
    (('--loss', 'sogclr', '--gamma', '1', '--gamma-decay-epochs', '4'),
     '--gamma-decay-epochs has no effect for --loss sogclr with these flags (gamma = 1 keeps no per-sample u'),
    (('--loss', 'balanced', '--temperature', '0.005'), "which OpenCLIP clamps to τ in [0.01, 1.0]"),
    (('--loss', 'drrho', '--temperature-optimizer', 'model', '--temperature', '0.005', '--ref-model', 'x'),
     "learns τ here as the model's logit_scale"),
    # OpenCLIP's modes with a loss of their own, which a plugin loss would replace
    (('--loss', 'sogclr', '--siglip'), "--siglip: --loss sogclr replaces OpenCLIP's loss"),
    (('--loss', 'clip', '--distill-weight', '0.5', '--ref-model', 'x', '--distill-model', 'y',
      '--distill-pretrained', 'z'), "--distill-model: --loss clip with --distill-weight replaces OpenCLIP's loss"),
    (('--loss', 'fastclip', '--model', 'coca_ViT-B-32'), 'a CoCa model trains with a captioning loss as well'),
    (('--loss', 'sogclr', '--horovod'), '--horovod: --loss sogclr communicates through torch.distributed'),
    (('--loss', 'tempnet', '--torchscript'), "--torchscript: --loss tempnet attaches its learnable modules"),
    (('--loss', 'jest', '--ref-model', 'x', '--num-chunks', '3'), 'JEST keeps 2 of a super-batch of 8 per rank, '
                                                                  'fewer than 3'),
    (('--loss', 'jest', '--ref-model', 'x', '--num-chunks', '1000'), "JEST's --num-chunks must be 1 to 64, got 1000"),
    # OpenCLIP ignores a local-dir: model's pretrained: a mistyped checkpoint path left a random reference
    (('--loss', 'drrho', '--ref-model', 'local-dir:/models/ref', '--ref-pretrained', '/models/ref/epoch_20.pt'),
     "--ref-pretrained: '/models/ref/epoch_20.pt' is not a file, and a local-dir: model loads its weights from a "
     "checkpoint file only"),
])
def test_bad_flag_combinations_fail_at_start_up(shapes, tmp_path, capsys, flags_, message):
    said = refused_at_parsing(train_args(shapes, tmp_path, 'x', *flags_), capsys)
    assert message in said, said[-2000:]
