import atexit
import contextlib
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

from drrho_openclip.demo import make_split, write_tiny_model
from drrho_openclip.features import FeatureStoreWriter, shard_name


@pytest.fixture(scope='session')
def shapes(tmp_path_factory):
    """64 drawn image-caption pairs (CSV), a tiny model config and a matching reference-feature store."""
    root = tmp_path_factory.mktemp('shapes')
    csv = make_split(root, 'train', 64, seed=0)
    model = write_tiny_model(root / 'tiny')
    paths = [line.split('\t')[0] for line in csv.read_text().splitlines()[1:]]
    rng = np.random.default_rng(0)
    features = rng.normal(size=(2, len(paths), 16))
    features /= np.linalg.norm(features, axis=-1, keepdims=True)
    writer = FeatureStoreWriter(root / 'ref', model='test', pretrained='', dim=16)
    writer.add_shard(shard_name(csv), paths, features[0], features[1])
    writer.close()
    return dict(root=root, csv=csv, model=model, ref=root / 'ref')


@pytest.fixture(scope='session')
def shards(shapes, tmp_path_factory):
    """The 64 shapes in 4 tar shards, keyed by arbitrary strings (not img2dataset's shard*10000+i arithmetic)."""
    root = tmp_path_factory.mktemp('wds')
    rows = [line.split('\t') for line in shapes['csv'].read_text().splitlines()[1:]]
    for s in range(4):
        with tarfile.open(root / f'part-{s}.tar', 'w') as tar:
            for i, (path, title, _) in enumerate(rows[s * 16:(s + 1) * 16]):
                key = f'sample_{s}_{i:02d}_x'
                tar.add(path, arcname=f'{key}.png')
                caption = root / f'{key}.txt'
                caption.write_text(title)
                tar.add(caption, arcname=f'{key}.txt')
    features = root / 'ref'
    result = subprocess.run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', shapes['model'],
                             '--train-data', str(root / 'part-{0..3}.tar'), '--output', str(features),
                             '--batch-size', '5', '--workers', '0'], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr
    return dict(urls=str(root / 'part-{0..3}.tar'), ref=features, root=root)


def train_args(shapes, logs, name, *extra, batch_size=8, epochs=1):
    return ['--train-data', shapes['csv'], '--dataset-type', 'csv', '--csv-separator', '\t',
            '--csv-img-key', 'filepath', '--csv-caption-key', 'title', '--model', shapes['model'],
            '--batch-size', batch_size, '--epochs', epochs, '--lr', '1e-3', '--wd', '0.1', '--warmup', '2',
            '--workers', '0', '--precision', 'fp32', '--device', 'cpu', '--seed', '0', '--logs', logs,
            '--name', name, '--save-frequency', '1', *extra]


def openclip_command(args, nproc=1, start_method=None):
    args = [str(a) for a in args]
    if start_method is not None:  # one process whose loader workers start this way ('forkserver', 'spawn')
        assert nproc == 1
        main = (f"import multiprocessing, runpy; multiprocessing.set_start_method({start_method!r}, force=True); "
                f"runpy.run_module('open_clip_train.main', run_name='__main__')")
        return [sys.executable, '-c', main, *args]
    if nproc == 1:
        return [sys.executable, '-m', 'open_clip_train.main', *args]
    # `--` keeps torchrun from reading --logs as an abbreviation of its own options
    return [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
            '-m', 'open_clip_train.main', '--', *args]


ENV = {**os.environ, 'OMP_NUM_THREADS': '1'}


def _descendants(pid: int) -> list:
    """Every process started by `pid`, its children's children included (Linux: read from /proc)."""
    children = {}
    for stat in Path('/proc').glob('[0-9]*/stat'):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rsplit(')', 1)[1].split()[1])  # after the command name, which may hold ')'
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        started = children.get(todo.pop(), [])
        found += started
        todo += started
    return found


def kill_process_tree(process: subprocess.Popen) -> list:
    """SIGKILL a process and everything it started, as a crash or a node failure ends a run; returns the pids killed.
    torchrun starts its workers in sessions of their own, so killing its process group left them training, and
    writing the checkpoints a resume test was meant to recompute."""
    pids = [process.pid, *_descendants(process.pid)]  # all found first: the agent could otherwise restart workers
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    return pids


# One process per run, as `python -m open_clip_train.main` starts, but forked from a server that imported OpenCLIP's
# trainer once: importing it (torch, torchvision, transformers, timm) is about 5 s of each run on a small machine.
# The server imports and computes nothing else, so each fork starts as a fresh interpreter would, the plugin's hooks
# installed by its .pth as they are at any start.
_TRAINERS = multiprocessing.get_context('forkserver')
_TRAINERS.set_forkserver_preload(['open_clip_train.main'])


def _openclip_main(args, cwd, env, stdout, stderr):
    """In a forked process: `python -m open_clip_train.main ARGS` in `cwd`, with `env` and its output in two files."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    import torch
    torch.set_num_threads(int(env['OMP_NUM_THREADS']))  # read by OpenMP as torch loaded, in the server
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ['open_clip_train.main', *args]
    del sys.modules['open_clip_train.main']  # run as __main__ alone, as -m runs it
    try:
        runpy.run_module('open_clip_train.main', run_name='__main__', alter_sys=True)
    finally:  # the interpreter's exit, which a forked process skips: TensorBoard's writer and logging flush here
        atexit._run_exitfuncs()


class TrainerProcess:
    """A run started by `start_openclip`, as much of subprocess.Popen as the tests use."""

    def __init__(self, args, cwd, output: Path):
        output.mkdir(parents=True, exist_ok=True)
        self.stdout, self.stderr = output / 'stdout', output / 'stderr'
        self.process = _TRAINERS.Process(target=_openclip_main,
                                         args=([str(a) for a in args], cwd, dict(ENV), self.stdout, self.stderr))
        self.process.start()
        self.pid = self.process.pid

    def poll(self):
        return self.process.exitcode

    def kill(self):
        self.process.kill()

    def wait(self):
        self.process.join()
        return self.process.exitcode


def start_openclip(args, output: Path, cwd=None) -> TrainerProcess:
    """Starts `python -m open_clip_train.main ARGS` with its stdout and stderr in files under `output`."""
    return TrainerProcess(args, cwd, output)


def run_openclip(args, nproc=1, cwd=None, check=True, start_method=None):
    """`python -m open_clip_train.main ARGS` (or torchrun with `nproc` gloo ranks, or one process whose loader
    workers are started by `start_method`); returns the CompletedProcess."""
    cmd = openclip_command(args, nproc, start_method)
    if nproc == 1 and start_method is None:
        process = start_openclip(args, Path(tempfile.mkdtemp(prefix='openclip_run_')), cwd)
        returncode = process.wait()
        result = subprocess.CompletedProcess(cmd, returncode, process.stdout.read_text(errors='replace'),
                                             process.stderr.read_text(errors='replace'))
        shutil.rmtree(process.stdout.parent)
    else:
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=ENV)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def refused_at_parsing(args, capsys) -> str:
    """What OpenCLIP's parser, with the plugin's checks, says as it refuses `args` with argparse's status 2: in this
    process, as `open_clip_train.main` parses its flags first, before it creates the run's folder or builds a model
    (the subprocess runs elsewhere show the same through the console command)."""
    from open_clip_train.params import parse_args
    with pytest.raises(SystemExit) as stop:
        parse_args([str(a) for a in args])
    said = capsys.readouterr().err
    assert stop.value.code == 2, (stop.value, said)
    return said


def _gloo_rank(rank, world_size, compute, out_dir):
    import torch
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f"file://{Path(out_dir) / 'store'}", rank=rank,
                            world_size=world_size)
    torch.set_num_threads(1)
    torch.save(compute(rank, world_size), Path(out_dir) / f'rank{rank}.pt')
    dist.barrier()  # no rank leaves while another is still in a collective
    # The results are on disk; leave without tearing the group down or finalizing the interpreter. torch 2.6's
    # destroy_process_group hung now and then (4 of 30 runs of one test here): the gloo group's destructor joins
    # its worker thread while holding the GIL, and that thread may still be freeing a finished collective's
    # tensors, which needs the GIL. And after torch.distributed.nn's all_gather (OpenCLIP's gather with gradient),
    # torch 2.14's teardown at exit aborts now and then (SIGABRT, "terminate called without an active exception":
    # 9 of 50 two-rank runs here). Either would fail a test whose results are correct. A rank that fails before
    # this line still raises (mp.spawn then stops the others), and its missing file fails the test.
    os._exit(0)


def on_gloo_ranks(compute, world_size, out_dir):
    """[compute(rank, world_size) for each rank], each run in its own process of a gloo group of `world_size`;
    `compute` is a module-level function (the processes are spawned)."""
    import torch
    import torch.multiprocessing as mp
    mp.spawn(_gloo_rank, args=(world_size, compute, str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(Path(out_dir) / f'rank{rank}.pt') for rank in range(world_size)]


def checkpoint(logs, name, epoch):
    import torch
    return torch.load(Path(logs) / name / 'checkpoints' / f'epoch_{epoch}.pt', map_location='cpu')


def loss_tensors(saved: dict) -> dict:
    """A checkpoint's loss state without the run it records (a dict; see openclip/checkpoints.py): the loss's
    own entries ({} for a loss without state)."""
    from drrho_openclip.openclip.checkpoints import RUN_KEY
    return {k: v for k, v in saved.get('loss_state', {}).items() if k != RUN_KEY}


def without_dropout(loss):
    """TempNet's dropout off (its networks in eval mode) in a loss that still trains (`loss.eval()` would stop its
    learning): copies compute alike, and a float64 reference needs no masks. Returns the loss."""
    from drrho_openclip.losses.temperatures import TempNet
    for module in loss.modules():
        if isinstance(module, TempNet):
            module.eval()
    return loss


def assert_same(a, b, **tol):
    """Equal, bit for bit unless a tolerance is given; NaN where both hold it (a per-sample table marks an unvisited
    sample so). Not for a model's weights: `assert_same_weights`."""
    import torch
    torch.testing.assert_close(a, b, equal_nan=True, **(tol or dict(rtol=0, atol=0)))


def assert_same_weights(a, b, prefix='', **tol):
    """Two checkpoints' models equal (`prefix`: b's DDP 'module.'), bit for bit unless a tolerance is given, and
    finite: two runs that both diverged to NaN are not the same run."""
    import torch
    assert a['state_dict'].keys() == {k.removeprefix(prefix) for k in b['state_dict']}
    for key, value in a['state_dict'].items():
        assert not value.is_floating_point() or torch.isfinite(value).all(), f"{key} is not finite"
        torch.testing.assert_close(value, b['state_dict'][prefix + key], **(tol or dict(rtol=0, atol=0)))


# Plain SGD for the equivalence runs: Adam divides by √v, which turns float rounding in near-zero gradients into
# lr-sized steps, so it cannot tell a real difference from summation order. No weight decay: timm reads the
# model's no-weight-decay list, which a DDP wrapper hides, so one rank and two ranks would decay differently.
SGD = ('--opt', 'timm/sgd', '--momentum', '0.9', '--lr', '0.2', '--wd', '0')


def assert_equivalent_runs(a, b, prefix='', atol=1e-5):
    """Two runs' checkpoints (model and the loss's state) equal to float32 rounding."""
    import torch
    assert_same_weights(a, b, prefix, rtol=1e-4, atol=atol)
    a_state, b_state = loss_tensors(a), loss_tensors(b)
    assert a_state.keys() == b_state.keys()  # none for a loss without state
    for key in a_state:
        # log u is ℓ̂/τ-sized (hundreds at τ = 0.01): float32 rounding of the features is amplified 1/τ times
        assert_same(a_state[key], b_state[key], rtol=1e-3, atol=1e-3)
        assert torch.isfinite(a_state[key]).all()
