"""launch/: the SLURM and torchrun scripts print the right command in DRY_RUN mode, and the torchrun precompute
runs for real (two CPU ranks)."""
import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import ENV
from drrho_openclip import precompute
from drrho_openclip.features import FeatureStore
from drrho_openclip.losses.registry import get_loss_spec, list_losses
from test_precompute_scale import SIZES, write_checkpoint, write_shards

LAUNCH = Path(__file__).resolve().parents[1] / 'launch'
# what the scripts read from the environment: their settings (NAME=${NAME:-...}) and SLURM's
SETTINGS = {m.group(1) for script in LAUNCH.iterdir() if script.suffix in ('.sh', '.sbatch')
            for m in re.finditer(r'^([A-Z_]+)=\$\{', script.read_text(), re.MULTILINE)}


def run_script(name, *args, dry_run=True, path_prefix=None, **env):
    """Run a launch script with bash; returns the CompletedProcess. Neither a SLURM variable nor a setting of the
    scripts (MASTER_PORT, MODEL, ... exported on a cluster) leaks in from outside."""
    outside = {k: v for k, v in ENV.items() if not k.startswith('SLURM_') and k not in SETTINGS | {'DRY_RUN'}}
    env = {**outside, **{k: str(v) for k, v in env.items()}}
    if dry_run:
        env['DRY_RUN'] = '1'
    if path_prefix:
        env['PATH'] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(['bash', str(LAUNCH / name), *map(str, args)], capture_output=True, text=True, env=env)


def printed_command(name, *args, **env):
    result = run_script(name, *args, **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0])


def option(cmd, flag):
    """The value of `flag` in cmd (`--flag value` or `--flag=value`), the last one if repeated."""
    values = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]
    values += [a.split('=', 1)[1] for a in cmd if a.startswith(flag + '=')]
    assert values, f'{flag} not in {cmd}'
    return values[-1]


def training_args(cmd):
    """The arguments open_clip_train.main gets: those after `-m open_clip_train.main --`."""
    i = cmd.index('open_clip_train.main')
    assert cmd[i - 1] == '-m' and cmd[i + 1] == '--', cmd
    return cmd[i + 2:]


@pytest.fixture
def fake_scontrol(tmp_path):
    """An `scontrol` that expands the node list the way Slurm does for 'gpu[07-08]'."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    script = bin_dir / 'scontrol'
    # and 'big[1-20000]', a node list longer than a pipe's buffer
    script.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n'
                      '[ "$1 $2 $3" = "show hostnames big[1-20000]" ] && exec seq -f "big%05g" 20000\nexit 0\n')
    script.chmod(0o755)
    return bin_dir


def test_slurm_train_runs_one_torchrun_per_node_with_a_c10d_rendezvous(fake_scontrol):
    cmd = printed_command('slurm_train.sbatch', '--lr', '1e-3', path_prefix=fake_scontrol,
                          SLURM_JOB_NODELIST='gpu[07-08]', SLURM_NNODES='2', SLURM_JOB_ID='4242',
                          SLURM_GPUS_ON_NODE='4', LOSS='drrho', REF_FEATURES='/feat', TRAIN_DATA='/d/{0..9}.tar')
    torchrun = cmd.index('torchrun')
    assert cmd[0] == 'srun' and option(cmd[:torchrun], '--nodes') == '2'
    assert option(cmd[:torchrun], '--ntasks-per-node') == '1'
    launcher = cmd[torchrun:cmd.index('open_clip_train.main')]
    assert option(launcher, '--nnodes') == '2' and option(launcher, '--nproc_per_node') == '4'
    assert option(launcher, '--rdzv_backend') == 'c10d' and option(launcher, '--rdzv_id') == '4242'
    host, port = option(launcher, '--rdzv_endpoint').split(':')
    assert host == 'gpu07' and 1024 <= int(port) < 65536  # a port that was free on the node the script ran on
    args = training_args(cmd)
    assert option(args, '--loss') == 'drrho' and option(args, '--ref-features') == '/feat'
    assert option(args, '--resume') == 'latest' and '--save-most-recent' in args
    assert option(args, '--train-data') == '/d/{0..9}.tar'
    assert '--logs' in args and option(args, '--name') == 'drrho-ViT-B-16'  # a fixed name: the run to resume
    assert args[-2:] == ['--lr', '1e-3']  # the script's arguments come last, so they win


def test_slurm_train_does_not_rendezvous_on_a_port_another_job_listens_on(fake_scontrol):
    """Two jobs sharing the first node: a port derived from the job id (29500 + id % 1000) was the same for job ids
    a thousand apart, and the second job's rendezvous failed to bind it."""
    listening = socket.socket()
    for port in range(29500, 30500):  # one the former rule would pick for some job id
        try:
            listening.bind(('', port))
            break
        except OSError:
            continue
    listening.listen()
    with listening:
        cmd = printed_command('slurm_train.sbatch', path_prefix=fake_scontrol, SLURM_JOB_NODELIST='gpu[07-08]',
                              SLURM_NNODES='2', SLURM_JOB_ID=str(1000 + port - 29500))
        chosen = int(option(cmd, '--rdzv_endpoint').split(':')[1])
        assert chosen != port
        with socket.socket() as probe:
            probe.bind(('', chosen))  # free on this node


def test_slurm_train_takes_the_first_node_of_a_long_node_list(fake_scontrol):
    """`scontrol ... | head -n 1` under pipefail: scontrol, killed by SIGPIPE, ended the job with status 141."""
    cmd = printed_command('slurm_train.sbatch', path_prefix=fake_scontrol, SLURM_JOB_NODELIST='big[1-20000]',
                          SLURM_NNODES='20000', SLURM_JOB_ID='7')
    assert option(cmd, '--rdzv_endpoint').split(':')[0] == 'big00001'


@pytest.mark.parametrize('script', ['torchrun_train.sh', 'slurm_train.sbatch'])
def test_train_args_over_several_lines_and_empty(script):
    """TRAIN_ARGS over several lines lost every line after the first; set empty, it still gave the defaults."""
    args = training_args(printed_command(script, TRAIN_ARGS='--batch-size 4\n    --epochs 3 --lr 5e-4\n'))
    assert args[-6:] == ['--batch-size', '4', '--epochs', '3', '--lr', '5e-4']
    assert '--precision' not in args
    args = training_args(printed_command(script, TRAIN_ARGS=''))
    assert not {'--batch-size', '--precision', '--epochs'} & set(args)
    assert option(training_args(printed_command(script)), '--precision') == 'amp_bf16'  # unset: the script's


def test_slurm_train_dry_run_outside_slurm_and_a_loss_without_reference():
    cmd = printed_command('slurm_train.sbatch', LOSS='sogclr', REF_FEATURES='', SAMPLE_INDEX='/index',
                          MASTER_PORT='29400')
    assert option(cmd, '--rdzv_endpoint') == 'MASTER_NODE:29400'  # a port given is the port used
    args = training_args(cmd)
    assert option(args, '--loss') == 'sogclr' and '--ref-features' not in args
    assert option(args, '--sample-index') == '/index'


def test_slurm_train_refuses_to_run_outside_a_job():
    result = run_script('slurm_train.sbatch', dry_run=False)
    assert result.returncode == 1 and 'not inside a SLURM job' in result.stderr and not result.stdout


def test_torchrun_train_is_standalone():
    cmd = printed_command('torchrun_train.sh', NPROC='2', LOSS='fastclip', REF_FEATURES='', NAME='run7')
    assert cmd[:3] == ['torchrun', '--standalone', '--nproc_per_node=2']
    args = training_args(cmd)
    assert option(args, '--loss') == 'fastclip' and option(args, '--resume') == 'latest'
    assert '--save-most-recent' in args
    assert option(args, '--name') == 'run7' and '--logs' in args and '--ref-features' not in args
    assert '--sample-index' not in args  # only when SAMPLE_INDEX is set


@pytest.mark.parametrize('script', ['torchrun_train.sh', 'slurm_train.sbatch'])
@pytest.mark.parametrize('where', ['arguments', 'TRAIN_ARGS'])
def test_remote_sync_drops_save_most_recent_which_openclips_remote_resume_cannot_take(script, where, fake_scontrol):
    """--save-most-recent, a store_true flag, could not be taken back by an argument, so --remote-sync stopped every
    rank at start-up."""
    remote = ['--remote-sync', 's3://bucket/runs']
    settings = dict(SLURM_JOB_NODELIST='gpu[07-08]', SLURM_NNODES='2', SLURM_JOB_ID='7')
    arguments, extra = (remote, {}) if where == 'arguments' else ([], {'TRAIN_ARGS': ' '.join(remote)})
    args = training_args(printed_command(script, *arguments, path_prefix=fake_scontrol, **settings, **extra))
    assert option(args, '--remote-sync') == 's3://bucket/runs' and '--save-most-recent' not in args
    args = training_args(printed_command(script, '--remote-sync-protocol', 's3', path_prefix=fake_scontrol,
                                        **settings))
    assert '--save-most-recent' in args and option(args, '--resume') == 'latest'


@pytest.mark.parametrize('script', ['torchrun_train.sh', 'slurm_train.sbatch'])
def test_an_empty_sample_count_lets_openclip_read_the_shards_sizes(script):
    """TRAIN_NUM_SAMPLES set empty, as the scripts say, drops --train-num-samples (unset: the script's example)."""
    assert '--train-num-samples' not in training_args(printed_command(script, TRAIN_NUM_SAMPLES=''))
    assert option(training_args(printed_command(script, TRAIN_NUM_SAMPLES='1000')), '--train-num-samples') == '1000'
    assert '--train-num-samples' in training_args(printed_command(script))


@pytest.mark.parametrize('script', ['torchrun_train.sh', 'torchrun_precompute.sh'])
def test_one_process_per_gpu_without_a_gpu_says_what_to_set(script):
    """NPROC's default, one process per visible GPU, with none visible: torchrun's own message was a traceback."""
    result = run_script(script, dry_run=False, CUDA_VISIBLE_DEVICES='')
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.strip() == ("NPROC=gpu starts one process per visible GPU, and none is visible: set NPROC to "
                                     "the number of processes (without a GPU, e.g. NPROC=2)")


@pytest.mark.parametrize('script', ['torchrun_train.sh', 'slurm_train.sbatch'])
def test_the_default_run_name_is_one_folder_for_any_model_name(script):
    for model, name in (('ViT-B-16', 'drrho-ViT-B-16'),
                        ('hf-hub:timm/ViT-B-16-SigLIP', 'drrho-hf-hub-timm-ViT-B-16-SigLIP'),
                        ('local-dir:/models/tiny', 'drrho-local-dir--models-tiny')):
        args = training_args(printed_command(script, MODEL=model))
        assert option(args, '--model') == model and option(args, '--name') == name


@pytest.mark.parametrize('script', ['torchrun_precompute.sh', 'slurm_precompute.sbatch'])
def test_precompute_reads_the_reference_model_from_its_own_variables(script):
    # MODEL is the training scripts' model trained: set for one job, it must not change another's reference
    env = dict(SLURM_ARRAY_TASK_ID=0, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_COUNT=2)
    cmd = printed_command(script, MODEL='ViT-L-14', PRETRAINED='x', **env)
    assert option(cmd, '--model') == 'ViT-B-32' and option(cmd, '--pretrained') == 'openai'
    cmd = printed_command(script, REF_MODEL='ViT-L-14', REF_PRETRAINED='dfn2b', **env)
    assert option(cmd, '--model') == 'ViT-L-14' and option(cmd, '--pretrained') == 'dfn2b'


@pytest.mark.parametrize('script', ['torchrun_train.sh', 'slurm_train.sbatch'])
def test_train_scripts_pass_openclips_loss_options_only_to_the_losses_that_read_them(script):
    # a loss given --local-loss/--gather-with-grad that it does not read warns at start-up: the default LOSS=drrho
    # must not, and clip must still get OpenCLIP's memory-saving setting
    for name in list_losses():
        args = training_args(printed_command(script, LOSS=name, REF_FEATURES=''))
        reads = {'local_loss', 'gather_with_grad'} <= set(get_loss_spec(name).run_options)
        assert ('--local-loss' in args and '--gather-with-grad' in args) == reads, name


ARRAY_TASK = dict(SLURM_ARRAY_TASK_ID='5', SLURM_ARRAY_TASK_MIN='1', SLURM_ARRAY_TASK_COUNT='8')


@pytest.mark.parametrize('env, part, parts', [
    (dict(SLURM_ARRAY_TASK_ID='3', SLURM_ARRAY_TASK_MIN='0', SLURM_ARRAY_TASK_COUNT='8'), 3, 8),
    (ARRAY_TASK, 4, 8),
    # the tasks of an `srun -n 2` inside it split its part (the script gave both the array task's part)
    ({**ARRAY_TASK, 'SLURM_STEP_NUM_TASKS': '2', 'SLURM_PROCID': '1'}, 9, 16),
    ({}, 0, 1),  # outside an array: everything in one part
])
def test_slurm_precompute_array_task_computes_its_part(env, part, parts, monkeypatch):
    cmd = printed_command('slurm_precompute.sbatch', '--dtype', 'int8', OUTPUT='/feat', DTYPE='float16', **env)
    assert cmd[0] == 'drrho-openclip-features' and option(cmd, '--output') == '/feat'
    assert option(cmd, '--dtype') == 'int8'  # the script's arguments win
    for name in [name for name in os.environ if name.startswith('SLURM_') or name in ('WORLD_SIZE', 'RANK')]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = precompute.parse_args(cmd[1:])  # as the command reads its environment in the job
    assert (args.part, args.num_parts) == (part, parts)


def test_torchrun_precompute_computes_one_part_per_rank(shapes, tmp_path):
    urls = write_shards(tmp_path, shapes['csv'])
    checkpoint = write_checkpoint(shapes['model'], tmp_path / 'tiny.pt')
    settings = dict(REF_MODEL=shapes['model'], REF_PRETRAINED=checkpoint, TRAIN_DATA=urls, OUTPUT=tmp_path / 'ref',
                    NPROC=2, BATCH_SIZE=4, WORKERS=0)
    cmd = printed_command('torchrun_precompute.sh', '--device', 'cpu', **settings)
    assert cmd[:3] == ['torchrun', '--standalone', '--nproc_per_node=2']
    assert cmd[3:6] == ['-m', 'drrho_openclip.precompute', '--'] and option(cmd, '--output') == str(tmp_path / 'ref')

    result = run_script('torchrun_precompute.sh', '--device', 'cpu', dry_run=False, **settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'part 0/2: 2 of 5 shards' in result.stderr and 'part 1/2: 3 of 5 shards' in result.stderr
    assert result.stderr.count('wrote reference features of') == 1  # one rank finished the store
    store = FeatureStore.open(tmp_path / 'ref')
    assert [s.count for s in store.shards] == list(SIZES)
    assert precompute.main(['verify', tmp_path / 'ref', '--train-data', urls]) == 0  # every sample, unit-norm
