"""The README's demo at several training seeds: is its one-seed table what the setting gives?

    python benchmarks/demo_seeds.py [--seeds 0 1 2] [demo flags, e.g. --epochs 4]

Runs `python -m drrho_openclip.demo --seed S` once per seed, each in its own workdir under
`benchmarks/results/tmp/<output name>/` (the drawn data is the same for every seed; the seed changes the reference's
and both targets' training; a seed whose workdir holds the results of the same setting is read, not run again), and
reports the zero-shot top-1 of the reference, the default `drrho` target and the `clip`
target: mean ± standard deviation over the seeds, and `drrho` − `clip` paired by seed with the number of seeds where
`drrho` is above. About 3.5 min a seed on the project's 2 CPU cores.
Writes `results/demo_seeds.{md,json}` (or `--output`).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from drrho_openclip import demo

RESULTS = Path(__file__).parent / 'results'
MODELS = {'reference': 'reference (clip, its own split)', 'drrho': 'target, --loss drrho',
          'clip': 'target, --loss clip'}


def spread(values) -> str:
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.1f}"


def summarize(runs: list) -> dict:
    """Per model the zero-shot top-1 (%) of each run's results.json, mean ± std, and drrho − clip paired by seed."""
    top1 = {model: [100 * run['zero_shot_top1'][key] for run in runs] for model, key in MODELS.items()}
    gain = [d - c for d, c in zip(top1['drrho'], top1['clip'])]
    return dict(seeds=[run['setting']['seed'] for run in runs], top1=top1,
                mean_std={model: spread(values) for model, values in top1.items()},
                drrho_minus_clip=spread(gain), drrho_above_clip=sum(g > 0 for g in gain),
                drrho_over_clip=statistics.mean(top1['drrho']) / statistics.mean(top1['clip']))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--output', type=Path, default=RESULTS / 'demo_seeds')
    args, demo_flags = p.parse_known_args(argv)
    runs = []
    for seed in args.seeds:
        workdir = RESULTS / 'tmp' / args.output.name / f'seed{seed}'
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
    summary = summarize(runs)
    setting = {k: v for k, v in runs[0]['setting'].items() if k != 'seed'}
    report = dict(summary, setting=setting, demo_flags=demo_flags, test_images=runs[0]['test_images'],
                  machine=f'{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}')
    lines = [f"# The demo at {len(args.seeds)} seeds",
             '', f"`python -m drrho_openclip.demo --seed S {' '.join(demo_flags)}` for S in {summary['seeds']}; "
                 f"setting {setting}; zero-shot top-1 (%) on {report['test_images']} test images; {report['machine']}.",
             '', '| model | ' + ' | '.join(f'seed {s}' for s in summary['seeds']) + ' | mean ± std |',
             '|---|' + '---:|' * (len(summary['seeds']) + 1)]
    lines += [f"| {MODELS[model]} | " + ' | '.join(f'{v:.1f}' for v in values) + f" | {summary['mean_std'][model]} |"
              for model, values in summary['top1'].items()]
    lines += ['', f"`drrho` − `clip`, paired by seed: {summary['drrho_minus_clip']} points, `drrho` above in "
                  f"{summary['drrho_above_clip']} of {len(summary['seeds'])} seeds; `drrho` at "
                  f"{summary['drrho_over_clip']:.2f}× `clip`'s mean top-1."]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix('.md').write_text('\n'.join(lines) + '\n')
    args.output.with_suffix('.json').write_text(json.dumps(report, indent=1))
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
