"""One table from the evidence runs of `replication.py` (benchmarks/results/evidence/<data>_batch<B>/, each with its
command in command.txt): every method's zero-shot top-1 and mean recall at 100 % of the data (and 50 % where it was
run), mean ± std over seeds, its mean recall relative to `clip`'s, its paired difference from `clip` (the same seed
gives the same initialisation, so a per-seed difference removes that shared luck, though not the data order's: plain
`clip` runs OpenCLIP's own loader, whose shuffle is another order than the plugin's seeded one; mean recall in the
table, with each R@k and class@1 below it; top-1 too in summary.json), and the §6.1 variance check.

    python benchmarks/evidence_summary.py [FOLDER]   # writes FOLDER/summary.{md,json,png}; default below

It also writes FOLDER/defaults.md: the folders named `*_defaults` (each setting's every method in one run at the
plugin's defaults of the day it ran) side by side, one column per setting, the README's evidence table. A folder
`*_defaults_deduplicated` (the same setting run again on the openclipart split without copies of its test images in
training) takes the place of its `*_defaults`.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

EVIDENCE = Path(__file__).resolve().parent / 'results' / 'evidence'
DEFAULTS_SUFFIX = '_defaults'
DEDUPLICATED_SUFFIX = '_deduplicated'


def load(evidence: Path):
    runs = {}
    for folder in sorted(evidence.iterdir()):
        result = folder / 'replication.json'
        if result.is_file():
            runs[folder.name] = json.loads(result.read_text())
    if not runs:
        raise SystemExit(f"no replication.json under {evidence}: run the commands in its folders' command.txt first")
    for report in runs.values():
        borrow_clip(report, runs)
    return runs


def setting(report) -> tuple:
    """What decides a `clip` run's result besides its seed and fraction: the data, the reference, and every training
    choice (not the scratch path of the model's config, nor which fractions the run also covered)."""
    config = {k: v for k, v in report['config'].items() if k not in ('model', 'fractions')}
    return (report['data']['name'], json.dumps(report['data'].get('sizes'), sort_keys=True),
            report.get('reference_description'), report['reference_accuracy'], report['reference_mean_recall'],
            json.dumps(config, sort_keys=True))


def borrow_clip(report, runs):
    """A run of variants without `clip` takes `clip`'s entries and per-seed runs from a run of the same setting (a
    seed fixes the data order and the initialisation, so the same setting repeats `clip` to the digit), and names it
    in `clip_from`; unchanged when no such run covers its fractions."""
    if 'clip' in report['summary']:
        return
    fractions = {f for per in report['summary'].values() for f in per}
    for name, other in runs.items():
        clip = other['summary'].get('clip', {})
        if other is not report and fractions <= set(clip) and setting(other) == setting(report):
            report['summary'] = {'clip': {f: clip[f] for f in sorted(fractions, key=float)}, **report['summary']}
            report['runs'] = [r for r in other.get('runs', ()) if r['loss'] == 'clip'
                              and str(r['fraction']) in fractions] + report.get('runs', [])
            report['clip_from'] = name
            return


def ratio(summary, loss, fraction):
    """mean recall of `loss` / `clip`'s at the same fraction (means over seeds)."""
    base = summary.get('clip', {}).get(fraction)
    own = summary.get(loss, {}).get(fraction)
    if not base or not own or not base['mean_recall'][0]:
        return None
    return own['mean_recall'][0] / base['mean_recall'][0]


def paired_difference(report, loss, fraction, key='mean_recall', scale=1):
    """(mean, standard error, wins, n) of `loss`'s `key` (×`scale`) minus `clip`'s over the seeds both ran at
    `fraction`, or None without at least two such seeds. `key` names a run's own value or, when it is not one, one of
    its `retrieval` values (R@k, class@1)."""
    values = {}
    for run in report.get('runs', ()):
        value = run.get(key, run.get('retrieval', {}).get(key))
        if str(run['fraction']) == fraction and value is not None:
            values.setdefault(run['loss'], {})[run['seed']] = scale * value
    if loss == 'clip' or loss not in values or 'clip' not in values:
        return None
    differences = [values[loss][seed] - values['clip'][seed] for seed in sorted(values[loss].keys() & values['clip'])]
    if len(differences) < 2:
        return None
    n = len(differences)
    return (statistics.fmean(differences), statistics.stdev(differences) / math.sqrt(n),
            sum(d > 0 for d in differences), n)


def retrieval_keys(report):
    """The retrieval values every run of a setting reports (class@1 only in the settings measured since it was)."""
    per_run = [set(run.get('retrieval', {})) for run in report.get('runs', ())]
    return sorted(set.intersection(*per_run)) if per_run else []


def paired_cell(report, loss, fraction, key='mean_recall'):
    paired = paired_difference(report, loss, fraction, key)
    if paired is None:
        return ''
    mean, standard_error, wins, n = paired
    return f"{mean:+.1f} ± {standard_error:.1f} ({wins}/{n})"


def cell(entry, key, scale):
    if not entry:
        return ''
    mean, std = entry[key]
    return f"{scale * mean:.1f} ± {scale * std:.1f}"


def markdown(runs) -> str:
    datasets = sorted({report['data']['name'] for report in runs.values()})
    batches = sorted({report['config']['batch_size'] for report in runs.values()})
    batch_range = f"{batches[0]}" if len(batches) == 1 else f"{batches[0]} to {batches[-1]}"
    lines = [f"# Evidence: every method against `clip` on {', '.join(datasets)}, global batch {batch_range}", '',
             "Zero-shot top-1 (%) and mean recall (%: the mean of image→text and text→image R@1 and R@5 over the test "
             "split's pairs), mean ± std over seeds; ×clip: mean recall over `clip`'s; Δ recall: the mean over seeds of "
             "(its mean recall − `clip`'s with the same seed) ± its standard error, and in how many seeds it was "
             "above. Each setting's replication.md has the details (data, model, reference, machine, per-seed values, "
             "curves).", '']
    for name, report in runs.items():
        config, summary = report['config'], report['summary']
        fractions = sorted({f for per in summary.values() for f in per}, key=float)
        seeds = sorted({entry['seeds'] for per in summary.values() for entry in per.values()})
        lines += [f"## {name}: {report['data']['name']}, global batch {config['batch_size']}", '',
                  f"{config['samples_seen']} samples seen per run, {'/'.join(map(str, seeds))} seeds; reference"
                  + (f" ({report['reference_description']})" if 'reference_description' in report else '') +
                  f": zero-shot "
                  f"{100 * report['reference_accuracy']:.1f} %, mean recall {report['reference_mean_recall']:.1f} %; "
                  f"{report['machine']}."
                  + (f" `clip` from {report['clip_from']} (the same setting and seeds)." if 'clip_from' in report
                     else ''), '']
        header = '| loss |' + ''.join(f" top-1 {p:g} % | recall {p:g} % | ×clip {p:g} % | Δ recall {p:g} % |"
                                      for p in (100 * float(f) for f in reversed(fractions)))
        lines += [header, '|---|' + '---:|' * 4 * len(fractions)]
        for loss, per in summary.items():
            row = f"| {loss} |"
            for f in reversed(fractions):
                r = ratio(summary, loss, f)
                row += (f" {cell(per.get(f), 'accuracy', 100)} | {cell(per.get(f), 'mean_recall', 1)} | "
                        f"{'' if r is None else f'{r:.2f}'} | {paired_cell(report, loss, f)} |")
            lines.append(row)
        keys = retrieval_keys(report)
        if keys and any(paired_difference(report, loss, '1.0', keys[0]) for loss in summary):
            lines += ['', "Each retrieval value's paired difference from `clip` at 100 % data (percentage points, as "
                      "Δ recall above; class@1: the top-ranked caption or image is of the query's category):", '',
                      '| loss |' + ''.join(f' Δ {key} |' for key in keys), '|---|' + '---:|' * len(keys)]
            lines += [f"| {loss} |" + ''.join(f" {paired_cell(report, loss, '1.0', key)} |" for key in keys)
                      for loss in summary if loss != 'clip']
        variance = {loss: per['1.0']['variance'] for loss, per in summary.items()
                    if per.get('1.0', {}).get('variance')}
        if variance:
            lines += ['', "§6.1 variance at the trained models (100 % data): the plain loss Var ℓ(θ, z) and the RHO "
                      "loss Var [ℓ(θ, z) − ℓ(θ_ref, z)], image / text:", '',
                      '| loss | Var ℓ | Var (ℓ − ℓ_ref) |', '|---|---:|---:|']
            for loss, v in variance.items():
                lines.append(f"| {loss} | {v['plain_image'][0]:.3f} / {v['plain_text'][0]:.3f} | "
                             f"{v['rho_image'][0]:.3f} / {v['rho_text'][0]:.3f} |")
        lines.append('')
    return '\n'.join(lines)


def setting_label(report) -> str:
    config = report['config']
    reference = 'pretrained reference' if 'pretrained' in (report.get('reference_description') or '') else \
        'CLIP reference'
    return f"{report['data']['name']}, batch {config['batch_size']}, {config['samples_seen']} seen, {reference}"


def defaults_folders(runs) -> dict:
    """The `*_defaults` folders, each `*_defaults_deduplicated` one in place of the folder it ran again."""
    found = {name: report for name, report in runs.items()
             if name.endswith(DEFAULTS_SUFFIX) or name.endswith(DEFAULTS_SUFFIX + DEDUPLICATED_SUFFIX)}
    return {name: report for name, report in found.items() if name + DEDUPLICATED_SUFFIX not in found}


def column_label(name) -> str:
    base = name.removesuffix(DEDUPLICATED_SUFFIX)
    return base.removesuffix(DEFAULTS_SUFFIX) + (' (deduplicated)' if base != name else '')


def defaults_markdown(runs) -> str:
    """One table per fraction: every loss of the defaults folders (by global batch, then samples seen) against each
    setting's `clip`, a cell being top-1 / mean recall (mean ± std), ×clip and the paired recall difference Δ ± its
    standard error (seeds above)."""
    chosen = dict(sorted(defaults_folders(runs).items(),
                         key=lambda item: (item[1]['config']['batch_size'], item[1]['config']['samples_seen'],
                                           item[0])))
    if not chosen:
        return ''
    losses = list(dict.fromkeys(loss for report in chosen.values() for loss in report['summary']))
    lines = ["# Today's defaults against `clip`, every method of a setting in one run", '',
             "Cells: zero-shot top-1 / mean recall (%), mean ± std over seeds; (×clip's mean recall; Δ: the paired "
             "mean-recall difference from `clip` ± its standard error over the same seeds).", '']
    fractions = sorted({f for report in chosen.values() for per in report['summary'].values() for f in per},
                       key=float, reverse=True)
    for fraction in fractions:
        columns = {name: report for name, report in chosen.items()
                   if any(fraction in per for per in report['summary'].values())}
        lines += [f"## {100 * float(fraction):g} % of the data", '',
                  '| loss |' + ''.join(f" {column_label(name)} |" for name in columns),
                  '|---|' + '---:|' * len(columns),
                  '| reference |' + ''.join(f" {100 * r['reference_accuracy']:.1f} / {r['reference_mean_recall']:.1f} |"
                                            for r in columns.values())]
        for loss in losses:
            row = f"| `{loss}` |"
            for report in columns.values():
                entry = report['summary'].get(loss, {}).get(fraction)
                text = f"{cell(entry, 'accuracy', 100)} / {cell(entry, 'mean_recall', 1)}" if entry else ''
                r, paired = ratio(report['summary'], loss, fraction), paired_difference(report, loss, fraction)
                if r is not None and loss != 'clip':
                    text += f" ({r:.2f}×" + ('' if paired is None else
                                             f"; Δ {paired[0]:+.1f} ± {paired[1]:.1f}, {paired[2]} of {paired[3]} above")
                    text += ')'
                row += f" {text} |"
            lines.append(row)
        lines += ['', 'Settings: ' + '; '.join(f"{column_label(name)}: {setting_label(r)}"
                                               for name, r in columns.items()) + '.', '']
    return '\n'.join(lines)


def plot(runs, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(runs), figsize=(4.5 * len(runs), 7), squeeze=False)
    for column, (name, report) in enumerate(runs.items()):
        summary = report['summary']
        losses = [loss for loss in summary if '1.0' in summary[loss]]
        for row, (key, scale, label) in enumerate((('accuracy', 100, 'zero-shot top-1 (%)'),
                                                   ('mean_recall', 1, 'mean recall (%)'))):
            ax = axes[row][column]
            means = [scale * summary[loss]['1.0'][key][0] for loss in losses]
            stds = [scale * summary[loss]['1.0'][key][1] for loss in losses]
            ax.barh(range(len(losses)), means, xerr=stds, color=['tab:red' if l.startswith('drrho') else 'tab:grey'
                                                                  for l in losses])
            ax.set_yticks(range(len(losses)), [l.replace(' --', '\n--') for l in losses], fontsize=6)
            ax.set_xlabel(label)
            ax.set_title(name.replace('_', ' '), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('folder', nargs='?', default=str(EVIDENCE),
                   help='the evidence folder, one replication.py output per subfolder (default: %(default)s)')
    evidence = Path(p.parse_args(argv).folder)
    runs = load(evidence)
    out = {name: dict(config=r['config'], clip_from=r.get('clip_from'), reference_accuracy=r['reference_accuracy'],
                      reference_mean_recall=r['reference_mean_recall'], summary={
                          loss: {f: {k: v for k, v in s.items() if k != 'curve'} for f, s in per.items()}
                          for loss, per in r['summary'].items()},
                      recall_vs_clip={loss: {f: ratio(r['summary'], loss, f) for f in per}
                                      for loss, per in r['summary'].items()},
                      paired_recall_vs_clip={loss: {f: paired_difference(r, loss, f) for f in per}
                                             for loss, per in r['summary'].items()},
                      paired_top1_vs_clip={loss: {f: paired_difference(r, loss, f, 'accuracy', 100) for f in per}
                                           for loss, per in r['summary'].items()},
                      paired_retrieval_vs_clip={loss: {f: {key: paired_difference(r, loss, f, key)
                                                           for key in retrieval_keys(r)} for f in per}
                                                for loss, per in r['summary'].items()})
           for name, r in runs.items()}
    (evidence / 'summary.json').write_text(json.dumps(out, indent=1))
    text = markdown(runs)
    (evidence / 'summary.md').write_text(text)
    plot(runs, evidence / 'summary.png')
    defaults = defaults_markdown(runs)
    if defaults:
        (evidence / 'defaults.md').write_text(defaults)
    print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
