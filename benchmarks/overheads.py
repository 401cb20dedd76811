"""What the plugin's losses cost on top of OpenCLIP's own: loss time, training-step time and peak memory, as ratios.

    python benchmarks/overheads.py                 # CPU: global batch 256, 1024, 4096; d = 512 (about 10 minutes)
    python benchmarks/overheads.py --smoke         # tiny batches, two losses' memory, one training pair (seconds)
    python benchmarks/overheads.py --device cuda   # GPU: bf16 autocast, global batch 256 … 32768
    python benchmarks/overheads.py --device cuda --sizes 16384 32768 --losses drrho adnce --train-repeats 0
                                                   # GPU: two losses against ClipLoss, no training step
    python benchmarks/overheads.py --device cuda --precision fp32 --train-model ViT-B-32 --train-batch 4096 \
        --grad-checkpointing                       # GPU: float32 losses; a ViT-B-32 training step

Writes `benchmarks/results/overheads[_smoke|_cuda].json` and `.md`. CPU measurements use `--threads` torch threads
(default 1, in every measured process): on a shared, oversubscribed CPU, OpenMP's barriers stall small operations by
whole scheduler time slices, which would swamp the differences measured here.

1. Loss forward + backward, world size 1 (local batch = global batch), of every registered loss (`list_losses()`,
   or those named by `--losses`) and of `open_clip.loss.ClipLoss` (the yardstick; the registered `clip` is the same
   class, a sanity check), on unit-norm features of dimension d with `requires_grad`, float32 on CPU, on CUDA bf16
   under autocast (what a model under `--precision amp_bf16` hands its loss) or float32 with `--precision fp32`. Each
   loss gets what it reads in training: the sample index (0..B−1) when stateful, reference features (unit-norm,
   dimension d) when its spec requires them; per-sample tables are sized B; tempnet gets embed_dim = d.
   Time: every loss is built once and called once (warm-up); then `--repeats` rounds, each calling every loss once
   in an order rotated from round to round (interleaved, so slow drift of a shared machine hits all alike). The
   ratio of a loss is computed per round (its time / ClipLoss's time in that round) and reported as the median and
   [min, max] over rounds; absolute times are medians.
2. Training step, `--loss drrho --ref-features` vs `--loss clip`, same model (the demo's tiny CLIP, or
   `--train-model`, randomly initialised), batch and
   data (the demo's shapes; features of a randomly initialised reference, which costs the same as a trained one),
   through OpenCLIP's own `open_clip_train.main`, each run in a fresh process, the two alternating for
   `--train-repeats` rounds. Step time is OpenCLIP's logged `Batch (t)` of every step (`--log-every-n-steps 1`;
   read with full precision as batch / logged samples-per-second), the first `WARMUP_STEPS` of each run dropped;
   it includes data loading (workers 0 on CPU: the reference-feature lookup is part of drrho's cost). Also
   reported: the compute part, `Batch (t) − Data (t)`.
3. Peak memory, of the same pairs. Every loss x batch size runs in its own fresh process, so nothing one
   configuration allocated, or the allocator kept, leaks into another's number. CPU: after the inputs and the
   loss are built (and a tiny warm-up call has loaded the kernels), the kernel's resident-set high-water mark is
   reset (`5` written to /proc/self/clear_refs); after forward + backward, VmHWM (/proc/self/status) minus the
   resident memory just before is the memory the step needed on top of its inputs. If clear_refs cannot be
   written, ru_maxrss (peak since process start) is used instead and the JSON says so. Training runs: the same, with
   the reset after the imports, so the peak covers model, optimizer, data loader, feature store and loss state.
   CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus the memory allocated before.
"""
import argparse
import ast
import concurrent.futures
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tiled_memory import device_name

HERE = Path(__file__).resolve().parent
BASELINE = 'ClipLoss'  # open_clip.loss.ClipLoss, the yardstick
SIZES = {'cpu': [256, 1024, 4096], 'cuda': [256, 1024, 4096, 16384, 32768], 'smoke': [32, 64]}
WARMUP_STEPS = 2
# CUDA: data-loading processes of the training step and of its features' precompute (224 px decoding)
TRAIN_WORKERS = 8
# drrho's targets (the GPU issue's): loss time vs ClipLoss, training step vs --loss clip
GOALS = {'loss': 1.0, 'step': 1.03}


# ---- memory ------------------------------------------------------------------------------------------------------

def _status_bytes(field):
    return int(re.search(rf'{field}:\s+(\d+) kB', Path('/proc/self/status').read_text()).group(1)) * 1024


class PeakMemory:
    """Peak memory of a region of this process, on top of what was in use when `start()` was called."""

    def __init__(self, device):
        self.cuda = device.startswith('cuda')

    def start(self):
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.method, self.base = 'torch.cuda.max_memory_allocated', torch.cuda.memory_allocated()
            return
        self.base = _status_bytes('VmRSS')
        try:
            Path('/proc/self/clear_refs').write_text('5')
            self.method = 'VmHWM after /proc/self/clear_refs reset, minus VmRSS before'
        except OSError:
            self.method = 'ru_maxrss (peak since process start), minus VmRSS before'

    def peak(self) -> int:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        high = _status_bytes('VmHWM') if self.method.startswith('VmHWM') else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return high - self.base


# ---- losses ------------------------------------------------------------------------------------------------------

def loss_and_options(spec: str):
    """'NAME' or 'NAME:OPTION=VALUE,...' (e.g. drrho:column_step=True, to set one option against the defaults):
    the registered name and create_loss's keyword arguments, values as Python literals."""
    name, _, listed = spec.partition(':')
    options = dict(item.split('=', 1) for item in listed.split(',') if item)
    return name, {key: ast.literal_eval(value) for key, value in options.items()}


class LossCase:
    """One loss with its inputs at global batch B: `run()` is one forward + backward."""

    def __init__(self, name, batch, dim, device, precision='bf16', seed=0):
        import torch
        import torch.nn.functional as F
        from drrho_openclip.losses import create_loss, get_loss_spec
        self.name, self.device = name, device
        self.dtype = torch.bfloat16 if device.startswith('cuda') and precision == 'bf16' else torch.float32
        g = torch.Generator(device='cpu').manual_seed(seed)
        unit = lambda: F.normalize(torch.randn(batch, dim, generator=g), dim=-1).to(device, self.dtype)
        self.image, self.text = unit().requires_grad_(), unit().requires_grad_()
        self.log_scale = torch.tensor(math.log(1 / 0.07), device=device, requires_grad=True)
        self.extras = {}
        if name == BASELINE:
            from open_clip.loss import ClipLoss
            self.loss = ClipLoss(cache_labels=True)  # as open_clip.create_loss builds it for training
        else:
            name, chosen = loss_and_options(name)
            spec = get_loss_spec(name)
            options = dict(num_samples=batch) if spec.stateful else {}
            if 'embed_dim' in spec.run_options:
                options['embed_dim'] = dim
            self.loss = create_loss(name, **options, **chosen).to(device)
            if hasattr(self.loss, 'set_total_steps'):
                self.loss.set_total_steps(1000)  # a run's length: only a learned τ's step size depends on it
            if spec.stateful:
                self.extras['index'] = torch.arange(batch, device=device)
            if spec.reference == 'required':
                self.extras['ref_image_features'], self.extras['ref_text_features'] = unit(), unit()
        self.leaves = [self.image, self.text, self.log_scale, *self.loss.parameters()]

    def run(self):
        import torch
        for t in self.leaves:
            t.grad = None
        with torch.autocast(self.device.split(':')[0], dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            out = self.loss(self.image, self.text, self.log_scale.exp(), output_dict=True, **self.extras)
            total = sum(out.values())
        total.backward()
        if self.device.startswith('cuda'):
            torch.cuda.synchronize()


def time_losses(names, sizes, dim, device, precision, repeats):
    """{B: {name: [seconds per round]}}, interleaved rounds (see the module docstring)."""
    times = {}
    for batch in sizes:
        cases = [LossCase(n, batch, dim, device, precision) for n in names]
        for case in cases:
            case.run()
        times[batch] = {n: [] for n in names}
        for r in range(repeats):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                start = time.perf_counter()
                case.run()
                times[batch][case.name].append(time.perf_counter() - start)
        print(f"  loss time, B={batch}: " + ', '.join(f"{n} {statistics.median(t) * 1e3:.1f} ms"
                                                      for n, t in times[batch].items()), flush=True)
        del cases
    return times


def memory_worker(name, batch, dim, device, precision):
    """In a fresh process: the peak memory of one forward + backward of one loss."""
    LossCase(name, 8, dim, device, precision).run()  # loads the kernels outside the measured region
    case = LossCase(name, batch, dim, device, precision, seed=1)
    tracker = PeakMemory(device)
    tracker.start()
    case.run()
    print(json.dumps(dict(peak_bytes=tracker.peak(), method=tracker.method)))


def in_fresh_process(*args) -> dict:
    import torch
    env = {**os.environ, 'OMP_NUM_THREADS': str(torch.get_num_threads())}  # the parent's --threads
    result = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- training steps ----------------------------------------------------------------------------------------------

STEP_LINE = re.compile(r'Data \(t\): ([\d.]+) Batch \(t\): [\d.]+, ([\d.e+]+)/s')


def train_worker(argv_json):
    """In a fresh process: one OpenCLIP training run in-process; the peak memory after the imports."""
    from drrho_openclip.openclip import install_import_hook
    install_import_hook()
    import open_clip_train.main  # noqa: F401 - imported before the measured region
    from drrho_openclip.train import main as train
    argv = json.loads(argv_json)
    tracker = PeakMemory(argv[argv.index('--device') + 1])
    tracker.start()
    train(argv)
    print(json.dumps(dict(peak_bytes=tracker.peak(), method=tracker.method)))


def step_times(log_file: Path, batch):
    """(whole step, compute only) seconds of each logged step after the warm-up: Batch (t) from samples/s."""
    steps = [(batch / float(sps), float(data)) for data, sps in STEP_LINE.findall(log_file.read_text())]
    return [(t, t - d) for t, d in steps[WARMUP_STEPS:]]


def prepare_training(work: Path, samples, device, model=None):
    from drrho_openclip.demo import make_split, write_tiny_model
    csv = make_split(work / 'data', 'train', samples, seed=0)
    model = model or write_tiny_model(work / 'tiny_model')
    features = work / 'ref_features'
    from drrho_openclip.precompute import main as precompute
    precompute(['--model', model, '--train-data', str(csv), '--output', str(features),
                '--workers', str(TRAIN_WORKERS if device.startswith('cuda') else 0),
                '--device', device])
    return csv, model, features


def time_training(work, samples, batch, repeats, device, model=None, grad_checkpointing=False):
    csv, model, features = prepare_training(work, samples, device, model)
    cuda = device.startswith('cuda')
    configs = {'clip': [], 'drrho': ['--loss', 'drrho', '--ref-features', features]}
    results = {c: dict(step=[], compute=[], peak_bytes=[]) for c in configs}
    for r in range(repeats):
        for config in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            name = f'{config}-{r}'
            argv = ['--train-data', csv, '--dataset-type', 'csv', '--csv-separator', '\t', '--csv-img-key',
                    'filepath', '--csv-caption-key', 'title', '--model', model, '--batch-size', batch,
                    '--epochs', 1, '--lr', '1e-3', '--warmup', 2, '--workers', TRAIN_WORKERS if cuda else 0,
                    '--precision', 'amp_bf16' if cuda else 'fp32', '--device', device, '--seed', 0,
                    '--logs', work / 'logs', '--name', name, '--save-frequency', 0, '--log-every-n-steps', 1,
                    *(['--grad-checkpointing'] if grad_checkpointing else []), *configs[config]]
            out = in_fresh_process('--train-worker', json.dumps([str(a) for a in argv]))
            steps = step_times(work / 'logs' / name / 'out.log', batch)
            results[config]['step'] += [s for s, _ in steps]
            results[config]['compute'] += [c for _, c in steps]
            results[config]['peak_bytes'].append(out['peak_bytes'])
            results['memory_method'] = out['method']
            print(f"  training step {config} (round {r + 1}/{repeats}): median "
                  f"{statistics.median(s for s, _ in steps) * 1e3:.1f} ms over {len(steps)} steps, peak "
                  f"{out['peak_bytes'] / 2 ** 20:.0f} MiB", flush=True)
    return results


# ---- report ------------------------------------------------------------------------------------------------------

def spread(values):
    """median, and [min, max]"""
    return statistics.median(values), min(values), max(values)


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[1], q[2]


def summarize(loss_times, loss_memory, training):
    summary = {'loss': {}, 'training': {}}
    for batch, per_loss in loss_times.items():
        base = per_loss[BASELINE]
        for name, times in per_loss.items():
            entry = dict(median_ms=statistics.median(times) * 1e3,
                         ratio=spread([t / b for t, b in zip(times, base)]))
            memory = loss_memory.get(batch, {})
            if name in memory:
                entry['peak_mib'] = memory[name] / 2 ** 20
                entry['memory_ratio'] = memory[name] / memory[BASELINE] if memory.get(BASELINE) else None
            summary['loss'].setdefault(str(batch), {})[name] = entry
    if training:
        clip = training['clip']
        for config in ('clip', 'drrho'):
            r = training[config]
            summary['training'][config] = dict(
                step_ms=[q * 1e3 for q in quartiles(r['step'])], compute_ms=[q * 1e3 for q in quartiles(r['compute'])],
                step_ratio=statistics.median(r['step']) / statistics.median(clip['step']),
                compute_ratio=statistics.median(r['compute']) / statistics.median(clip['compute']),
                peak_mib=statistics.median(r['peak_bytes']) / 2 ** 20,
                memory_ratio=statistics.median(r['peak_bytes']) / statistics.median(clip['peak_bytes']))
    return summary


def markdown(report) -> str:
    s, c = report['summary'], report['config']
    lines = [f"# Overheads vs OpenCLIP ({c['device_name']})", '',
             f"{report['machine']}. d = {c['dim']}, world size 1, "
             f"{'bf16 autocast' if c['cuda'] and c.get('precision') == 'bf16' else 'float32'}. "
             f"Loss: median of {c['repeats']} interleaved rounds; ratio = per-round time / ClipLoss's time in the "
             f"same round, median [min–max]. Memory: {report['loss_memory_method']}, each configuration in a "
             f"fresh process.", '',
             '| global batch | loss | fwd+bwd ms | × ClipLoss time | peak MiB | × ClipLoss memory |',
             '|---:|---|---:|---|---:|---:|']
    for batch, per_loss in s['loss'].items():
        for name, e in per_loss.items():
            mem = (f"{e['peak_mib']:.1f} | {e['memory_ratio']:.2f}" if e.get('memory_ratio') is not None
                   else '– | –')
            lines.append(f"| {batch} | {name} | {e['median_ms']:.1f} | {e['ratio'][0]:.2f} "
                         f"[{e['ratio'][1]:.2f}–{e['ratio'][2]:.2f}] | {mem} |")
    if s['training']:
        t = report['training_config']
        lines += ['', "## Training step: --loss drrho --ref-features vs --loss clip", '',
                  f"{t['model']}, batch {t['batch']}, {t['samples']} shapes per run, {t['repeats']} rounds of fresh "
                  f"processes alternating the two; {t['steps_per_config']} logged steps per configuration after "
                  f"dropping {WARMUP_STEPS} per run. Step = OpenCLIP's Batch (t) (includes data loading, workers "
                  f"{t['workers']}); compute = Batch (t) − Data (t). Quartiles [Q1, median, Q3]. Memory: "
                  f"{report['training_memory_method']}, median over runs.", '',
                  '| config | step ms [Q1, median, Q3] | × clip | compute ms [Q1, median, Q3] | × clip | peak MiB | '
                  '× clip |', '|---|---|---:|---|---:|---:|---:|']
        for config, e in s['training'].items():
            lines.append(f"| {config} | {', '.join(f'{v:.1f}' for v in e['step_ms'])} | {e['step_ratio']:.3f} | "
                         f"{', '.join(f'{v:.1f}' for v in e['compute_ms'])} | {e['compute_ratio']:.3f} | "
                         f"{e['peak_mib']:.0f} | {e['memory_ratio']:.2f} |")
    lines += ['', '## Goals for drrho', ''] + [f"- {g}" for g in report['goals']]
    return '\n'.join(lines) + '\n'


def goals(summary):
    out = []
    for batch, per_loss in summary['loss'].items():
        if 'drrho' in per_loss:
            r = per_loss['drrho']['ratio'][0]
            out.append(f"loss time at B={batch}: {r:.2f}× ClipLoss (goal ≤ {GOALS['loss']}×: "
                       f"{'met' if r <= GOALS['loss'] else 'NOT met'})")
    if summary['training']:
        r = summary['training']['drrho']['step_ratio']
        out.append(f"training step: {r:.3f}× --loss clip (goal ≤ {GOALS['step']}×: "
                   f"{'met' if r <= GOALS['step'] else 'NOT met'})")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cpu', help="'cpu' or 'cuda' (default: %(default)s)")
    p.add_argument('--smoke', action='store_true', help='tiny batches, seconds; for tests')
    p.add_argument('--sizes', type=int, nargs='+', help='global batch sizes of the loss timings')
    p.add_argument('--losses', nargs='+', metavar='LOSS',
                   help='registered losses to time and measure against ClipLoss (default: all of them); '
                        'NAME:OPTION=VALUE,... sets options, e.g. drrho:column_step=True')
    p.add_argument('--dim', type=int, default=512)
    p.add_argument('--threads', type=int, default=1,
                   help='torch threads, here and in every measured process (default: %(default)s: on a shared, '
                        'oversubscribed CPU, OpenMP barriers stall small ops by whole scheduler slices)')
    p.add_argument('--repeats', type=int, default=7, help='interleaved rounds of the loss timings')
    p.add_argument('--precision', choices=('bf16', 'fp32'), default='bf16',
                   help='CUDA loss timings: bf16 features under bf16 autocast, or float32 (default: %(default)s)')
    p.add_argument('--train-batch', type=int, help='training-step batch (default: 256 CPU, 1024 CUDA)')
    p.add_argument('--train-model', default=None,
                   help="OpenCLIP model of the training step, randomly initialised (default: the demo's tiny CLIP)")
    p.add_argument('--grad-checkpointing', action='store_true', help='training step with gradient checkpointing')
    p.add_argument('--train-repeats', type=int, default=3, help='rounds of the training pair (0: no training step)')
    p.add_argument('--memory-sizes', type=int, nargs='*', metavar='B',
                   help='global batch sizes of the peak-memory measurements (default: those of the timings; none: '
                        'no memory measurement)')
    p.add_argument('--memory-losses', nargs='+', metavar='LOSS',
                   help='losses whose peak memory is measured, each against ClipLoss (default: those timed)')
    p.add_argument('--memory-jobs', type=int, default=None,
                   help='memory-measuring processes at a time (default: 1 on CPU, where they would share the cores '
                        'being measured; 3 on CUDA, where each process reads its own allocator statistics)')
    p.add_argument('--output', help='output path without suffix (default: benchmarks/results/overheads[_smoke|_cuda])')
    p.add_argument('--memory-worker', nargs=5, metavar=('LOSS', 'BATCH', 'DIM', 'DEVICE', 'PRECISION'),
                   help=argparse.SUPPRESS)
    p.add_argument('--train-worker', metavar='ARGV_JSON', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_worker:
        name, batch, dim, device, precision = args.memory_worker
        return memory_worker(name, int(batch), int(dim), device, precision)
    if args.train_worker:
        return train_worker(args.train_worker)

    import torch
    from drrho_openclip.losses import list_losses
    cuda = args.device.startswith('cuda')
    if cuda and not torch.cuda.is_available():
        raise SystemExit('--device cuda: no CUDA device')
    mode = 'smoke' if args.smoke else 'cuda' if cuda else 'cpu'
    sizes = args.sizes or SIZES[mode]
    dim = 64 if args.smoke else args.dim
    repeats = 2 if args.smoke else args.repeats
    train_batch = args.train_batch or (16 if args.smoke else 1024 if cuda else 256)
    train_samples = train_batch * (WARMUP_STEPS + (2 if args.smoke else 8))
    train_repeats = min(1, args.train_repeats) if args.smoke else args.train_repeats
    for flag, chosen in (('--losses', args.losses), ('--memory-losses', args.memory_losses)):
        unknown = sorted({c for c in chosen or () if loss_and_options(c)[0] not in list_losses()})
        if unknown:
            p.error(f"{flag}: {', '.join(unknown)} not registered (registered: {', '.join(list_losses())})")
    names = [BASELINE, *dict.fromkeys(args.losses or list_losses())]  # each named once, as given
    # --smoke checks the memory path on the drrho/ClipLoss pair at one size only: each measurement is a process
    memory_losses = args.memory_losses or (['drrho'] if args.smoke else names[1:])
    memory_names = [BASELINE, *dict.fromkeys(memory_losses)]
    memory_sizes = args.memory_sizes if args.memory_sizes is not None else sizes[:1] if args.smoke else sizes
    # the report puts each memory next to its loss's time, as a ratio to ClipLoss's at that batch
    untimed = sorted(set(memory_names) - set(names)) + [f'B={b}' for b in memory_sizes if b not in sizes]
    if untimed:
        p.error(f"--memory-losses/--memory-sizes: {', '.join(untimed)} not timed; the memory is reported beside "
                f"the time: add them to --losses/--sizes")
    torch.set_num_threads(args.threads)  # after the checks: a refused call leaves the caller's threads alone
    start = time.time()

    print(f"[1/3] loss forward+backward time: {len(names)} losses x B {sizes}, d {dim}, {repeats} rounds", flush=True)
    loss_times = time_losses(names, sizes, dim, args.device, args.precision, repeats)
    if cuda:
        torch.cuda.empty_cache()  # this process's cached blocks would otherwise crowd out the measuring processes
    print("[2/3] loss peak memory, one fresh process per configuration", flush=True)
    loss_memory, memory_method = {}, None
    memory_jobs = args.memory_jobs or (3 if cuda else 1)
    for batch in memory_sizes:
        with concurrent.futures.ThreadPoolExecutor(memory_jobs) as pool:
            outs = pool.map(lambda name: in_fresh_process('--memory-worker', name, batch, dim, args.device,
                                                          args.precision), memory_names)
            for name, out in zip(memory_names, outs):
                loss_memory.setdefault(batch, {})[name] = out['peak_bytes']
                memory_method = out['method']
        print(f"  B={batch}: " + ', '.join(f"{n} {b / 2 ** 20:.1f} MiB" for n, b in loss_memory[batch].items()),
              flush=True)
    print(f"[3/3] training step: --loss drrho vs --loss clip, batch {train_batch}, {train_repeats} rounds", flush=True)
    suffix = '' if mode == 'cpu' else '_' + mode + ('_fp32' if cuda and args.precision == 'fp32' else '')
    out = Path(args.output) if args.output else HERE / 'results' / f"overheads{suffix}"
    work = out.parent / 'tmp' / out.name  # data, features and training logs
    if work.exists():
        import shutil
        shutil.rmtree(work)
    training = time_training(work, train_samples, train_batch, train_repeats, args.device, args.train_model,
                             args.grad_checkpointing) if train_repeats else {}

    summary = summarize(loss_times, loss_memory, training)
    report = dict(
        config=dict(device=args.device, cuda=cuda, precision=args.precision if cuda else 'fp32', dim=dim, sizes=sizes,
                    repeats=repeats, memory_sizes=memory_sizes,
                    device_name=device_name(args.device)),
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} (1 min) at the end",
        loss_memory_method=memory_method, training_memory_method=training.pop('memory_method', None),
        training_config=dict(model=args.train_model or "the demo's tiny CLIP", batch=train_batch,
                             grad_checkpointing=args.grad_checkpointing, samples=train_samples,
                             repeats=train_repeats, workers=TRAIN_WORKERS if cuda else 0,
                             steps_per_config=len(training['clip']['step']) if training else 0),
        summary=summary, goals=goals(summary),
        raw=dict(loss_seconds={str(b): t for b, t in loss_times.items()},
                 loss_peak_bytes={str(b): m for b, m in loss_memory.items()}, training=training),
        wall_seconds=time.time() - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix('.json').write_text(json.dumps(report, indent=1))
    out.with_suffix('.md').write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out}.json and .md in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == '__main__':
    sys.exit(main())
