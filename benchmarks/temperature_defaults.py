"""Does `--loss drrho` with no temperature flag match or beat `--loss clip`? And does its learned τ move?

    python benchmarks/temperature_defaults.py            # batches 64 and 256, 3 seeds (~60 min on 2 cores)
    python benchmarks/temperature_defaults.py --quick    # a pipeline check (~3 min)

On the demo's drawn shapes (drrho_openclip/demo.py: data, tiny model, zero-shot classes):

1. a *strong* reference: the tiny CLIP trained with CLIP's loss on a reference split 4x the target's, with 4x the
   target's steps; its features of the target split are the reference features (its evaluation transform);
2. targets with the same compute (the same number of samples seen) at global batch 64 and 256, 3 seeds each:
   `clip` (OpenCLIP's ClipLoss, τ learned as logit_scale by the optimiser), `drrho` at the paper's fixed τ = 0.01,
   `drrho --temperature auto` (τ chosen from the first batch, learned by the loss's own Adam; ρ from the batch),
   `drrho` at a fixed τ = 0.07 and learned from 0.07 (its default: the loss's own Adam), and `sogclr`'s default;
3. zero-shot top-1 and mean per-class recall on a test split (20 classes: colour x shape), mean ± std over seeds,
   and every learned τ's trajectory per step (from the loss's metrics; clip's from its logit_scale);
4. lr_tau: the loss's Adam on log τ alone, on the features of the trained drrho model and the reference, for long
   runs of random batches at several lr_tau: steps to reach its equilibrium from τ = 0.01, and its jitter there.

The targets train in this process with the losses built by `create_loss` (what the plugin builds), the optimiser and
schedule OpenCLIP's main would use (AdamW, betas 0.9/0.98, eps 1e-6, weight decay 0.1 except gains, biases and
logit_scale; warmup then cosine), the model's logit_scale frozen for the DRO losses (the plugin does the same for a
loss that does not read it), and no augmentation (the evaluation transform for every image), so that one process
runs them all without OpenCLIP's start-up per run. Outputs, in benchmarks/results/temperature_defaults/ (suffix
`_quick`): temperature_defaults.md, .json, .png.
"""
import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from drrho_openclip.demo import labelled_images, make_split, shape_classes, write_tiny_model
from drrho_openclip.openclip.evaluation import untrained_model
from drrho_openclip.losses import create_loss

HERE = Path(__file__).resolve().parent
RESULTS = HERE / 'results' / 'temperature_defaults'
WORK = HERE / 'results' / 'tmp' / 'temperature_defaults'

# name -> (loss, options)
FIXED_001 = 'drrho τ=0.01 fixed (the paper\'s)'
CONFIGS = {
    'clip': ('clip', {}),
    FIXED_001: ('drrho', dict(temperature=0.01, learn_temperature=False)),
    'drrho τ auto': ('drrho', dict(temperature='auto')),
    'drrho τ=0.07 fixed': ('drrho', dict(temperature=0.07, learn_temperature=False)),
    'drrho τ=0.07 learned (default)': ('drrho', {}),
    'sogclr (default)': ('sogclr', {}),
}
LR_TAU_GRID = (0.001, 0.003, 0.01, 0.03)
PRESETS = {  # training pairs, samples seen per target, reference steps x, seeds, τ-alone steps
    'full': dict(pairs=2048, seen=64 * 480, reference_factor=4, seeds=3, tau_steps=5000),
    'quick': dict(pairs=512, seen=64 * 40, reference_factor=2, seeds=1, tau_steps=1000),
}
LR, WARMUP = 5e-3, 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a pipeline check, not a measurement')
    p.add_argument('--batch-sizes', type=int, nargs='+', default=[64, 256])
    return p.parse_args(argv)


class Split:
    """A split's preprocessed images, tokenized captions and labels, in memory."""

    def __init__(self, csv, preprocess, tokenizer):
        import pandas as pd
        self.images, self.labels = labelled_images(csv, preprocess)
        self.texts = tokenizer(list(pd.read_csv(csv, sep='\t')['title']))

    def __len__(self):
        return len(self.labels)


def optimiser(model):
    """OpenCLIP main's AdamW: no weight decay for gains, biases and logit_scale."""
    exclude = lambda n, p: p.ndim < 2 or 'bn' in n or 'ln' in n or 'bias' in n or 'logit_scale' in n  # noqa: E731
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([{'params': [p for n, p in named if exclude(n, p)], 'weight_decay': 0.0},
                              {'params': [p for n, p in named if not exclude(n, p)], 'weight_decay': 0.1}],
                             lr=LR, betas=(0.9, 0.98), eps=1e-6)


def learning_rate(step, steps):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (steps - WARMUP))) * LR


def train(model_name, split, loss_name, options, batch_size, steps, seed, reference=None):
    """Train a fresh tiny CLIP; returns (model, τ per step)."""
    torch.manual_seed(seed)
    model, _, _ = untrained_model(model_name)
    model.output_dict = True  # as open_clip_train.main creates it
    model.train()
    batches_per_epoch = len(split) // batch_size  # an epoch drops its partial batch
    if batches_per_epoch == 0:
        raise SystemExit(f"batch size {batch_size} is larger than the {len(split)} training pairs")
    epochs = math.ceil(steps / batches_per_epoch)  # enough epochs for every one of the `steps`
    extra = dict(num_samples=len(split), gamma_decay_epochs=epochs) if loss_name != 'clip' else {}
    loss = create_loss(loss_name, **options, **extra)
    if hasattr(loss, 'set_total_steps'):
        loss.set_total_steps(steps)
    reads_logit_scale = loss_name == 'clip'
    if not reads_logit_scale:
        model.logit_scale.requires_grad_(False)
    opt = optimiser(model)
    g = torch.Generator().manual_seed(1000 + seed)
    taus, step = [], 0
    for epoch in range(epochs):
        if hasattr(loss, 'set_epoch'):
            loss.set_epoch(epoch)
        order = torch.randperm(len(split), generator=g)
        for start in range(0, len(split) - batch_size + 1, batch_size):
            if step == steps:
                break
            index = order[start:start + batch_size]
            for group in opt.param_groups:
                group['lr'] = learning_rate(step, steps)
            out = model(split.images[index], split.texts[index])
            extras = {} if loss_name == 'clip' else dict(index=index)
            if reference is not None and (loss_name == 'drrho' or options.get('distill_weight')):
                extras.update(ref_image_features=reference[0][index], ref_text_features=reference[1][index])
            losses = loss(out['image_features'], out['text_features'], out['logit_scale'], **extras, output_dict=True)
            opt.zero_grad()
            sum(losses.values()).backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            taus.append(1 / model.logit_scale.exp().item() if reads_logit_scale
                        else loss.metrics()['tau_image_mean'])
            step += 1
    return model.eval(), taus


def scores(model, tokenizer, test):
    """(zero-shot top-1, mean per-class recall) on the test split."""
    from open_clip import build_zero_shot_classifier
    classes = shape_classes()
    with torch.no_grad():
        classifier = build_zero_shot_classifier(model, tokenizer, classes['classnames'], classes['templates'],
                                                device='cpu', use_tqdm=False)
        predicted = (model.encode_image(test.images, normalize=True) @ classifier).argmax(1)
    correct = predicted == test.labels
    recalls = [correct[test.labels == c].float().mean().item() for c in test.labels.unique()]
    return correct.float().mean().item(), float(np.mean(recalls))


def features(model, split):
    with torch.no_grad():
        return (torch.cat([model.encode_image(x, normalize=True) for x in split.images.split(512)]),
                torch.cat([model.encode_text(x, normalize=True) for x in split.texts.split(512)]))


def tau_alone(target, reference, batch_size, lr_tau, steps, seed=0):
    """drrho's learned τ on frozen features, from τ = 0.01: its trajectory over `steps` random batches."""
    n = len(target[0])
    loss = create_loss('drrho', num_samples=n, gamma=1.0, temperature=0.01, learn_temperature=True, lr_tau=lr_tau)
    g = torch.Generator().manual_seed(seed)
    image, text = (x.clone().requires_grad_() for x in target)  # the τ-gradient needs a graph; the features stay
    trajectory = []
    for _ in range(steps):
        index = torch.randperm(n, generator=g)[:batch_size]
        loss(image[index], text[index], None, index=index, ref_image_features=reference[0][index],
             ref_text_features=reference[1][index])
        trajectory.append(loss.temperature.log_tau.exp().item())
    return trajectory


def settle(trajectory):
    """(steps until τ is within 10% of its equilibrium (the median of the last half), relative std of τ there)."""
    tail = np.asarray(trajectory[len(trajectory) // 2:])
    level = np.median(tail)
    inside = np.abs(np.asarray(trajectory) / level - 1) <= 0.1
    first = int(np.argmax(inside)) if inside.any() else len(trajectory)
    return first, float(tail.std() / tail.mean()), float(level)


def write_report(directory: Path, name: str, report: dict, text: str):
    """`name`.json (the report) and `name`.md (its tables, also printed) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f'{name}.json').write_text(json.dumps(report, indent=1))
    (directory / f'{name}.md').write_text(text)
    print(text)


def mean_std(values):
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def markdown(report):
    lines = ["# Temperature defaults: drrho vs clip on the demo's shapes",
             '', f"{report['machine']}; {report['minutes']:.1f} min; preset {report['preset']}.", '',
             f"Reference (trained with CLIP's loss on {report['reference']['pairs']} pairs, "
             f"{report['reference']['steps']} steps of batch 128): zero-shot top-1 "
             f"{100 * report['reference']['top1']:.1f}%, mean recall {100 * report['reference']['recall']:.1f}%.",
             f"Targets: {report['pairs']} training pairs, {report['seen']} samples seen per run (same compute at every "
             f"batch), {len(report['seeds'])} seeds.", '',
             '| global batch | loss | zero-shot top-1 (%) | mean recall (%) | τ start → end |', '|---|---|---:|---:|---|']
    for batch, runs in report['runs'].items():
        for name, r in runs.items():
            tau = r['tau']
            lines.append(f"| {batch} | {name} | {100 * r['top1'][0]:.1f} ± {100 * r['top1'][1]:.1f} | "
                         f"{100 * r['recall'][0]:.1f} ± {100 * r['recall'][1]:.1f} | "
                         f"{tau[0]:.4f} → {tau[-1]:.4f} |")
    lines += ['', "## lr_tau: the loss's Adam on log τ alone (frozen features of the trained drrho model, from "
              "τ = 0.01)", '', '| global batch | lr_tau | steps to within 10% of equilibrium | equilibrium τ | '
              'relative std of τ there |', '|---|---:|---:|---:|---:|']
    for batch, rows in report['lr_tau'].items():
        for lr_tau, r in rows.items():
            lines.append(f"| {batch} | {lr_tau} | {r['steps_to_settle']} | {r['equilibrium']:.4f} | "
                         f"{100 * r['relative_std']:.2f}% |")
    return '\n'.join(lines) + '\n'


def plot(report, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    batches = list(report['runs'])
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5 * (len(batches) + 1), 4))
    for ax, batch in zip(axes, batches):
        for name, r in report['runs'][batch].items():
            ax.plot(r['tau'], label=name)
        ax.set(title=f'τ per step, global batch {batch} (seed 0)', xlabel='step', ylabel='τ', yscale='log')
        ax.legend(fontsize=7)
    ax = axes[-1]
    for batch, rows in report['lr_tau'].items():
        for lr_tau, r in rows.items():
            ax.plot(10 * np.arange(1, len(r['trajectory']) + 1), r['trajectory'], linewidth=0.7,
                    label=f'batch {batch}, lr_tau {lr_tau}')
    ax.set(title='τ alone on frozen features', xlabel='step', ylabel='τ', xscale='log', yscale='log')
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def setting(preset):
    """The drawn-shapes splits (reference, train, test), the tiny model and the strong reference trained with CLIP's
    loss: (model name, tokenizer, splits, reference model, its steps)."""
    WORK.mkdir(parents=True, exist_ok=True)
    pairs = preset['pairs']
    data = WORK / f'data_{pairs}'
    csvs = {name: data / f'{name}.csv' for name in ('reference_train', 'train', 'test')}
    if not all(path.exists() for path in csvs.values()):
        make_split(data, 'reference_train', preset['reference_factor'] * pairs, seed=1)
        make_split(data, 'train', pairs, seed=2)
        make_split(data, 'test', 400, seed=3)
    model_name = write_tiny_model(WORK / 'tiny_model')
    _, preprocess, tokenizer = untrained_model(model_name)
    splits = {name: Split(csv, preprocess, tokenizer) for name, csv in csvs.items()}
    reference_steps = preset['reference_factor'] * preset['seen'] // 128
    reference_model, _ = train(model_name, splits['reference_train'], 'clip', {}, 128, reference_steps, seed=100)
    return model_name, tokenizer, splits, reference_model, reference_steps


def main(argv=None):
    args = parse_args(argv)
    preset = PRESETS['quick' if args.quick else 'full']
    suffix = '_quick' if args.quick else ''
    torch.set_num_threads(min(2, os.cpu_count()))
    started = time.time()
    pairs = preset['pairs']
    reference_pairs = preset['reference_factor'] * pairs
    model_name, tokenizer, splits, reference_model, reference_steps = setting(preset)
    print(f"data: {reference_pairs} reference pairs, {pairs} training pairs, 400 test images", flush=True)
    top1, recall = scores(reference_model, tokenizer, splits['test'])
    print(f"reference: top-1 {100 * top1:.1f}%, mean recall {100 * recall:.1f}%", flush=True)
    reference = features(reference_model, splits['train'])
    report = dict(machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, load "
                          f"{os.getloadavg()[0]:.1f}", preset='quick' if args.quick else 'full', pairs=pairs,
                  seen=preset['seen'], seeds=list(range(preset['seeds'])),
                  reference=dict(pairs=reference_pairs, steps=reference_steps, top1=top1, recall=recall),
                  runs={}, lr_tau={})
    trained = {}
    for batch in args.batch_sizes:
        steps = preset['seen'] // batch
        report['runs'][batch] = {}
        for name, (loss_name, options) in CONFIGS.items():
            results = []
            for seed in report['seeds']:
                model, taus = train(model_name, splits['train'], loss_name, options, batch, steps, seed, reference)
                results.append((*scores(model, tokenizer, splits['test']), taus))
                if name == FIXED_001 and seed == 0:
                    trained[batch] = features(model, splits['train'])
            report['runs'][batch][name] = dict(top1=mean_std([r[0] for r in results]),
                                               recall=mean_std([r[1] for r in results]),
                                               per_seed=[r[:2] for r in results], tau=results[0][2])
            r = report['runs'][batch][name]
            print(f"batch {batch:4d} {name:18s} top-1 {100 * r['top1'][0]:5.1f} ± {100 * r['top1'][1]:4.1f}  "
                  f"recall {100 * r['recall'][0]:5.1f}  τ {r['tau'][0]:.4f} → {r['tau'][-1]:.4f} "
                  f"({(time.time() - started) / 60:.1f} min)", flush=True)
    for batch in args.batch_sizes:
        report['lr_tau'][batch] = {}
        for lr_tau in LR_TAU_GRID:
            trajectory = tau_alone(trained[batch], reference, batch, lr_tau, preset['tau_steps'])
            first, jitter, level = settle(trajectory)
            report['lr_tau'][batch][lr_tau] = dict(steps_to_settle=first, relative_std=jitter, equilibrium=level,
                                                   trajectory=trajectory[::10])
            print(f"lr_tau {lr_tau}: batch {batch}: settles in {first} steps at τ {level:.4f}, relative std "
                  f"{100 * jitter:.2f}%", flush=True)
    report['minutes'] = (time.time() - started) / 60
    write_report(RESULTS, f'temperature_defaults{suffix}', report, markdown(report))
    plot(report, RESULTS / f'temperature_defaults{suffix}.png')
    return 0


if __name__ == '__main__':
    sys.exit(main())
