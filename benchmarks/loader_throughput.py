"""Training-loader throughput with reference features attached (the plugin's loaders) vs OpenCLIP's own, samples/s.

    python benchmarks/loader_throughput.py --quick     # 4 shards x 256 samples, 5 rounds (about 1 minute)
    python benchmarks/loader_throughput.py             # 8 shards x 256 samples, 15 rounds (about 4 minutes)
    python benchmarks/loader_throughput.py --image-size 224 --quick --rounds 8   # 224 px images (about 6 minutes)

Writes `benchmarks/results/loader_throughput[_quick].{json,md}`; data and stores go to
`benchmarks/results/tmp/loader_throughput/` (git-ignored). Goal (issue "Scale"): with features >= 0.95x without.

Data: the demo's shapes (PNG, 32 px), the same samples as a CSV (`--dataset-type csv`) and as `--shards` WebDataset
tar shards (`--dataset-type webdataset`, `--train-num-samples` = all samples), built by
`precompute_throughput.make_shards`. Reference features: random unit vectors of dimension `--ref-dim` (default 512,
ViT-B's; their values do not matter for reading) in a float16 store (precompute's default), keyed like precompute
keys them (CSV: image paths; WebDataset: shard file name and `__key__`). Model: the demo's tiny config; only its
training transform (32 px, OpenCLIP's RandomResizedCrop augmentation) and tokenizer (context 16) are used.

Loaders: built exactly as `open_clip_train.main` builds them: `open_clip_train.params.parse_args([...])` (the
plugin's flags through its installed hook), the distributed fields `init_distributed_device` fills in for one
process, OpenCLIP's train/val transforms and tokenizer, then `open_clip_train.data.get_data(args, ...)`, which the
plugin wraps:

- without: `--loss clip` (no plugin wrapping: OpenCLIP's stock CSV loader with a RandomSampler, or its WebDataset
  pipeline);
- with: `--loss drrho --ref-features DIR` (the plugin's loaders: for CSV a seeded GlobalBatchSampler and a dataset
  whose augmentation is seeded per sample under `torch.random.fork_rng` (the CPU generator only), plus the sample
  index; for WebDataset the same pipeline plus a lookup of the index by shard name and `__key__`; both add the
  batch's features from the store once it is collated, in the loader workers);
- diagnostic, CSV only, patched in this process: the plugin's loader with the per-sample seeding switched off, to
  attribute its cost.

Each loader is iterated as `open_clip_train.train.train_one_epoch` does: `set_epoch(epoch)`, then every batch of
`dataloader`, split into images, texts and extras and moved to the device (`.to(device, non_blocking=True)`). Same
`--workers`, `--batch-size` and data for all. Time = one whole epoch (worker start-up included, as in training: the
CSV loaders start their workers every epoch, the WebDataset ones are persistent). One warm-up epoch per loader,
then `--rounds` rounds, each one epoch of every loader in an order rotated from round to round. Ratio = with /
without within the same round, median and [min, max] over rounds; samples/s are medians.

Also measured in this process (one thread, median of 5 repeats of about `--micro` samples): the per-sample costs
the plugin adds in a CSV worker (`fork_rng` + seeding; the store lookup of a batch's features and collation with
the features vs without, both per sample) next to the cost of OpenCLIP's own per-sample work (PNG decode, training
transform, tokenisation).

Absolute numbers from a shared CPU are noisy; the ratios are the result.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from precompute_throughput import RESULTS, machine_info, make_shards, spread  # noqa: E402

WORK = RESULTS / 'tmp' / 'loader_throughput'
GOAL = 0.95


def write_stores(root: Path, csv: Path, layout, dim: int, seed=0):
    """Random unit reference features for the CSV and for the shards: (csv store, webdataset store)."""
    import numpy as np
    from drrho_openclip.features import FeatureStore, FeatureStoreWriter, shard_name
    rng = np.random.default_rng(seed)

    def unit(n):
        x = rng.normal(size=(n, dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    stores = {}
    paths = [line.split('\t')[0] for line in csv.read_text().splitlines()[1:]]
    for kind, shards in (('csv', [(csv, paths)]), ('webdataset', layout)):
        out = root / f'ref_{kind}_{csv.parent.name}_{dim}'
        if not (out / 'manifest.json').is_file():
            writer = FeatureStoreWriter(out, model='random', pretrained='', dim=dim)
            for source, keys in shards:
                writer.add_shard(shard_name(source), keys, unit(len(keys)), unit(len(keys)))
            writer.close()
        stores[kind] = out
        assert FeatureStore.open(out).num_samples == len(paths)
    return stores


def build_loader(argv, preprocess_fns, tokenizer):
    """DataInfo of the training data, built as open_clip_train.main builds it (one process)."""
    from open_clip_train.data import get_data
    from open_clip_train.params import parse_args
    args = parse_args([str(a) for a in argv])
    # what open_clip_train.distributed.init_distributed_device sets for a single process
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    return get_data(args, preprocess_fns, epoch=0, tokenizer=tokenizer)['train'], args


def run_epoch(info, epoch, device):
    """One epoch as train_one_epoch iterates it: (samples, seconds, seconds to the first batch)."""
    import torch
    info.set_epoch(epoch)
    dataloader = info.dataloader
    samples, first = 0, None
    start = time.perf_counter()
    for batch in dataloader:
        images, texts, *extras = batch
        images = images.to(device=device, dtype=torch.float32, non_blocking=True)
        texts = texts.to(device=device, non_blocking=True)
        extras = {k: v.to(device=device, non_blocking=True) for k, v in extras[0].items()} if extras else {}
        samples += images.shape[0]
        if first is None:
            first = time.perf_counter() - start
    return samples, time.perf_counter() - start, first


def _no_seeding_getitem(self, index):
    """WithSampleExtras.__getitem__ without the per-sample fork_rng + seeding (diagnostic only)."""
    image, text = self.dataset[index]
    return image, text, {'index': index}


def micro_costs(csv_info, store_dir, calls, batch_size):
    """Microseconds per sample (median of 5 repeats of about `calls` samples) of the per-sample work in a CSV
    worker; the per-batch work is timed on batches of `batch_size` shuffled indices and divided by it."""
    import torch
    from torch.utils.data import default_collate
    from drrho_openclip.openclip.loaders import CollateWithReferenceFeatures
    from drrho_openclip.features import FeatureStore
    dataset = csv_info.dataloader.dataset  # WithSampleExtras around OpenCLIP's CsvDataset
    store = FeatureStore.open(store_dir)
    n = len(dataset)
    batches = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:n // batch_size * batch_size]
    batches = batches.view(-1, batch_size)
    samples = [dataset[i] for i in batches[0].tolist()]  # one collated batch of real samples, over and over
    collate = CollateWithReferenceFeatures(store)

    def cpu_seeding(i):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed((0 * 1_000_003 + 0) * 2_147_483_647 + i)

    cases = {'OpenCLIP CsvDataset.__getitem__ (decode, transform, tokenise)': (lambda i: dataset.dataset[i % n], 1),
             'plugin: fork_rng + torch.default_generator.manual_seed': (cpu_seeding, 1),
             'plugin: whole WithSampleExtras.__getitem__ (seeded sample and its index)': (lambda i: dataset[i % n], 1),
             f'plugin: store lookup of a batch of {batch_size} (batch_features, float16 -> float32), per sample':
                 (lambda i: store.batch_features(batches[i % len(batches)]), batch_size),
             f'OpenCLIP default_collate of a batch of {batch_size}, per sample':
                 (lambda i: default_collate(samples), batch_size),
             f'plugin: collation with the reference features of a batch of {batch_size}, per sample':
                 (lambda i: collate(samples), batch_size)}
    out = {}
    for name, (fn, per_call) in cases.items():
        count = max(10, calls // per_call)  # about `calls` samples per repeat, batches or not
        reps = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(count):
                fn(i)
            reps.append((time.perf_counter() - start) / (count * per_call) * 1e6)
        out[name] = statistics.median(reps)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='4 shards x 256 samples, 5 rounds (under 2 minutes)')
    p.add_argument('--shards', type=int, default=None, help='default 8 (4 with --quick)')
    p.add_argument('--samples-per-shard', type=int, default=256)
    p.add_argument('--batch-size', type=int, default=64)
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--rounds', type=int, default=None, help='default 15 (5 with --quick)')
    p.add_argument('--ref-dim', type=int, default=512)
    p.add_argument('--image-size', type=int, default=32,
                   help="stored and trained image size (default 32, the demo's; the tiny config is rescaled to it)")
    p.add_argument('--micro', type=int, default=None, help='calls per micro-benchmark repeat (default 400, 200 quick)')
    p.add_argument('--output', default=None, help='results base name (default: loader_throughput[_quick])')
    args = p.parse_args(argv)
    args.shards = args.shards or (4 if args.quick else 8)
    args.rounds = args.rounds or (5 if args.quick else 15)
    args.micro = args.micro or (200 if args.quick else 400)

    from drrho_openclip.openclip import install_import_hook
    install_import_hook()
    import logging
    import warnings
    import open_clip
    import torch
    from drrho_openclip.demo import write_tiny_model
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings('ignore', message='.*pin_memory.*')

    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pattern, csv, layout = make_shards(RESULTS / 'tmp' / 'precompute_throughput', args.shards, args.samples_per_shard,
                                       args.image_size)
    stores = write_stores(WORK, csv, layout, args.ref_dim)
    samples = args.shards * args.samples_per_shard
    print(f"data: {samples} samples as a CSV and as {args.shards} shards; stores ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    model = write_tiny_model(WORK / 'tiny_model')
    if args.image_size != 32:
        folder = WORK / f'tiny_model_{args.image_size}px'
        folder.mkdir(parents=True, exist_ok=True)
        config = json.loads((WORK / 'tiny_model' / 'open_clip_config.json').read_text())
        config['model_cfg']['vision_cfg'].update(image_size=args.image_size, patch_size=args.image_size // 4)
        (folder / 'open_clip_config.json').write_text(json.dumps(config))
        model = f'local-dir:{folder}'
    common = ['--model', model, '--batch-size', args.batch_size, '--workers', args.workers, '--precision', 'fp32',
              '--device', 'cpu', '--seed', 0, '--epochs', 100]
    inputs = {'csv': ['--train-data', csv, '--dataset-type', 'csv', '--csv-separator', '\t',
                      '--csv-img-key', 'filepath', '--csv-caption-key', 'title'],
              'webdataset': ['--train-data', pattern, '--dataset-type', 'webdataset',
                             '--train-num-samples', samples]}
    # OpenCLIP's own transforms and tokenizer, as main() makes them
    from open_clip_train.params import parse_args
    oc_args = parse_args([str(a) for a in inputs['csv'] + common])
    _, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        oc_args.model, oc_args.pretrained, precision=oc_args.precision, device='cpu', aug_cfg=oc_args.aug_cfg,
        output_dict=True)
    tokenizer = open_clip.get_tokenizer(oc_args.model)
    fns = (preprocess_train, preprocess_val)

    configs = {}
    for kind, data_args in inputs.items():
        configs[(kind, 'without (--loss clip)')] = build_loader(data_args + common + ['--loss', 'clip'], fns,
                                                                tokenizer)[0]
        configs[(kind, 'with (--loss drrho --ref-features)')] = build_loader(
            data_args + common + ['--loss', 'drrho', '--ref-features', stores[kind]], fns, tokenizer)[0]
    from drrho_openclip.openclip.loaders import WithSampleExtras
    with_csv = configs[('csv', 'with (--loss drrho --ref-features)')]
    assert isinstance(with_csv.dataloader.dataset, WithSampleExtras)
    diagnostic = build_loader(inputs['csv'] + common + ['--loss', 'drrho', '--ref-features', stores['csv']],
                              fns, tokenizer)[0]
    diagnostic.dataloader.dataset.__class__ = type('WithSampleExtrasDiagnostic', (WithSampleExtras,),
                                                   {'__getitem__': _no_seeding_getitem})
    configs[('csv', 'with, per-sample seeding off (diagnostic)')] = diagnostic

    load_before = os.getloadavg()[0]
    for name, info in configs.items():  # warm-up: page cache, persistent workers
        run_epoch(info, 0, 'cpu')
    times = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            n, seconds, first = run_epoch(configs[name], r + 1, 'cpu')
            times[name].append(dict(samples=n, seconds=seconds, first_batch_seconds=first))
        print(f"round {r + 1}/{args.rounds}: " + ', '.join(
            f"{k}/{v.split(' (')[0]} {t[-1]['samples'] / t[-1]['seconds']:.0f}/s" for (k, v), t in times.items()),
            flush=True)
    micro = micro_costs(with_csv, stores['csv'], args.micro, args.batch_size)
    print('per-sample costs (us): ' + ', '.join(f'{k}: {v:.1f}' for k, v in micro.items()), flush=True)

    rate = lambda rec: rec['samples'] / rec['seconds']
    rows = []
    for (kind, label), recs in times.items():
        base = times[(kind, 'without (--loss clip)')]
        rows.append(dict(input=kind, loader=label, samples_per_epoch=recs[0]['samples'],
                         samples_per_s=spread([rate(x) for x in recs]),
                         first_batch_s=spread([x['first_batch_seconds'] for x in recs]),
                         ratio=spread([rate(x) / rate(b) for x, b in zip(recs, base)])))
    goal = {kind: next(r['ratio'] for r in rows if r['input'] == kind and r['loader'].startswith('with ('))
            for kind in inputs}
    report = dict(
        benchmark='loader_throughput', quick=args.quick, goal=GOAL,
        config=dict(samples=samples, shards=args.shards, samples_per_shard=args.samples_per_shard,
                    batch_size=args.batch_size, workers=args.workers, rounds=args.rounds, ref_dim=args.ref_dim,
                    store_dtype='float16', image=f'{args.image_size} px PNG',
                    model='demo tiny (transform + tokenizer only)', image_size=args.image_size),
        machine=dict(machine_info(), load_average_1min_before=load_before),
        rows=rows, micro_us=micro, meets_goal={k: v['median'] >= GOAL for k, v in goal.items()},
        rounds={f'{k} | {v}': t for (k, v), t in times.items()},
        note='absolute samples/s on a shared CPU are noisy; compare the per-round ratios')
    name = args.output or 'loader_throughput' + (f'_{args.image_size}px' if args.image_size != 32 else '') + (
        '_quick' if args.quick else '')
    (RESULTS / f'{name}.json').write_text(json.dumps(report, indent=1))
    (RESULTS / f'{name}.md').write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report):
    c, m = report['config'], report['machine']
    fmt = lambda d, p=2: f"{d['median']:.{p}f} [{d['min']:.{p}f}–{d['max']:.{p}f}]"
    lines = [
        '# Training-loader throughput: with reference features vs without (CPU)', '',
        f"{m['processor']}, {m['cpus']} CPUs, torch {m['torch']}, load average {m['load_average_1min_before']:.1f} "
        f"before and {m['load_average_1min']:.1f} after (1 min). **Absolute numbers are noisy (shared machine); the "
        f"ratios are per round, median [min–max] over {c['rounds']} interleaved rounds.**", '',
        f"{c['samples']} samples ({c['image']}; as one CSV, and as {c['shards']} WebDataset shards of "
        f"{c['samples_per_shard']}), batch {c['batch_size']}, {c['workers']} workers, reference features of dimension "
        f"{c['ref_dim']} ({c['store_dtype']} store); one whole epoch per measurement, iterated as OpenCLIP's "
        f"train_one_epoch does.", '',
        '| input | loader | samples/s (median [min–max]) | × without | first batch, s |',
        '|---|---|---:|---|---:|']
    for r in report['rows']:
        ratio = fmt(r['ratio'])
        if r['loader'].startswith('with ('):
            ratio = f"**{ratio}**"
        lines.append(f"| {r['input']} | {r['loader']} | {fmt(r['samples_per_s'], 0)} | {ratio} | "
                     f"{r['first_batch_s']['median']:.2f} |")
    lines += ['', 'Per-sample costs in one process (µs per sample, median of 5 repeats):', '',
              '| work | µs |', '|---|---:|']
    lines += [f"| {k} | {v:.1f} |" for k, v in report['micro_us'].items()]
    lines += ['', 'Goal ≥ {}× with features: '.format(report['goal']) + ', '.join(
        f"{k} {'met' if v else 'NOT met'}" for k, v in report['meets_goal'].items()) + '.', '']
    return '\n'.join(lines)


if __name__ == '__main__':
    sys.exit(main())
