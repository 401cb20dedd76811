"""The README's demo at several training seeds: is its one-seed table what the setting gives?

    python benchmarks/demo_seeds.py [--seeds 0 1 2] [--variants 'drrho --reference-weight 1' ...] [demo flags]

Runs `python -m drrho_openclip.demo --seed S` once per seed, each in its own workdir under
`benchmarks/results/tmp/<output's name>/` or `--workdirs`; a workdir that holds the results of the same setting is
read, not run again. The drawn data is the same for every seed; the seed changes the reference's and both targets'
training. Reported: the zero-shot top-1 of the reference and of each target, mean ± standard deviation over the
seeds, and each target's difference from the `clip` target paired by seed, with the number of seeds where it is
above. About 3.5 min a seed on the project's 2 CPU cores. `--variants` trains more targets on each seed's data and
reference features (where its flags read them), with the same seed and sizes: a loss and its flags each (`drrho ...`,
`clip --distill-weight λ`); about 25 s each.
Writes `results/demo_seeds.{md,json}` (or `--output`).
"""
import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from drrho_openclip import demo
from drrho_openclip.openclip import evaluation
from drrho_openclip.openclip.flags import reads_reference

RESULTS = Path(__file__).parent / 'results'
MODELS = {'reference': 'reference (clip, its own split)', 'drrho': 'target, --loss drrho',
          'clip': 'target, --loss clip'}


def spread(values) -> str:
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.1f}"


def summarize(runs: list, variants: dict = None) -> dict:
    """Per model the zero-shot top-1 (%) of each run's results.json (and of each variant: {flags: [top-1 per run]}),
    mean ± std, and each target's difference from `clip` paired by seed: mean ± std, seeds above, ratio of means."""
    top1 = {model: [100 * run['zero_shot_top1'][key] for run in runs] for model, key in MODELS.items()}
    top1.update({flags: [100 * a for a in accuracies] for flags, accuracies in (variants or {}).items()})
    against_clip = {}
    for model, values in top1.items():
        if model in ('reference', 'clip'):
            continue
        gain = [v - c for v, c in zip(values, top1['clip'])]
        against_clip[model] = dict(minus_clip=spread(gain), above_clip=sum(g > 0 for g in gain),
                                   over_clip=statistics.mean(values) / statistics.mean(top1['clip']))
    return dict(seeds=[run['setting']['seed'] for run in runs], top1=top1,
                mean_std={model: spread(values) for model, values in top1.items()}, against_clip=against_clip)


def test_set(workdir: Path) -> tuple:
    """The demo's scoring inputs for the run in `workdir`: (its tiny model, tokenizer, test images, labels)."""
    model, preprocess, tokenizer = evaluation.untrained_model(f"local-dir:{workdir / 'tiny_model'}")
    return (model, tokenizer, *demo.labelled_images(workdir / 'data' / 'test.csv', preprocess))


def train_variant(workdir: Path, setting: dict, flags: str, scoring: tuple) -> float:
    """Zero-shot top-1 of a target trained with `flags` ('drrho --reference-weight 1') as the demo trains its own
    (`demo.TrainingRun`) on the run in `workdir`: its data, tiny model and reference features, its seed and sizes;
    `scoring` is `test_set(workdir)`. A finished variant is scored, not rerun."""
    loss, *loss_flags = shlex.split(flags)
    name = 'variant_' + re.sub(r'[^A-Za-z0-9.]+', '_', flags)
    args = SimpleNamespace(model=f"local-dir:{workdir / 'tiny_model'}", logs=workdir / 'logs', verbose=False,
                           **setting)
    data = demo.csv_data_args(workdir / 'data' / 'train.csv')
    # the plugin refuses features a variant does not read
    reference = ['--ref-features', workdir / 'ref_features'] if reads_reference(['--loss', loss, *loss_flags]) else []
    run = demo.TrainingRun(f'seed {setting["seed"]}:', name, flags, data, args, samples=setting['samples'],
                           epochs=setting['epochs'], extra=['--loss', loss, *loss_flags, *reference])
    last = run.checkpoints / f"epoch_{setting['epochs']}.pt"
    if last.exists():
        model, tokenizer, images, labels = scoring
        return evaluation.zero_shot_accuracy(evaluation.load_weights(model, last), tokenizer, images, labels,
                                       demo.shape_classes())
    if run.checkpoints.parent.exists():
        raise SystemExit(f'{run.checkpoints.parent} holds an unfinished run: remove it')
    return run.run(scoring).accuracy[-1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--output', type=Path, default=RESULTS / 'demo_seeds')
    p.add_argument('--workdirs', type=Path, help="the seeds' demo workdirs (default: results/tmp/<output's name>)")
    p.add_argument('--variants', nargs='+', default=[], metavar='LOSS_AND_FLAGS',
                   help="more targets, e.g. 'drrho --reference-weight 1' 'drrho --distill-weight 0.5'")
    args, demo_flags = p.parse_known_args(argv)
    runs, variants = [], {flags: [] for flags in args.variants}
    for seed in args.seeds:
        workdir = (args.workdirs or RESULTS / 'tmp' / args.output.name) / f'seed{seed}'
        setting = demo.setting(demo.parse_args([*demo_flags, '--seed', str(seed)]))
        done = workdir / 'results.json'
        if done.exists() and json.loads(done.read_text())['setting'] == setting:
            print(f'seed {seed}: read from {done}', flush=True)
        elif workdir.exists():
            raise SystemExit(f'{workdir} holds no finished run of this setting: remove it')
        else:
            print(f'seed {seed}: python -m drrho_openclip.demo --workdir {workdir} --seed {seed} '
                  f'{" ".join(demo_flags)}', flush=True)
            subprocess.run([sys.executable, '-m', 'drrho_openclip.demo', '--workdir', str(workdir), '--seed',
                            str(seed), *demo_flags], check=True, stdout=subprocess.DEVNULL)
        runs.append(json.loads(done.read_text()))
        scoring = test_set(workdir) if variants else None
        for flags, accuracies in variants.items():
            accuracies.append(train_variant(workdir, setting, flags, scoring))
            print(f'seed {seed}: {flags} {accuracies[-1]:.1%}', flush=True)
    summary = summarize(runs, variants)
    common = {k: v for k, v in runs[0]['setting'].items() if k != 'seed'}
    report = dict(summary, setting=common, demo_flags=demo_flags, variants=args.variants,
                  test_images=runs[0]['test_images'],
                  machine=f'{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}')
    command = shlex.join(['python', '-m', 'drrho_openclip.demo', '--seed', 'S', *demo_flags])
    lines = [f"# The demo at {len(args.seeds)} seeds",
             '', f"`{command}` for S in {summary['seeds']}; setting {common}; zero-shot top-1 (%) on "
                 f"{report['test_images']} test images; {report['machine']}.",
             '', '| model | ' + ' | '.join(f'seed {s}' for s in summary['seeds'])
             + ' | mean ± std | − `clip`, paired (seeds above) | × `clip` |',
             '|---|' + '---:|' * (len(summary['seeds']) + 3)]
    for model, values in summary['top1'].items():
        versus = summary['against_clip'].get(model)
        lines.append(f"| {MODELS.get(model, 'target, --loss ' + model)} | " + ' | '.join(f'{v:.1f}' for v in values)
                     + f" | {summary['mean_std'][model]} | "
                     + (f"{versus['minus_clip']} ({versus['above_clip']} of {len(values)}) | "
                        f"{versus['over_clip']:.2f}× |" if versus else '– | – |'))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix('.md').write_text('\n'.join(lines) + '\n')
    args.output.with_suffix('.json').write_text(json.dumps(report, indent=1))
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
