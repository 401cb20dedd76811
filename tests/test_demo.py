"""The demo as a user sees it: a short terminal, full logs in files, a table and a figure."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ENV
from drrho_openclip import demo

PNG = b'\x89PNG\r\n\x1a\n'


def test_the_demo_prints_a_line_per_stage_a_table_and_the_figure(tmp_path):
    work = tmp_path / 'demo'
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.demo', '--workdir', work, '--epochs', '2',
                             '--samples', '256', '--batch-size', '64', '--seed', '5'], capture_output=True, env=ENV)
    # bytes: text mode would turn the progress bars' in-place redraws ('\r') into lines
    stdout, terminal = result.stdout.decode(), (result.stdout + result.stderr).decode()
    assert result.returncode == 0, terminal[-3000:]
    assert terminal.count('\n') <= 40, terminal  # a line per stage, its progress bar redrawn in place
    assert 'INFO' not in terminal and 'Train Epoch' not in terminal and 'TorchDynamo' not in terminal
    for stage in ('[1/5]', '[2/5]', '[3/5]', '[4/5]', '[5/5]'):
        assert stage in terminal
    lines = stdout.splitlines()
    assert [line.split()[-1].endswith('%') for line in lines if line.startswith(('reference', 'target'))] == \
        [True] * 3
    figure = next(line.split(None, 1)[1] for line in lines if line.startswith('figure:'))
    assert figure == str(work / 'accuracy.png') and (work / 'accuracy.png').read_bytes().startswith(PNG)
    assert f"{work / 'diagnostics.png'} (the drrho run's diagnostics, from TensorBoard)" in stdout
    assert (work / 'diagnostics.png').read_bytes().startswith(PNG)
    results = json.loads((work / 'results.json').read_text())
    # the reference has seen more than the targets: 4x their pairs (drawn apart from theirs), 2x their epochs
    assert results['setting'] == {'seed': 5, 'samples': 256, 'epochs': 2, 'reference_samples': 1024,
                                  'reference_epochs': 4, 'batch_size': 64, 'lr': 5e-3}
    assert len((work / 'data' / 'reference_train.csv').read_text().splitlines()) == 1 + 1024
    assert {name: len(curve) for name, curve in results['top1_per_epoch'].items()} == \
        {'reference': 4, 'drrho': 2, 'clip': 2}
    assert [step for step, _ in results['loss_per_step']['drrho']] == list(range(1, 9))  # 2 epochs x 4 steps
    assert [step for step, _ in results['loss_per_step']['reference']] == list(range(1, 65))  # 4 epochs x 16
    for run, last_epoch in (('reference', 4), ('drrho', 2), ('clip', 2)):
        assert 'Train Epoch: 1' in (work / 'logs' / run / 'console.log').read_text()
        assert 'seed: 5' in (work / 'logs' / run / 'params.txt').read_text().splitlines()
        assert sorted(p.name for p in (work / 'logs' / run / 'checkpoints').iterdir()) == [f'epoch_{last_epoch}.pt']
    assert 'wrote reference features of 256 samples' in (work / 'logs' / 'precompute' / 'console.log').read_text()


def test_a_command_s_output_goes_to_its_log_and_to_the_terminal_only_when_verbose(tmp_path, capsys):
    say = [sys.executable, '-c', "print('first'); import sys; print('second', file=sys.stderr)"]
    seen = []
    demo.run_logged(say, tmp_path / 'quiet.log', verbose=False, on_line=seen.append)
    assert capsys.readouterr().out == '' and seen == ['first\n', 'second\n']
    assert (tmp_path / 'quiet.log').read_text().splitlines()[1:] == ['first', 'second']
    demo.run_logged(say, tmp_path / 'verbose.log', verbose=True)
    assert capsys.readouterr().out == 'first\nsecond\n'


def test_a_failing_command_stops_the_job_quoting_the_end_of_its_log(tmp_path):
    fail = [sys.executable, '-c', "print('\\n'.join(map(str, range(100)))); raise SystemExit('bad flag')"]
    with pytest.raises(SystemExit) as stopped:
        demo.run_logged(fail, tmp_path / 'run' / 'console.log', verbose=False)
    message = str(stopped.value)
    assert 'failed (exit status 1)' in message and str(tmp_path / 'run' / 'console.log') in message
    assert message.splitlines()[-1] == 'bad flag' and '\n99\n' in message and '\n50\n' not in message


def test_without_matplotlib_the_table_is_still_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    run = lambda name, label, accuracy: SimpleNamespace(name=name, label=label, accuracy=[0.1, accuracy],
                                                        loss=[(1, 3.0), (2, 2.0)])
    demo.report(tmp_path, run('reference', 'reference', 0.5),
                [run('drrho', 'target, --loss drrho', 0.4), run('clip', 'target, --loss clip', 0.3)], {'seed': 3})
    out = capsys.readouterr().out
    assert 'target, --loss drrho               40.0%' in out and 'target, --loss clip                30.0%' in out
    assert 'figure:  not drawn, matplotlib is not installed (pip install matplotlib)' in out
    assert not (tmp_path / 'accuracy.png').exists()
    assert json.loads((tmp_path / 'results.json').read_text())['setting'] == {'seed': 3}


@pytest.mark.parametrize('flags, message', [
    (['--reference-samples', '0'], '--reference-samples 0 is less than one batch (--batch-size 128)'),
    (['--samples', '64'], '--samples 64 is less than one batch (--batch-size 128)'),
    (['--reference-epochs', '0'], '--reference-epochs must be at least 1, not 0'),
    (['--epochs', '-1'], '--epochs must be at least 1, not -1'),
    (['--batch-size', '0'], '--batch-size must be at least 2 (a contrastive loss needs negatives), not 0')])
def test_the_demo_refuses_sizes_it_cannot_train_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(flags)
    assert message in capsys.readouterr().err


def test_the_reference_defaults_to_four_times_the_pairs_and_twice_the_epochs():
    args = demo.parse_args(['--samples', '512', '--epochs', '3', '--seed', '7'])
    assert demo.setting(args) == {'seed': 7, 'samples': 512, 'epochs': 3, 'reference_samples': 2048,
                                  'reference_epochs': 6, 'batch_size': 128, 'lr': 5e-3}
    given = demo.setting(demo.parse_args(['--reference-samples', '256', '--reference-epochs', '1']))
    assert (given['reference_samples'], given['reference_epochs']) == (256, 1)
