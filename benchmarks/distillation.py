"""Does distillation from a strong reference help, and why did it not with CLIP's teacher scale of 100?

    python benchmarks/distillation.py            # batch 64, 3 seeds (~20 min on 2 cores)
    python benchmarks/distillation.py --quick    # a pipeline check (~2 min)

The setting of benchmarks/temperature_defaults.py (the demo's drawn shapes, a strong reference trained with CLIP's
loss on 4x the target's pairs, targets with the same number of samples seen, the training loop OpenCLIP's main
would run, 3 seeds): `clip` and `drrho` (their defaults), each with KD from the reference at λ = 0.5 with the
teacher's logit scale fixed at CLIP's 100 (the former default) and calibrated on the first batch ('auto', the new
default; distill.calibrated_logit_scale). Reported: zero-shot top-1 and mean per-class recall (mean ± std over
seeds), the calibrated teacher scale, and how confident each teacher is: the mean probability it gives its own top
candidate, against how often that candidate is the positive (its in-batch accuracy). Outputs in
benchmarks/results/distillation/ (suffix `_quick`): distillation.md, .json.
"""
import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from temperature_defaults import PRESETS, features, mean_std, scores, setting, train, write_report  # noqa: E402

from drrho_openclip.losses.distill import calibrated_logit_scale  # noqa: E402

RESULTS = Path(__file__).resolve().parent / 'results' / 'distillation'
LAMBDA = 0.5
CONFIGS = {  # name -> (loss, options)
    'clip': ('clip', {}),
    'clip + KD, teacher scale 100': ('clip', dict(distill_weight=LAMBDA, reference_logit_scale=100.0)),
    'clip + KD, teacher scale auto': ('clip', dict(distill_weight=LAMBDA)),
    'drrho': ('drrho', {}),
    'drrho + KD, teacher scale 100': ('drrho', dict(distill_weight=LAMBDA, reference_logit_scale=100.0)),
    'drrho + KD, teacher scale auto': ('drrho', dict(distill_weight=LAMBDA)),
}


def teacher_confidence(reference, batch_size, scale):
    """(mean probability of the teacher's top candidate, fraction of anchors whose top candidate is the positive)
    over the consecutive batches of the training split, both directions."""
    confidence, accuracy = [], []
    for start in range(0, len(reference[0]) - batch_size + 1, batch_size):
        image, text = (x[start:start + batch_size].double() for x in reference)
        for logits in (image @ text.T, text @ image.T):
            p = torch.softmax(scale * logits, dim=1)
            confidence.append(p.max(1).values.mean().item())
            accuracy.append((logits.argmax(1) == torch.arange(batch_size)).double().mean().item())
    return sum(confidence) / len(confidence), sum(accuracy) / len(accuracy)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a pipeline check, not a measurement')
    p.add_argument('--batch-size', type=int, default=64)
    args = p.parse_args(argv)
    preset = PRESETS['quick' if args.quick else 'full']
    suffix = '_quick' if args.quick else ''
    torch.set_num_threads(min(2, os.cpu_count()))
    started = time.time()
    model_name, tokenizer, splits, reference_model, _ = setting(preset)
    top1, recall = scores(reference_model, tokenizer, splits['test'])
    reference = features(reference_model, splits['train'])
    batch = args.batch_size
    auto = calibrated_logit_scale(reference[0][:batch], reference[1][:batch]).item()
    teachers = {f'{scale:g}': dict(zip(('confidence', 'accuracy'), teacher_confidence(reference, batch, scale)))
                for scale in (100.0, auto)}
    print(f"reference: top-1 {100 * top1:.1f}%; calibrated teacher scale {auto:.1f}; {teachers}", flush=True)
    report = dict(machine=f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                  preset='quick' if args.quick else 'full', batch=batch, seen=preset['seen'], distill_weight=LAMBDA,
                  seeds=list(range(preset['seeds'])), reference=dict(top1=top1, recall=recall),
                  calibrated_scale=auto, teachers=teachers, runs={})
    steps = preset['seen'] // batch
    for name, (loss_name, options) in CONFIGS.items():
        results = [scores(train(model_name, splits['train'], loss_name, options, batch, steps, seed, reference)[0],
                          tokenizer, splits['test']) for seed in report['seeds']]
        report['runs'][name] = dict(top1=mean_std([r[0] for r in results]), recall=mean_std([r[1] for r in results]),
                                    per_seed=results)
        r = report['runs'][name]
        print(f"{name:32s} top-1 {100 * r['top1'][0]:5.1f} ± {100 * r['top1'][1]:4.1f}  "
              f"({(time.time() - started) / 60:.1f} min)", flush=True)
    report['minutes'] = (time.time() - started) / 60
    write_report(RESULTS, f'distillation{suffix}', report, markdown(report))
    return 0


def markdown(report):
    lines = ["# Distillation from a strong reference: the teacher's logit scale", '',
             f"{report['machine']}; {report['minutes']:.1f} min; preset {report['preset']}; global batch "
             f"{report['batch']}, {report['seen']} samples seen per run, λ = {report['distill_weight']}, "
             f"{len(report['seeds'])} seeds.", '',
             f"Reference: zero-shot top-1 {100 * report['reference']['top1']:.1f}%, mean recall "
             f"{100 * report['reference']['recall']:.1f}%. Calibrated teacher scale ('auto', first batch): "
             f"{report['calibrated_scale']:.1f}.", '',
             '| teacher scale | mean probability of its top candidate | how often that candidate is the positive |',
             '|---:|---:|---:|']
    for scale, t in report['teachers'].items():
        lines.append(f"| {scale} | {100 * t['confidence']:.1f}% | {100 * t['accuracy']:.1f}% |")
    lines += ['', '| run | zero-shot top-1 (%) | mean recall (%) |', '|---|---:|---:|']
    for name, r in report['runs'].items():
        lines.append(f"| {name} | {100 * r['top1'][0]:.1f} ± {100 * r['top1'][1]:.1f} | "
                     f"{100 * r['recall'][0]:.1f} ± {100 * r['recall'][1]:.1f} |")
    return '\n'.join(lines) + '\n'


if __name__ == '__main__':
    sys.exit(main())
