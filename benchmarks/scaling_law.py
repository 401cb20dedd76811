"""Fit the scaling law E = α·C^β per method (seed 001, §6.3) and plot the fits side by side.

    python benchmarks/scaling_law.py benchmarks/scaling_law_example.csv
    python benchmarks/scaling_law.py benchmarks/results/replication/scaling_input.csv   # written by replication.py

Input: a CSV, or JSON (a list of records, or {"runs": [...]}), one row per evaluated run:

    method, samples_seen, error (zero-shot error in (0, 1]; or accuracy, taken as 1 − accuracy),
    and gflops_per_sample, or model (an OpenCLIP model name or local-dir:PATH)

C = training GFLOPs = per-sample GFLOPs × samples seen. Per-sample GFLOPs of a model name are counted with
`torch.utils.flop_counter.FlopCounterMode` (no fvcore) over one forward + backward of the whole model (image and
text towers, one sample at the model's own image size and context length; matmuls, convolutions and attention,
which is what the counter counts), on the meta device: no weights, no download, no real arithmetic. This is the
training cost of a sample, about 3× the forward-only GFLOPs of OpenCLIP's model profile
(`open_clip_train.profiler`: ViT-B-32 14.8, counted here 44.1). A constant factor on C changes α, never β, so fits
are comparable across methods as long as one convention is used for all rows.

Fit: per method, ordinary least squares of log E = log α + β log C (natural logs); R² is that of the log-space fit.
Writes `<output>.md` (table of α, β, R², points), `<output>.json` and `<output>.png` (one log-log panel per method,
side by side, shared axes; every panel also shows the other methods' fits, faint, for comparison).
"""
import argparse
import csv
import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

FIELDS = ('method', 'samples_seen', 'gflops_per_sample', 'model', 'error')


@lru_cache(maxsize=None)
def gflops_per_sample(model_name: str) -> float:
    """Training GFLOPs of one sample (forward + backward, image + text) of an OpenCLIP model, counted on meta."""
    import open_clip
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device('meta'):
        model = open_clip.create_model(model_name, pretrained=None, device='meta')
    size = model.visual.image_size
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    image = torch.zeros(1, 3, *size, device='meta')
    text = torch.zeros(1, model.context_length, dtype=torch.long, device='meta')
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(image, text)
        image_features, text_features = (out['image_features'], out['text_features']) if isinstance(out, dict) \
            else out[:2]
        (image_features.sum() + text_features.sum()).backward()
    return counter.get_total_flops() / 1e9


def read_rows(path) -> list:
    path = Path(path)
    if path.suffix == '.json':
        data = json.loads(path.read_text())
        rows = data['runs'] if isinstance(data, dict) else data
    else:
        with open(path, newline='') as f:
            rows = list(csv.DictReader(f))
    out = []
    for i, row in enumerate(rows):
        row = {k: v for k, v in row.items() if v not in (None, '')}
        if 'error' not in row and 'accuracy' not in row:
            raise SystemExit(f"{path} row {i + 1}: needs an error (or accuracy) column")
        if 'gflops_per_sample' not in row and 'model' not in row:
            raise SystemExit(f"{path} row {i + 1}: needs gflops_per_sample or model")
        error = float(row['error']) if 'error' in row else 1.0 - float(row['accuracy'])
        gflops = float(row['gflops_per_sample']) if 'gflops_per_sample' in row else gflops_per_sample(row['model'])
        out.append(dict(method=row['method'], samples_seen=float(row['samples_seen']), gflops_per_sample=gflops,
                        model=row.get('model', ''), error=error))
    return out


def write_rows(rows, path):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)


def fit_power_law(compute, error):
    """α, β, R² of E = α·C^β by least squares in log space."""
    x, y = np.log(np.asarray(compute, float)), np.log(np.asarray(error, float))
    beta, log_alpha = np.polyfit(x, y, 1)
    residual = y - (log_alpha + beta * x)
    total = ((y - y.mean()) ** 2).sum()
    return float(np.exp(log_alpha)), float(beta), float(1 - (residual ** 2).sum() / total) if total > 0 else 1.0


def fit_all(rows) -> dict:
    fits = {}
    for method in dict.fromkeys(r['method'] for r in rows):
        points = [r for r in rows if r['method'] == method]
        compute = [r['gflops_per_sample'] * r['samples_seen'] for r in points]
        if len(set(compute)) < 2 or any(r['error'] <= 0 for r in points):
            print(f"{method}: skipped (needs ≥ 2 distinct compute values and errors > 0)", file=sys.stderr)
            continue
        alpha, beta, r2 = fit_power_law(compute, [r['error'] for r in points])
        fits[method] = dict(alpha=alpha, beta=beta, r2=r2, points=[[c, r['error']] for c, r in zip(compute, points)])
    return fits


def markdown(fits, source) -> str:
    lines = ["# Scaling law E = α·C^β per method", '',
             f"Input: `{source}`. C = training GFLOPs (per-sample forward+backward GFLOPs × samples seen), E = "
             f"zero-shot error; least squares of log E on log C. A lower (more negative) β is a better scaling law.",
             '', '| method | α | β | R² (log space) | points | C range (GFLOPs) |', '|---|---:|---:|---:|---:|---|']
    for method, f in fits.items():
        compute = [c for c, _ in f['points']]
        lines.append(f"| {method} | {f['alpha']:.4g} | {f['beta']:.4f} | {f['r2']:.3f} | {len(compute)} | "
                     f"{min(compute):.3g} – {max(compute):.3g} |")
    return '\n'.join(lines) + '\n'


def plot(fits, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter
    cols = min(4, len(fits))
    rows = -(-len(fits) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), sharex=True, sharey=True, squeeze=False)
    all_c = np.array([c for f in fits.values() for c, _ in f['points']])
    grid = np.geomspace(all_c.min(), all_c.max(), 50)
    for ax, (method, f) in zip(axes.flat, fits.items()):
        for other, g in fits.items():
            if other != method:
                ax.plot(grid, g['alpha'] * grid ** g['beta'], color='grey', lw=0.8, alpha=0.35)
        c, e = np.array(f['points']).T
        ax.scatter(c, e, s=14, zorder=3)
        ax.plot(grid, f['alpha'] * grid ** f['beta'], 'C3', label=f"E = {f['alpha']:.3g}·C^{f['beta']:.3f}")
        ax.set(xscale='log', yscale='log', title=method)
        ax.xaxis.set_minor_formatter(NullFormatter())  # errors span less than a decade: label the minor y ticks
        ax.yaxis.set_minor_formatter(FormatStrFormatter('%.2g'))
        ax.yaxis.set_major_formatter(FormatStrFormatter('%.2g'))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which='both')
    for ax in axes.flat[len(fits):]:
        ax.axis('off')
    for ax in axes[-1]:
        ax.set_xlabel('training compute C (GFLOPs)')
    for ax in axes[:, 0]:
        ax.set_ylabel('zero-shot error E')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('input', help='CSV or JSON of evaluated runs (see the module docstring)')
    p.add_argument('--methods', nargs='+', help='fit only these methods (default: all in the input)')
    p.add_argument('--output', help='output path without suffix (default: benchmarks/results/scaling_law/<input>)')
    args = p.parse_args(argv)
    rows = [r for r in read_rows(args.input) if not args.methods or r['method'] in args.methods]
    fits = fit_all(rows)
    if not fits:
        raise SystemExit('nothing to fit')
    out = Path(args.output or Path(__file__).resolve().parent / 'results' / 'scaling_law' / Path(args.input).stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix('.json').write_text(json.dumps(dict(input=str(args.input), fits=fits), indent=1))
    out.with_suffix('.md').write_text(markdown(fits, args.input))
    plot(fits, out.with_suffix('.png'))
    print(markdown(fits, args.input))
    print(f"wrote {out}.md, .json, .png")
    return 0


if __name__ == '__main__':
    sys.exit(main())
