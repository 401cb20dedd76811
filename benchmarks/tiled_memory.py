"""Peak memory and time of the DRRho loss, forward + backward: tiled vs untiled row aggregation vs OpenCLIP's ClipLoss.

    python benchmarks/tiled_memory.py            # global batch 4096, 16384 and 65536 (where it fits), d = 512
    python benchmarks/tiled_memory.py --quick    # small batches, < 2 minutes on a 2-core CPU

Writes `benchmarks/results/tiled_memory[_quick].json` and `.md` (a table with the ratios side by side).

What is run: one training step's loss, world size 1 (local batch = global batch), unit-norm float32 features of
dimension d with `requires_grad`, then `backward()`:
- `untiled`: `create_loss('drrho', num_samples=B)` (τ = 0.01, reference features of dimension d, per-sample
  state with γ = 0.5), the core's `dense_aggregate`;
- `tiled`:   the same loss with `loss.aggregate = make_tiled_aggregate(tile_size)`;
- `clip`:    `open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True)` on the same features (no reference:
  it is the cost of the standard mini-batch loss, the usual yardstick).

How memory is measured (CPU): every configuration runs in its own fresh subprocess, so nothing one configuration
allocated (or the allocator kept cached) can leak into another's number. In the subprocess, after torch is
imported and the inputs and the loss are built (and one tiny warm-up call has loaded the kernels), the kernel's
resident-set high-water mark is reset by writing "5" to /proc/self/clear_refs; after forward + backward, VmHWM of
/proc/self/status is the peak resident memory *during the step*. We report `peak_gib` = that peak minus the
resident memory just before the step (the memory the step needed on top of its inputs: pairwise matrices,
autograd buffers, the feature gradients). Resident memory counts pages actually touched, which is what a CPU run
pays for; torch's CPU allocator returns large blocks to the OS on free (glibc mmaps them), so cached-but-free
memory does not inflate it. This is more faithful than tracemalloc (blind to torch's C++ allocations) and simpler
and cheaper than torch.profiler's memory view. If /proc/self/clear_refs is not writable, the fallback is
ru_maxrss (the peak since process start) minus the resident memory before the step, and the JSON says so
(`memory_method`). On CUDA (`--device cuda`) it is `torch.cuda.max_memory_allocated()` after
`reset_peak_memory_stats()`, minus the allocated memory before the step.

Time: the memory-measured step is also the warm-up; then `--repeats` steps are timed (wall clock, median). At
the largest batch (minutes per step on a small CPU) the time is that of the memory-measured step alone. The 1-min
load average is recorded with every configuration: on a shared machine, times are only as good as it is quiet.
Before each configuration runs, its peak memory is predicted from the previous batch size of the same
implementation (quadratic in B for `untiled` and `clip`, linear for `tiled`); a configuration predicted above
`--memory-limit-gib` (default 20) is skipped with a printed note rather than run into the OOM killer.

A tile-size sweep of the tiled loss (one batch size, `--sweep-batch`) is run too; it is what
`drrho_openclip.losses.tiled.DEFAULT_TILE_SIZE` was chosen from.
"""
import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3


# ---- worker: one configuration, in its own process -------------------------------------------------------------

def _status_kib(field):
    return int(re.search(rf'{field}:\s+(\d+) kB', Path('/proc/self/status').read_text()).group(1))


def _reset_peak_rss():
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return 'VmHWM after /proc/self/clear_refs reset, minus VmRSS before the step'
    except OSError:
        return 'ru_maxrss (peak since process start) minus VmRSS before the step'


def worker(impl, batch, dim, tile_size, repeats, device, threads, precision='fp32'):
    sys.path.insert(0, str(ROOT))
    import torch
    if threads > 0:
        torch.set_num_threads(threads)
    from drrho_openclip.losses import create_loss
    from drrho_openclip.losses.tiled import make_tiled_aggregate

    torch.manual_seed(0)

    # bf16: the features a model under --precision amp_bf16 hands its loss, and the call under bf16 autocast
    dtype = torch.bfloat16 if precision == 'bf16' else torch.float32

    def unit(x):
        return (x / x.norm(dim=1, keepdim=True)).to(dtype)

    def make_inputs(n):
        image = unit(torch.randn(n, dim, device=device))
        text = unit(image + torch.randn(n, dim, device=device))
        ref_image = unit(torch.randn(n, dim, device=device))
        ref_text = unit(ref_image + torch.randn(n, dim, device=device))
        return image, text, ref_image, ref_text, torch.arange(n, device=device)

    def make_loss(n):
        if impl == 'clip':
            from open_clip.loss import ClipLoss
            return ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=0, world_size=1)
        loss = create_loss('drrho', num_samples=n, gamma=0.5).to(device)
        loss.set_total_steps(1)  # one call, as a one-step run
        if impl == 'tiled':
            loss.aggregate = make_tiled_aggregate(tile_size)
        return loss

    def step(loss, image, text, ref_image, ref_text, index):
        image = image.detach().requires_grad_()
        text = text.detach().requires_grad_()
        logit_scale = torch.tensor(100.0, device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            if impl == 'clip':
                value = loss(image, text, logit_scale)
            else:
                value = loss(image, text, logit_scale, index=index,
                             ref_image_features=ref_image, ref_text_features=ref_text)
        value.backward()
        return value.item(), image.grad, text.grad

    def sync():
        if device == 'cuda':
            torch.cuda.synchronize()

    load_before = os.getloadavg()[0]
    step(make_loss(64), *make_inputs(64))          # loads kernels, allocator warm-up
    inputs, loss = make_inputs(batch), make_loss(batch)
    sync()

    if device == 'cuda':
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        method = 'torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated before'
    else:
        before = _status_kib('VmRSS') * 1024
        method = _reset_peak_rss()
    start = time.perf_counter()
    value, grad_image, grad_text = step(loss, *inputs)
    sync()
    first_s = time.perf_counter() - start
    if device == 'cuda':
        peak = torch.cuda.max_memory_allocated()
    elif method.startswith('VmHWM'):
        peak = _status_kib('VmHWM') * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del grad_image, grad_text

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(loss, *inputs)
        sync()
        times.append(time.perf_counter() - start)
    return dict(impl=impl, batch=batch, dim=dim, tile_size=tile_size if impl == 'tiled' else None,
                device=device, precision=precision, loss_value=value, peak_gib=(peak - before) / GIB,
                before_gib=before / GIB,
                first_step_s=first_s, step_s=statistics.median(times) if times else first_s,
                step_s_all=times, memory_method=method, threads=torch.get_num_threads(),
                load_avg_1min=[load_before, os.getloadavg()[0]])


# ---- driver ---------------------------------------------------------------------------------------------------

def run_config(impl, batch, dim, tile_size, repeats, device, timeout, threads=0, precision='fp32'):
    cmd = [sys.executable, __file__, '--worker', impl, str(batch), str(dim), str(tile_size), str(repeats), device,
           str(threads), precision]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(impl=impl, batch=batch, tile_size=tile_size, error=f'timed out after {timeout} s')
    if proc.returncode != 0:
        return dict(impl=impl, batch=batch, tile_size=tile_size,
                    error=f'exit {proc.returncode}: {proc.stderr.strip()[-400:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def device_name(device):
    """What the measurements ran on, in words: the GPU's name, or the CPU's."""
    if device.startswith('cuda'):
        import torch
        return torch.cuda.get_device_name()
    return f'CPU, {platform.processor() or platform.machine()}'


def predict_peak_gib(results, impl, batch):
    """From the largest smaller batch of the same implementation: quadratic in B, linear for `tiled`."""
    done = [r for r in results if r['impl'] == impl and 'peak_gib' in r and r['batch'] < batch]
    if not done:
        return None
    prev = max(done, key=lambda r: r['batch'])
    power = 1 if impl == 'tiled' else 2
    return prev['peak_gib'] * (batch / prev['batch']) ** power


def fmt(x, spec='.2f'):
    return '—' if x is None else format(x, spec)


def ms(seconds):
    """a step time in milliseconds: a GPU step takes tens of them, which seconds to two decimals would round away"""
    return fmt(None if seconds is None else seconds * 1e3, '.1f')


def markdown(report):
    a = report['args']
    lines = [
        "# DRRho loss forward+backward: tiled vs untiled vs OpenCLIP ClipLoss",
        '',
        f"d = {a['dim']}, {a.get('precision', 'fp32')}, world size 1, device `{report['device']}` "
        f"({report['device_name']}; {report['machine']}), "
        f"{report['threads']} threads, tile size {a['tile_size']}. "
        f"Memory: {report['memory_method']} (peak on top of the inputs). Time: median of {a['repeats']} "
        f"step(s) after a warm-up step"
        + (" (on a CPU the largest batch's is that one step alone: each takes minutes)."
           if any(r.get('step_s_all') == [] for r in report['results']) else "."),
        '',
        '| global batch | untiled GiB | tiled GiB | ClipLoss GiB | untiled/tiled mem | ClipLoss/tiled mem '
        '| untiled ms | tiled ms | ClipLoss ms | tiled/untiled time | tiled/ClipLoss time |',
        '|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for row in report['table']:
        lines.append(
            f"| {row['batch']} | {fmt(row['untiled_gib'])} | {fmt(row['tiled_gib'])} | {fmt(row['clip_gib'])} "
            f"| {fmt(row['mem_untiled_over_tiled'], '.1f')} | {fmt(row['mem_clip_over_tiled'], '.1f')} "
            f"| {ms(row['untiled_s'])} | {ms(row['tiled_s'])} | {ms(row['clip_s'])} "
            f"| {fmt(row['time_tiled_over_untiled'])} | {fmt(row['time_tiled_over_clip'])} |")
    loads = [x for r in report['results'] + report['sweep'] for x in r.get('load_avg_1min', [])]
    if loads and max(loads) > report['threads'] + 0.5:
        lines += ['', f"Times are noisy: other processes were running (1-min load average up to {max(loads):.1f} "
                      f"on {report['threads']} threads; see `load_avg_1min` in the JSON). Memory is unaffected."]
    if report['notes']:
        lines += ['', 'Notes:', ''] + [f'- {n}' for n in report['notes']]
    if report['sweep']:
        lines += ['', f"## Tile-size sweep (tiled drrho, global batch {a['sweep_batch']})", '',
                  '| tile size | peak GiB | step ms |', '|---:|---:|---:|']
        for r in report['sweep']:
            lines.append(f"| {r['tile_size']} | {fmt(r.get('peak_gib'))} | {ms(r.get('step_s'))} |"
                         + (f" {r['error']}" if 'error' in r else ''))
    return '\n'.join(lines) + '\n'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='small batches (< 2 min on a 2-core CPU)')
    parser.add_argument('--batches', type=int, nargs='+', default=None)
    parser.add_argument('--dim', type=int, default=512)
    parser.add_argument('--tile-size', type=int, default=None, help='default: DEFAULT_TILE_SIZE')
    parser.add_argument('--sweep-tiles', type=int, nargs='*', default=None,
                        help='tile sizes of the sweep (none: no sweep)')
    parser.add_argument('--sweep-batch', type=int, default=None)
    parser.add_argument('--repeats', type=int, default=None, help='timed steps after the warm-up')
    parser.add_argument('--memory-limit-gib', type=float, default=20.0)
    parser.add_argument('--timeout', type=int, default=3600, help='per configuration, seconds')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--precision', default='fp32', choices=['fp32', 'bf16'],
                        help='bf16: bf16 features, the loss called under bf16 autocast (CUDA)')
    parser.add_argument('--threads', type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument('--out-dir', type=Path, default=ROOT / 'benchmarks' / 'results')
    parser.add_argument('--tag', default=None, help='output file name suffix')
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from drrho_openclip.losses.tiled import DEFAULT_TILE_SIZE
    if args.quick:
        batches = args.batches or [512, 2048]
        sweep_tiles = [256, 1024] if args.sweep_tiles is None else args.sweep_tiles
        sweep_batch = args.sweep_batch or 2048
        repeats = 1 if args.repeats is None else args.repeats
    else:
        batches = args.batches or [4096, 16384, 65536]
        sweep_tiles = [128, 256, 512, 1024, 2048, 4096] if args.sweep_tiles is None else args.sweep_tiles
        sweep_batch = args.sweep_batch or 8192
        repeats = 2 if args.repeats is None else args.repeats
    tile_size = args.tile_size or DEFAULT_TILE_SIZE

    results, notes = [], []
    for batch in batches:
        for impl in ('tiled', 'untiled', 'clip'):
            predicted = predict_peak_gib(results, impl, batch)
            if predicted is not None and predicted > args.memory_limit_gib:
                note = (f'{impl} at batch {batch} skipped: predicted peak {predicted:.1f} GiB '
                        f'> {args.memory_limit_gib:g} GiB (scaled from its smaller batch)')
                print(note, flush=True)
                notes.append(note)
                results.append(dict(impl=impl, batch=batch, skipped=note))
                continue
            # on a CPU the largest batch gets only the memory-measured step (its time is reported): one step is
            # minutes there. A GPU's first call at a new size also picks its matrix-product kernels: it is timed
            # only after that
            reps = repeats if batch < max(batches) or len(batches) == 1 or args.device == 'cuda' else 0
            t0 = time.time()
            r = run_config(impl, batch, args.dim, tile_size, reps, args.device, args.timeout, args.threads,
                           args.precision)
            results.append(r)
            if 'error' in r:
                notes.append(f"{impl} at batch {batch} failed: {r['error']}")
                print(f"{impl:8s} B={batch:6d}  FAILED {r['error']}", flush=True)
            else:
                print(f"{impl:8s} B={batch:6d}  peak {r['peak_gib']:7.3f} GiB  step {r['step_s'] * 1e3:10.1f} ms  "
                      f"loss {r['loss_value']:.5f}  ({time.time() - t0:.0f} s wall)", flush=True)

    sweep = []
    for t in sweep_tiles:
        r = run_config('tiled', sweep_batch, args.dim, t, repeats, args.device, args.timeout, args.threads,
                       args.precision)
        sweep.append(r)
        print(f"sweep tile {t:5d} B={sweep_batch}: " + (r['error'] if 'error' in r else
              f"peak {r['peak_gib']:.3f} GiB  step {r['step_s'] * 1e3:.1f} ms"), flush=True)

    def get(impl, batch, key):
        for r in results:
            if r['impl'] == impl and r['batch'] == batch and key in r:
                return r[key]
        return None

    def ratio(x, y):
        return None if x is None or y is None or y == 0 else x / y

    table = []
    for batch in batches:
        row = dict(batch=batch)
        for impl in ('untiled', 'tiled', 'clip'):
            row[f'{impl}_gib'] = get(impl, batch, 'peak_gib')
            row[f'{impl}_s'] = get(impl, batch, 'step_s')
        row['mem_untiled_over_tiled'] = ratio(row['untiled_gib'], row['tiled_gib'])
        row['mem_clip_over_tiled'] = ratio(row['clip_gib'], row['tiled_gib'])
        row['time_tiled_over_untiled'] = ratio(row['tiled_s'], row['untiled_s'])
        row['time_tiled_over_clip'] = ratio(row['tiled_s'], row['clip_s'])
        # the tiled and untiled losses are the same function: their values must agree
        lt, lu = get('tiled', batch, 'loss_value'), get('untiled', batch, 'loss_value')
        row['loss_abs_diff_tiled_untiled'] = None if lt is None or lu is None else abs(lt - lu)
        table.append(row)

    measured = [r for r in results + sweep if 'memory_method' in r]
    report = dict(
        args=dict(quick=args.quick, batches=batches, dim=args.dim, tile_size=tile_size, repeats=repeats,
                  sweep_tiles=sweep_tiles, sweep_batch=sweep_batch, memory_limit_gib=args.memory_limit_gib,
                  threads=args.threads, precision=args.precision),
        device=args.device, device_name=device_name(args.device),
        machine=f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs',
        threads=measured[0]['threads'] if measured else None,
        memory_method=measured[0]['memory_method'] if measured else None,
        table=table, notes=notes, results=results, sweep=sweep)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = 'tiled_memory' + ('_quick' if args.quick else '') + (f'_{args.tag}' if args.tag else '')
    (args.out_dir / f'{stem}.json').write_text(json.dumps(report, indent=2) + '\n')
    md = markdown(report)
    (args.out_dir / f'{stem}.md').write_text(md)
    print('\n' + md)
    print(f"wrote {args.out_dir / stem}.json and .md")


if __name__ == '__main__':
    if len(sys.argv) > 1 and sys.argv[1] == '--worker':
        impl, batch, dim, tile_size, repeats, device, threads, precision = sys.argv[2:10]
        print(json.dumps(worker(impl, int(batch), int(dim), int(tile_size), int(repeats), device, int(threads),
                                precision)))
    else:
        main()
