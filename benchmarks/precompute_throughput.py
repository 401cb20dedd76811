"""Precompute throughput: `drrho_openclip.precompute` writing a store vs the bare model's inference, samples/s.

    python benchmarks/precompute_throughput.py --quick        # 4 shards x 256 samples, 3 rounds (about 1 minute)
    python benchmarks/precompute_throughput.py                # 8 shards x 256 samples, 5 rounds (about 2 minutes)
    python benchmarks/precompute_throughput.py --workers 0 --output precompute_throughput_workers0
    python benchmarks/precompute_throughput.py --device cuda --model ViT-B-32 --shards 32 --samples-per-shard 1024 \
        --workers 8     # GPU (not yet run: no GPU where the CPU tables were made)

Writes `benchmarks/results/precompute_throughput[_quick|_cuda].{json,md}`; data and stores go to
`benchmarks/results/tmp/precompute_throughput/` (git-ignored). Goal (issue "Scale"): precompute >= 0.9x the bare
model.

Data: the demo's shapes (`drrho_openclip.demo.make_split`, PNG, 32 px; resized with bicubic to `--image-size` when
that differs), packed into `--shards` WebDataset tar shards of `--samples-per-shard` samples (`<key>.png`,
`<key>.txt`), the input format precompute meets at scale.

Model (`--model`): by default `small`, a local-dir CLIP config written next to the data (no weights, no download;
randomly initialised weights cost the same as trained ones): 32 px images in 4 px patches (65 tokens), width 128,
4 layers, 2 heads, for both towers, text context 32, embedding 64, about 8M parameters (6.3M of them the token
embedding table). Chosen so that compute dominates a batch on a CPU (about 10x the CPU time of decoding, transforming
and tokenising a sample) yet a pass over 2048 samples takes seconds. `tiny` is the demo's 3M-parameter config (2 layers,
width 64, 8 px patches), for which data loading costs as much as the model, so the ratio measures the loader rather
than the encode loop. Any OpenCLIP model name works too (random init; e.g. ViT-B-32 with `--device cuda`).

Measured, in one process, in `--rounds` interleaved rounds whose order rotates from round to round (so slow drift of
a shared machine hits all alike):

- `bare model`: `encode_image(normalize=True)` + `encode_text(normalize=True)` under `torch.no_grad()` on the same
  preprocessed batches (the reference model's evaluation transform and tokenizer, precompute's own batching, batch
  `--batch-size`), held in memory on the device: pure inference, no reading, no copying, no writing. The same model
  object as far as construction goes (`precompute.create_model`).
- `precompute`: `drrho_openclip.precompute.main([...])` in-process with `--workers` loader workers, writing a float16
  store into a fresh directory: the encode loop's own time (precompute's `_compute`, from worker start to the last
  shard written: reading and decoding the tars in the workers, host-to-device copies, encoding, fetching the
  features, writing each shard's files), and the whole call (`main()` wall time, also model construction,
  tokenizer loading and finalising the store).
  The encode loop's time is split into its `_encode` calls (timed by a wrapper: the bare model's work plus the
  copies to and from the device) and the rest (waiting for the loader, writing).
- `loader only`: precompute's data loader (`_ShardBatches` in a DataLoader with the same workers) iterated without a
  model: the ceiling the data side sets.

Ratio = precompute samples/s / bare-model samples/s within the same round, reported as the median and [min, max] over
rounds; samples/s are medians over rounds. Threads: `--threads` for the measuring process (default 1, as
`overheads.py`: on an oversubscribed 2-core machine OpenMP barriers stall by whole time slices), the same for the
bare model and precompute's encode loop; loader workers use one thread each (PyTorch's default).

Absolute numbers from a shared CPU are noisy; the ratios are the result.
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / 'results'
WORK = RESULTS / 'tmp' / 'precompute_throughput'
GOAL = 0.9

SMALL_MODEL = {
    "model_cfg": {"embed_dim": 64,
                  "vision_cfg": {"image_size": 32, "layers": 4, "width": 128, "head_width": 64, "patch_size": 4},
                  "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 2, "layers": 4}},
    "preprocess_cfg": {},
}


# ---- data --------------------------------------------------------------------------------------------------------

def make_shards(root: Path, shards: int, per_shard: int, image_size: int = 32, seed: int = 0):
    """The demo's shapes in `shards` tar shards of `per_shard` samples (`<key>.png`, `<key>.txt`), and the CSV of the
    same images. Returns (brace pattern of the shards, CSV path, [(shard file, [keys])]); reuses what is there."""
    from PIL import Image
    from drrho_openclip.demo import make_split
    folder = root / f'shapes_{shards}x{per_shard}_{image_size}px'
    pattern = str(folder / f'shard-{{{0:05d}..{shards - 1:05d}}}.tar')
    csv = folder / 'train.csv'
    layout = [(folder / f'shard-{s:05d}.tar', [f's{s}_{i:04d}' for i in range(per_shard)]) for s in range(shards)]
    done = folder / 'done'
    if done.is_file():
        return pattern, csv, layout
    shutil.rmtree(folder, ignore_errors=True)
    drawn = make_split(folder / 'drawn', 'train', shards * per_shard, seed=seed)
    rows = [line.split('\t') for line in drawn.read_text().splitlines()[1:]]
    if image_size != 32:
        for path, _, _ in rows:
            Image.open(path).convert('RGB').resize((image_size, image_size), Image.BICUBIC).save(path)
    lines = ['filepath\ttitle']
    for s, (tar_path, keys) in enumerate(layout):
        with tarfile.open(tar_path, 'w') as tar:
            for key, (path, title, _) in zip(keys, rows[s * per_shard:(s + 1) * per_shard]):
                tar.add(path, arcname=f'{key}.png')
                info = tarfile.TarInfo(f'{key}.txt')
                data = title.encode()
                info.size = len(data)
                tar.addfile(info, BytesIO(data))
                lines.append(f'{path}\t{title}')
    csv.write_text('\n'.join(lines) + '\n')
    done.write_text('')
    return pattern, csv, layout


def model_name(choice: str, root: Path) -> str:
    from drrho_openclip.demo import write_tiny_model
    if choice == 'tiny':
        return write_tiny_model(root / 'tiny_model')
    if choice == 'small':
        folder = root / 'small_model'
        folder.mkdir(parents=True, exist_ok=True)
        (folder / 'open_clip_config.json').write_text(json.dumps(SMALL_MODEL))
        return f'local-dir:{folder}'
    return choice


def machine_info():
    import torch
    info = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads(),
                load_average_1min=os.getloadavg()[0])
    if torch.cuda.is_available():
        info['gpu'] = torch.cuda.get_device_name()
    return info


def spread(values):
    return dict(median=statistics.median(values), min=min(values), max=max(values))


# ---- measurements ------------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, model, pattern, layout):
        import braceexpand
        import open_clip
        import torch
        from drrho_openclip import precompute
        from drrho_openclip.features import shard_name
        self.args, self.model_name, self.pattern = args, model, pattern
        self.torch, self.precompute = torch, precompute
        self.shards = [(shard_name(u), u) for u in braceexpand.braceexpand(pattern)]
        self.samples = sum(len(keys) for _, keys in layout)
        self.model, self.preprocess = precompute.create_model(model, None, args.device)
        self.tokenizer = open_clip.get_tokenizer(model)
        # the bare model's input: precompute's own batches, on the device
        self.batches = [(images.to(args.device), texts.to(args.device)) for _, keys, images, texts in
                        precompute._ShardBatches(self.shards, self.preprocess, self.tokenizer, args.batch_size)
                        if keys is not None]
        assert sum(len(i) for i, _ in self.batches) == self.samples
        self.timed_compute = []
        original = precompute._compute

        def timed(*a, **k):  # precompute's encode loop reports (samples, seconds) itself
            result = original(*a, **k)
            self.timed_compute.append(result)
            return result
        precompute._compute = timed
        self.encode_seconds = 0.0
        encode = precompute._encode

        # the part of the loop that does the bare model's work (plus copies); on a GPU only the time to queue it,
        # since precompute waits for the device once per shard, not per batch
        def timed_encode(*a, **k):
            start = time.perf_counter()
            result = encode(*a, **k)
            self.encode_seconds += time.perf_counter() - start
            return result
        precompute._encode = timed_encode
        self.run = 0

    def sync(self):
        if self.args.device.startswith('cuda'):
            self.torch.cuda.synchronize()

    def bare(self):
        with self.torch.no_grad():
            self.sync()
            start = time.perf_counter()
            for images, texts in self.batches:
                self.model.encode_image(images, normalize=True)
                self.model.encode_text(texts, normalize=True)
            self.sync()
            return dict(seconds=time.perf_counter() - start, samples=self.samples)

    def precompute_run(self):
        from drrho_openclip.features import FeatureStore
        output = WORK / 'stores' / f'run{self.run}'
        self.run += 1
        shutil.rmtree(output, ignore_errors=True)
        shutil.rmtree(output.with_name(output.name + '.partial'), ignore_errors=True)
        argv = ['--model', self.model_name, '--train-data', self.pattern, '--output', str(output),
                '--batch-size', str(self.args.batch_size), '--workers', str(self.args.workers),
                '--device', self.args.device]
        self.encode_seconds = 0.0
        start = time.perf_counter()
        # precompute's progress bar goes to stderr (not disabled: its counter is the sample count it returns)
        with open(os.devnull, 'w') as devnull, contextlib.redirect_stderr(devnull):
            assert self.precompute.main(argv) == 0
        wall = time.perf_counter() - start
        samples, seconds = self.timed_compute.pop()
        assert samples == self.samples and FeatureStore.open(output).num_samples == self.samples
        shutil.rmtree(output)
        return dict(seconds=seconds, samples=samples, main_seconds=wall, encode_seconds=self.encode_seconds)

    def loader(self):
        torch = self.torch
        loader = torch.utils.data.DataLoader(
            self.precompute._ShardBatches(self.shards, self.preprocess, self.tokenizer, self.args.batch_size),
            batch_size=None, num_workers=self.args.workers)
        start = time.perf_counter()
        samples = sum(len(keys) for _, keys, _, _ in loader if keys is not None)
        return dict(seconds=time.perf_counter() - start, samples=samples)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='4 shards, 3 rounds (under 2 minutes on 2 CPU cores)')
    p.add_argument('--model', default='small', help="'small' (default), 'tiny' (the demo's), or an OpenCLIP name")
    p.add_argument('--shards', type=int, default=None, help='default 8 (4 with --quick)')
    p.add_argument('--samples-per-shard', type=int, default=256)
    p.add_argument('--image-size', type=int, default=None, help="default: the model's image size")
    p.add_argument('--batch-size', type=int, default=256, help="precompute's default")
    from drrho_openclip.precompute import default_workers
    p.add_argument('--workers', type=int, default=default_workers(), help="precompute's default (%(default)s here)")
    p.add_argument('--rounds', type=int, default=None, help='default 5 (3 with --quick)')
    p.add_argument('--threads', type=int, default=1, help='torch threads of the measuring process (0: leave as is)')
    p.add_argument('--device', default='cpu')
    p.add_argument('--output', default=None, help='results base name (default: precompute_throughput[_quick|_cuda])')
    args = p.parse_args(argv)
    args.shards = args.shards or (4 if args.quick else 8)
    args.rounds = args.rounds or (3 if args.quick else 5)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from drrho_openclip.openclip import install_import_hook
    install_import_hook()
    import open_clip
    logging_quiet()

    WORK.mkdir(parents=True, exist_ok=True)
    model = model_name(args.model, WORK)
    if args.image_size is None:
        config = open_clip.get_model_config(model) if not model.startswith('local-dir:') else \
            json.loads((Path(model[len('local-dir:'):]) / 'open_clip_config.json').read_text())['model_cfg']
        size = config['vision_cfg']['image_size']
        args.image_size = size if isinstance(size, int) else size[0]
    t0 = time.perf_counter()
    pattern, _, layout = make_shards(WORK, args.shards, args.samples_per_shard, args.image_size)
    print(f"data: {args.shards} shards x {args.samples_per_shard} samples, {args.image_size} px "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    bench = Bench(args, model, pattern, layout)
    print(f"model {args.model} ({sum(p.numel() for p in bench.model.parameters()) / 1e6:.1f}M parameters), "
          f"batches ready", flush=True)
    load_before = os.getloadavg()[0]
    cases = {'bare model': bench.bare, 'precompute': bench.precompute_run, 'loader only': bench.loader}
    with torch.no_grad():  # warm-up: kernels, allocator, CUDA context
        bench.model.encode_image(bench.batches[0][0], normalize=True)
        bench.model.encode_text(bench.batches[0][1], normalize=True)
    times = {name: [] for name in cases}
    for r in range(args.rounds):
        names = list(cases)
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(cases[name]())
        print(f"round {r + 1}/{args.rounds}: " + ', '.join(
            f"{n} {t[-1]['samples'] / t[-1]['seconds']:.0f}/s" for n, t in times.items()), flush=True)

    rate = lambda rec, key='seconds': rec['samples'] / rec[key]
    summary = {name: dict(samples_per_s=spread([rate(x) for x in recs]),
                          seconds=spread([x['seconds'] for x in recs])) for name, recs in times.items()}
    summary['precompute (whole main())'] = dict(
        samples_per_s=spread([rate(x, 'main_seconds') for x in times['precompute']]),
        seconds=spread([x['main_seconds'] for x in times['precompute']]))
    ratio = spread([rate(p) / rate(b) for p, b in zip(times['precompute'], times['bare model'])])
    ratio_main = spread([rate(p, 'main_seconds') / rate(b) for p, b in zip(times['precompute'], times['bare model'])])
    # where the loop's time goes: inside the encode calls (the bare model's work, slowed by whatever competes for
    # the device: on a CPU, the loader workers), and outside them (waiting for data, writing the store)
    encode_slowdown = spread([p['encode_seconds'] / b['seconds'] for p, b in zip(times['precompute'],
                                                                                  times['bare model'])])
    outside_share = spread([1 - p['encode_seconds'] / p['seconds'] for p in times['precompute']])
    loader_ratio = spread([rate(l) / rate(b) for l, b in zip(times['loader only'], times['bare model'])])
    report = dict(
        benchmark='precompute_throughput', quick=args.quick, goal=GOAL,
        config=dict(model=args.model, model_name=model, parameters=sum(p.numel() for p in bench.model.parameters()),
                    shards=args.shards, samples_per_shard=args.samples_per_shard, samples=bench.samples,
                    image_size=args.image_size, batch_size=args.batch_size, workers=args.workers,
                    rounds=args.rounds, device=args.device, store_dtype='float16'),
        machine=dict(machine_info(), load_average_1min_before=load_before),
        summary=summary, ratio=ratio, ratio_whole_main=ratio_main, loader_over_bare=loader_ratio,
        encode_time_over_bare=encode_slowdown, loop_share_outside_encode=outside_share,
        meets_goal=ratio['median'] >= GOAL, rounds=times,
        note='absolute samples/s on a shared CPU are noisy; compare the per-round ratios')
    name = args.output or 'precompute_throughput' + ('_cuda' if args.device.startswith('cuda') else
                                                      '_quick' if args.quick else '')
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f'{name}.json').write_text(json.dumps(report, indent=1))
    (RESULTS / f'{name}.md').write_text(markdown(report))
    print(markdown(report))
    return 0


def logging_quiet():
    """Silence precompute's INFO lines and OpenCLIP's 'no pretrained weights' warnings (basicConfig is set first)."""
    import logging
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


def markdown(report):
    c, m, s = report['config'], report['machine'], report['summary']
    fmt = lambda d: f"{d['median']:.2f} [{d['min']:.2f}–{d['max']:.2f}]"
    pct = lambda d: f"{100 * d['median']:.0f} [{100 * d['min']:.0f}–{100 * d['max']:.0f}]"
    lines = [
        f"# Precompute throughput vs the bare model ({c['device']})", '',
        f"{m['processor']}, {m['cpus']} CPUs{', ' + m['gpu'] if 'gpu' in m else ''}, torch {m['torch']}, "
        f"{m['threads']} thread(s) in the measuring process, load average {m['load_average_1min_before']:.1f} before "
        f"and {m['load_average_1min']:.1f} after (1 min). **Absolute numbers are noisy (shared machine); the ratios "
        f"are per round, median [min–max] over {c['rounds']} interleaved rounds.**", '',
        f"Model `{c['model']}` ({c['parameters'] / 1e6:.1f}M parameters), {c['shards']} WebDataset shards x "
        f"{c['samples_per_shard']} samples ({c['samples']} samples, {c['image_size']} px PNG shapes), batch "
        f"{c['batch_size']}, {c['workers']} loader workers, {c['store_dtype']} store.", '',
        '| what | samples/s (median [min–max]) | × bare model |',
        '|---|---:|---|',
        f"| bare model: encode_image + encode_text on in-memory batches | {fmt(s['bare model']['samples_per_s'])} "
        f"| 1.00 |",
        f"| precompute encode loop (read tars, encode, write store) | {fmt(s['precompute']['samples_per_s'])} "
        f"| **{fmt(report['ratio'])}** |",
        f"| precompute whole `main()` (also model build, finalise) | "
        f"{fmt(s['precompute (whole main())']['samples_per_s'])} | {fmt(report['ratio_whole_main'])} |",
        f"| precompute's loader alone (no model) | {fmt(s['loader only']['samples_per_s'])} | "
        f"{fmt(report['loader_over_bare'])} |",
        '',
        f"Where the encode loop's time goes: its encode calls (the bare model's work on the same batches) took "
        f"{fmt(report['encode_time_over_bare'])}× the bare model's time; "
        f"{pct(report['loop_share_outside_encode'])} % of the loop was spent outside "
        f"them (waiting for the loader, fetching and writing features).",
        '',
        *(["On a CPU the loader workers (decoding, transforming, tokenising) run on the cores the model runs on, so "
           "the encode calls slow down by the loader's share of the CPU; `--workers 0` loads in the encode loop's "
           "own process instead (compare `precompute_throughput_workers0.md`). On a GPU the model runs on the "
           "device and the 'loader only' row says whether the workers keep up.", ''] if c['device'] == 'cpu' else []),
        f"Goal ≥ {report['goal']}× (encode loop): {'met' if report['meets_goal'] else 'NOT met'} "
        f"(median {report['ratio']['median']:.2f}×).", '']
    return '\n'.join(lines)


if __name__ == '__main__':
    sys.exit(main())
