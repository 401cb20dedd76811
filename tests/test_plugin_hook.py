"""The plugin-API patch: applies cleanly to the pinned OpenCLIP, is what the import hook runs, and fails loudly."""
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import open_clip_train
from drrho_openclip import _bootstrap
from drrho_openclip.openclip import import_hook

SITE = Path(open_clip_train.__file__).resolve().parent.parent


def test_patch_applies_cleanly_with_gnu_patch(tmp_path):
    diffs = import_hook.patches_by_module()
    # what the start-up hook watches: open_clip_train only, so `import open_clip` is OpenCLIP's own
    assert set(diffs) == _bootstrap.patched_modules(_bootstrap.patch_path())
    assert set(diffs) == {'open_clip_train.params', 'open_clip_train.data', 'open_clip_train.train',
                          'open_clip_train.main'}
    for module in diffs:
        relative = module.replace('.', '/') + '.py'
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE / relative, tmp_path / relative)
    result = subprocess.run(['patch', '-p1', '--dry-run', '--fuzz=0', '-i', str(import_hook.patch_path())],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'offset' not in result.stdout and 'fuzz' not in result.stdout.lower()


def test_the_hook_runs_the_patched_sources():
    import open_clip.factory
    import open_clip_train.data
    import open_clip_train.main
    import open_clip_train.params
    import open_clip_train.train
    assert not hasattr(open_clip.factory, '__drrho_patched__')
    for module in (open_clip_train.main, open_clip_train.params, open_clip_train.data, open_clip_train.train):
        assert module.__drrho_patched__
        assert module.__loader__.get_source() == import_hook.patched_source(
            module.__name__, Path(module.__file__).read_text(), import_hook.patches_by_module()[module.__name__])
    assert open_clip_train.params.load_plugins()  # the entry point of this package is found


def test_loss_flag_is_the_plugin_flag_not_an_abbreviation():
    from open_clip_train.params import parse_args
    args = parse_args(['--loss', 'drrho', '--ref-model', 'RN50'])
    assert args.loss == 'drrho' and args.loss_dist_impl is None
    # drrho's defaults were filled in: τ learned from 0.07 as the model's logit_scale, CLIP's estimator (γ = 1 and
    # ε = 1/(B − 1))
    assert args.temperature == 0.07 and args.learn_temperature is True and args.temperature_optimizer == 'model'
    assert args.gamma == 1.0 and args.positive_in_denominator is True
    args = parse_args(['--loss', 'drrho', '--ref-model', 'RN50', '--no-learn-temperature', '--temperature', '0.01'])
    assert args.learn_temperature is False and args.temperature == 0.01  # the paper's main setting


def test_jest_is_checked_against_the_super_batch_it_selects_from(capsys):
    """Under --accum-freq OpenCLIP hands the loss the whole window: JEST selects from batch × accum_freq rows."""
    from open_clip_train.params import parse_args
    assert parse_args(['--loss', 'jest', '--ref-model', 'RN50', '--batch-size', '4', '--accum-freq', '4']).loss == 'jest'
    with pytest.raises(SystemExit):
        parse_args(['--loss', 'jest', '--ref-model', 'RN50', '--batch-size', '2', '--accum-freq', '2'])
    assert ('JEST keeps 1 of a super-batch of 4 per rank, fewer than 2: raise --batch-size or --selection-ratio, or '
            'lower --num-chunks (the super-batch is --batch-size × --accum-freq)') in capsys.readouterr().err


SYNTHETIC = ('--dataset-type', 'synthetic', '--train-num-samples', '16')  # a training run, without data files


@pytest.mark.parametrize('argv, message', [
    # a τ never stepped is never clamped: its bounds are unread, so they neither stop a start above them nor may be set
    (('--loss', 'drrho', '--ref-model', 'RN50', '--temperature-optimizer', 'loss', '--lr-tau', '0', '--temperature',
      '2'), None),
    (('--loss', 'drrho', '--ref-model', 'RN50', '--temperature-optimizer', 'loss', '--lr-tau', '0', '--temperature',
      '2', '--tau-max', '3'),
     '--tau-max has no effect for --loss drrho with these flags (--lr-tau 0 never steps τ)'),
    (('--loss', 'isogclr', '--lr-tau', '0', '--temperature', '2'), None),
    (('--loss', 'isogclr', '--lr-tau', '0', '--rho', '3'),
     '--rho has no effect for --loss isogclr with these flags (--lr-tau 0 never steps the per-sample τ)'),
    (('--loss', 'isogclr', '--lr-tau', '0', '--tau-beta1', '0.5'), '--tau-beta1 has no effect'),
    (('--loss', 'isogclr', '--lr-tau', '-1'), "the per-sample τ's learning rate --lr-tau must be ≥ 0"),
    (('--loss', 'isogclr', '--tau-eps', '0'), "the per-sample τ's Adam needs --tau-eps > 0"),
    # γ = 1 keeps no table to lay out, but isogclr's per-sample τ's are one
    (('--loss', 'sogclr', '--gamma', '1', '--state-layout', 'auto'),
     '--state-layout has no effect for --loss sogclr with these flags (gamma = 1 keeps no per-sample state'),
    (('--loss', 'isogclr', '--gamma', '1', '--state-layout', 'auto'), None),
    # drrho's reference weight 0 is its DRO unshifted: it reads the reference for KD only
    (('--loss', 'drrho', '--reference-weight', '0'), None),
    (('--loss', 'drrho', '--reference-weight', '0', '--ref-model', 'RN50'),
     'drop --ref-features/--ref-model or shift by them with --reference-weight > 0 or distill from them'),
    (('--loss', 'drrho', '--reference-weight', '0', '--distill-weight', '0.5'), 'needs reference features'),
    (('--loss', 'drrho', '--reference-weight', '0', '--temperature', 'auto'),
     'which this loss does not shift by (--reference-weight 0): give a number'),
    # the loss's own checks name the flag at fault
    (('--loss', 'balanced', '--balance-steps', '0'), 'needs --balance-steps ≥ 1'),
    (('--loss', 'adnce', '--adnce-sigma', '0'), "ADNCE's σ (--adnce-sigma) must be > 0"),
    (('--loss', 'jest', '--ref-model', 'RN50', '--selection-ratio', '2'), "JEST's --selection-ratio must be in (0, 1]"),
    (('--loss', 'jest', '--ref-model', 'RN50', '--batch-size', '8', '--num-chunks', '3'),
     'raise --batch-size or --selection-ratio, or lower --num-chunks'),
])
def test_flags_are_read_as_given_or_refused_naming_the_flag(capsys, argv, message):
    from open_clip_train.params import parse_args
    if message is None:
        assert parse_args([*argv, *SYNTHETIC]).loss == argv[1]
        return
    with pytest.raises(SystemExit):
        parse_args([*argv, *SYNTHETIC])
    assert message in capsys.readouterr().err


def test_an_evaluation_run_reuses_the_training_commands_flags():
    # no --train-data: OpenCLIP only evaluates, so the training data's sample index is neither needed nor read
    from open_clip_train.params import parse_args
    args = parse_args(['--loss', 'sogclr', '--gamma', '0.5', '--val-data', 'val.csv', '--sample-index', 'keys/'])
    assert args.loss == 'sogclr'


def test_help_documents_every_plugin_flag():
    result = subprocess.run([sys.executable, '-m', 'open_clip_train.main', '--help'], capture_output=True, text=True)
    assert result.returncode == 0
    for flag in ('--loss', '--ref-features', '--ref-model', '--ref-pretrained', '--temperature',
                 '--learn-temperature', '--rho', '--epsilon', '--gamma', '--gamma-decay-epochs'):
        assert flag in result.stdout
    explicit = subprocess.run([sys.executable, '-m', 'drrho_openclip.train', '--help'], capture_output=True, text=True)
    assert explicit.returncode == 0 and '--ref-features' in explicit.stdout


def test_the_explicit_entry_point_stops_where_the_package_is_not_installed(tmp_path):
    # a checkout only put on the path: no entry point, so OpenCLIP would load no plugin and train plain CLIP
    code = ("import importlib.metadata as m; real = m.entry_points\n"
            "m.entry_points = lambda **selection: real(group='none such')\n"
            "from drrho_openclip.train import main; main(['--loss', 'sogclr'])\n")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    assert 'its entry point (open_clip_train.plugins: drrho) is not registered' in result.stderr


def openclip_help(columns: int) -> str:
    result = subprocess.run([sys.executable, '-m', 'open_clip_train.main', '--help'], capture_output=True, text=True,
                            env={**os.environ, 'COLUMNS': str(columns)})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_help_lists_the_losses_in_the_plugins_own_group():
    from drrho_openclip.losses import list_losses
    text = openclip_help(80)
    openclip_part, group = text.split('\ndrrho-openclip:\n')
    openclip_options = openclip_part.split('\noptions:\n')[1]  # OpenCLIP's own flags, after the usage line
    assert not re.search(r'^ +(--loss|--ref-features|--gamma)\b(?!-)', openclip_options, re.MULTILINE)
    assert re.search(r'^ +--loss-dist-impl\b', openclip_options, re.MULTILINE)
    listed = group.split('\n  Losses:\n')[1].split('\n\n')[0].splitlines()
    starts = [line.split()[0] for line in listed if not line.startswith(' ' * 5)]  # continuation lines are indented
    assert starts == list_losses()  # a description per loss, each starting a line of its own
    assert all(len(line) <= 78 for line in listed)
    losses = ' '.join(' '.join(listed).split())
    # the papers' baselines that are a flag of another loss, and option names as the user types them
    assert "or with --distill-weight > 0 MobileCLIP's" in losses and '(--reference-weight 1)' in losses


def test_help_names_the_losses_that_read_each_flag_with_their_defaults():
    from drrho_openclip.losses import get_loss_spec, list_losses, option_names
    group = openclip_help(400).split('\ndrrho-openclip:\n')[1]  # wide: no flag's help is wrapped
    lines = {}  # flag -> its entry, the flag and its help (on the next line where the flag is long)
    for line in group.splitlines():
        if line.startswith('  --'):
            flag = line.split()[0].rstrip(',')  # '--x, --no-x' of a switch
            lines[flag] = line
        elif line.startswith(' ' * 5) and lines:
            lines[flag] += ' ' + line.strip()
    readers = {}
    for name in list_losses():
        for option in option_names(name):
            readers.setdefault(option, []).append(name)
    for option, losses in readers.items():
        line = lines['--' + option.replace('_', '-')]
        named = line.split(' Losses: ')[1]
        assert set(re.findall(r'[a-z][a-z-]*[a-z]', re.sub(r'\(default [^)]*\)', '', named))) == set(losses), line
        if option in ('tile_size', 'state_layout'):  # chosen by the run
            continue
        for clause in named.rstrip('.').split('; '):
            value = re.fullmatch(r'([a-z, -]+) \(default (.+)\)', clause)
            assert value, line
            for loss in value.group(1).split(', '):
                default = get_loss_spec(loss).defaults[option]
                shown = ('on' if default else 'off') if isinstance(default, bool) else str(default)
                assert value.group(2) == shown, (loss, line)
    assert ('Losses: drrho, drrho-paper, jest, jest-topk (required; drrho, drrho-paper at --reference-weight 0 only '
            'with --distill-weight > 0)') in lines['--ref-features']


@pytest.mark.parametrize('version', ['3.4.0', '3.3.1'])
def test_unsupported_openclip_version_stops(monkeypatch, version):
    # the patch's context lines are 3.3.0's: a patch release may move them
    monkeypatch.setattr(importlib.metadata, 'version', lambda name: version)
    with pytest.raises(import_hook.PluginActivationError, match=rf'supports open_clip_torch 3\.3\.0, found {version}'):
        import_hook.check_openclip_version()


def test_a_patch_that_does_not_apply_stops_with_the_module_named():
    diff = import_hook.patches_by_module()['open_clip_train.train']
    source = (SITE / 'open_clip_train' / 'train.py').read_text().replace('images, texts = batch', 'images, txt = batch')
    with pytest.raises(import_hook.PluginActivationError, match='does not apply to open_clip_train.train'):
        import_hook.patched_source('open_clip_train.train', source, diff)


def test_unsupported_version_fails_the_training_entry_point_and_leaves_open_clip_alone(tmp_path):
    # a fresh interpreter whose OpenCLIP claims another version: importing open_clip_train.main must fail loudly,
    # while `import open_clip` (inference, other libraries) works as without the plugin
    code = ("import importlib.metadata as m; real = m.version\n"
            "m.version = lambda name: '3.4.0' if name == 'open_clip_torch' else real(name)\n"
            "import open_clip\n"
            "print('open_clip imported:', open_clip.create_loss.__module__)\n"
            "import open_clip_train.main\n")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tmp_path)
    assert 'open_clip imported: open_clip.factory' in result.stdout, result.stderr[-2000:]
    assert result.returncode != 0 and 'supports open_clip_torch 3.3.0, found 3.4.0' in result.stderr
    # said once, by the import that failed (Python 3.13's traceback also quotes the raise's source, unformatted)
    assert result.stderr.count('supports open_clip_torch 3.3.0, found 3.4.0') == 1


START_UP_FILE = Path(import_hook.__file__).resolve().parent.parent / 'drrho_openclip.pth'


def _start_up(tmp_path, package_on_path, then="print(any(type(f).__name__ == '_DeferredHook' for f in sys.meta_path))"):
    """A bare interpreter (no site-packages) that processes a site folder holding the start-up file and what an
    editable install leaves there (drrho_openclip/patches/), then runs `then`; the package itself is on its path or
    not. `before` holds the modules imported up to the start-up file, a folder with another .pth file processed
    alike: what reading a .pth costs any package (Python 3.13 decodes it with encodings.utf_8_sig) is not ours."""
    site_dir, other_dir = tmp_path / 'site', tmp_path / 'other'
    (site_dir / 'drrho_openclip' / 'patches').mkdir(parents=True)
    other_dir.mkdir()
    (other_dir / 'other.pth').write_text('# a path file of another package\n')
    shutil.copy(START_UP_FILE, site_dir)
    extra = repr(str(START_UP_FILE.parent.parent)) if package_on_path else ''
    code = (f"import sys, site; sys.path.extend([{extra}]); site.addsitedir({str(other_dir)!r})\n"
            f"before = set(sys.modules); site.addsitedir({str(site_dir)!r})\n{then}\n")
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    return subprocess.run([sys.executable, '-S', '-c', code], capture_output=True, text=True, cwd=tmp_path, env=env)


def test_start_up_file_installs_the_hook(tmp_path):
    result = _start_up(tmp_path, package_on_path=True)
    assert result.returncode == 0 and result.stderr == '' and result.stdout.strip() == 'True', result


def test_start_up_file_left_behind_by_a_deleted_checkout_is_silent(tmp_path):
    result = _start_up(tmp_path, package_on_path=False)
    assert result.returncode == 0 and result.stderr == '' and result.stdout.strip() == 'False', result


def test_start_up_imports_only_the_hook(tmp_path):
    """Every interpreter of the environment runs the start-up file: it imports the hook's module and what that
    needs, os and sys, which Python's start-up has already imported; OpenCLIP, the plugin's boundary package and
    the patch reader wait for the first import of open_clip_train."""
    result = _start_up(tmp_path, package_on_path=True, then="print(sorted(set(sys.modules) - before))")
    assert result.returncode == 0 and result.stderr == '', result
    assert result.stdout.strip() == "['drrho_openclip', 'drrho_openclip._bootstrap']"


def test_start_up_file_patches_open_clip_train_at_its_first_import(tmp_path):
    # the deferred hook hands the first import to the import hook, which patches it and what follows
    result = _start_up(tmp_path, package_on_path=True, then=(
        f"sys.path.append({str(SITE)!r})\n"
        "import open_clip_train.params, open_clip_train.main\n"
        "print(open_clip_train.params.__drrho_patched__, open_clip_train.main.__drrho_patched__)"))
    assert result.returncode == 0 and result.stdout.strip() == 'True True', result


def test_a_hook_installed_after_open_clip_train_stops_and_patches_nothing(tmp_path):
    """A module already imported unpatched: the hook says so and is not installed, so the modules imported later are
    not patched beside it (patched main.py reads plugins that an unpatched params.py never loaded)."""
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_DeferredHook']\n"
            "import open_clip_train.params\n"
            "from drrho_openclip.openclip import PluginActivationError, install_import_hook\n"
            "try:\n"
            "    install_import_hook()\n"
            "except PluginActivationError as e:\n"
            "    print(e)\n"
            "import open_clip_train.main\n"
            "print('main patched:', hasattr(open_clip_train.main, '__drrho_patched__'))\n")
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("open_clip_train.params was imported before the plugin hook: call "
            "drrho_openclip.openclip.install_import_hook() before importing open_clip_train") in result.stdout
    assert 'main patched: False' in result.stdout
