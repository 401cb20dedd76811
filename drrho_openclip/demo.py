"""The embedded default job: DRRho-CLIP end to end on procedurally drawn shapes, on a CPU, with no download.

    python -m drrho_openclip.demo [--workdir DIR] [--epochs N] [--seed S] [--verbose]

1. draws coloured shapes with compositional captions ("a small red circle on a light background") into three
   disjoint CSV splits: the reference model's training set, the target's training set and a test set;
2. trains a tiny reference CLIP on its split with `--loss clip` (OpenCLIP's own training, `open_clip_train.main`).
   As a public reference model has seen more than the target will, it gets four times the target's pairs and twice
   its epochs (eight times its steps) by default: steering pays when the reference knows more than the target can
   learn on its own (a reference trained like the target is no better than it, and the shift then costs accuracy);
3. precomputes the reference features of the target's training split (`drrho_openclip.precompute`);
4. trains the target on its split with `--loss drrho --ref-features ...`,
5. and with `--loss clip` for comparison;
then prints the zero-shot top-1 accuracy of the three models on the test split (classes: colour x shape) and draws
`accuracy.png`: the targets' accuracy after every epoch and their training loss per step, with the reference's
accuracy as a line.

The terminal shows one progress line per stage; the full output of every command (OpenCLIP's logs) goes to
`<workdir>/logs/<run>/console.log` (`--verbose` shows it on the terminal too). Every epoch's checkpoint is scored
as soon as its run ends; then only the last one is kept.
"""
import argparse
import importlib.util
import json
import math
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

COLORS = {'red': (220, 40, 40), 'green': (40, 170, 60), 'blue': (40, 70, 220), 'yellow': (230, 210, 40),
          'purple': (150, 60, 190)}
SHAPES = ('circle', 'square', 'triangle', 'cross')
SIZES = {'small': 0.22, 'large': 0.4}
BACKGROUNDS = {'light': (235, 235, 235), 'dark': (45, 45, 45)}
IMAGE_SIZE = 32
TEST_SAMPLES = 400

TINY_MODEL = {
    "model_cfg": {"embed_dim": 32,
                  "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
                  "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}},
    "preprocess_cfg": {},
}

# one line of open_clip_train's log per logged step: "Train Epoch: 3 [ 512/2048 (25%)] ... Loss: 2.1 (2.3)"
TRAIN_LOG_LINE = re.compile(r'Train Epoch: (\d+) \[\s*(\d+)/\d+ .*? Loss: ([-+\d.eE]+)')
PRECOMPUTE_PROGRESS = re.compile(r'\| (\d+)/\d+ \[')  # precompute's tqdm bar: "part 0/1:  12%|█ | 256/2048 [00:01..."


def zero_shot_classes():
    return [(c, s) for c in COLORS for s in SHAPES]


def shape_classes() -> dict:
    """The shapes' zero-shot task in the class-file form of benchmarks/replication.py: prompts 'a {colour} {shape}',
    class index = label."""
    return {'classnames': [f'{c} {s}' for c, s in zero_shot_classes()], 'templates': ['a {}']}


def draw(color, shape, size, background, rng):
    from PIL import Image, ImageDraw
    image = Image.new('RGB', (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[background])
    d = ImageDraw.Draw(image)
    r = SIZES[size] * IMAGE_SIZE
    cx = rng.uniform(r, IMAGE_SIZE - r)
    cy = rng.uniform(r, IMAGE_SIZE - r)
    fill = tuple(min(255, max(0, v + rng.randint(-25, 25))) for v in COLORS[color])
    if shape == 'circle':
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == 'square':
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == 'triangle':
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = r / 3
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    return image


def caption(color, shape, size, background, rng):
    templates = ("a {size} {color} {shape} on a {bg} background", "a {color} {shape}",
                 "{size} {color} {shape}", "a picture of a {color} {shape}, {size}")
    return rng.choice(templates).format(size=size, color=color, shape=shape, bg=background)


def make_split(root: Path, name: str, count: int, seed: int, progress=None) -> Path:
    """Draw `count` image-caption pairs into root/name/ and write root/name.csv (tab-separated: filepath, title,
    label); `progress`, a tqdm bar, advances by one per image."""
    rng = random.Random(seed)
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["filepath\ttitle\tlabel"]
    classes = zero_shot_classes()
    for i in range(count):
        label = rng.randrange(len(classes))
        color, shape = classes[label]
        size, background = rng.choice(list(SIZES)), rng.choice(list(BACKGROUNDS))
        path = folder / f"{i:06d}.png"
        draw(color, shape, size, background, rng).save(path)
        rows.append(f"{path}\t{caption(color, shape, size, background, rng)}\t{label}")
        if progress is not None:
            progress.update()
    csv = root / f"{name}.csv"
    csv.write_text('\n'.join(rows) + '\n')
    return csv


def write_tiny_model(folder: Path) -> str:
    """A ~3M-parameter CLIP config OpenCLIP loads with `--model local-dir:<folder>` (no weights, no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'open_clip_config.json').write_text(json.dumps(TINY_MODEL))
    return f"local-dir:{folder}"


# ---- training and the test split, shared with benchmarks/replication.py -------------------------------------------

def csv_data_args(csv, separator='\t', img_key='filepath', caption_key='title'):
    """open_clip_train.main's flags for training on a CSV file."""
    return ['--train-data', csv, '--dataset-type', 'csv', '--csv-separator', separator, '--csv-img-key', img_key,
            '--csv-caption-key', caption_key]


def train_args(model, data_args, logs, name, *, epochs, batch_size, lr, seed=0, warmup=10, workers=1,
               log_every_n_steps=1, device='cpu', precision='fp32', extra=()):
    """open_clip_train.main's arguments for a run (on the CPU unless `device` says otherwise) that saves a checkpoint
    after every epoch (to score it)."""
    return [*data_args, '--model', model, '--batch-size', batch_size, '--epochs', epochs, '--lr', lr, '--wd', '0.1',
            '--warmup', warmup, '--workers', workers, '--precision', precision, '--device', device, '--seed', seed,
            '--logs', logs, '--name', name, '--save-frequency', '1', '--log-every-n-steps', log_every_n_steps, *extra]


def labelled_images(csv: Path, preprocess):
    """([n, 3, h, w] preprocessed images, [n] labels) of a CSV split written by `make_split`."""
    import pandas as pd
    import torch
    from PIL import Image
    df = pd.read_csv(csv, sep='\t')
    return torch.stack([preprocess(Image.open(p)) for p in df['filepath']]), torch.tensor(df['label'].values)


# ---- the job ------------------------------------------------------------------------------------------------------

def progress_bar(stage: str, total: int, unit: str, verbose: bool):
    from tqdm import tqdm
    if verbose:  # the commands' own output fills the terminal: the stage is a heading
        print(stage, flush=True)
    return tqdm(total=total, desc=stage, unit=unit, disable=verbose, dynamic_ncols=True, leave=True,
                bar_format='{desc} {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} {unit} '
                           '[{elapsed}<{remaining}]{postfix}')


def run_logged(cmd, log_file: Path, verbose: bool, on_line=None):
    """Run `cmd` with its output (stdout and stderr) written to `log_file`, and shown on the terminal too if
    `verbose`; `on_line(line)` sees every line. A failure stops the job with the log's last lines and its path."""
    cmd = [str(c) for c in cmd]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, 'w') as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
            for line in process.stdout:  # text mode: tqdm's '\r' updates arrive as lines too
                log.write(line)
                if verbose:
                    sys.stdout.write(line)
                if on_line is not None:
                    on_line(line)
    if process.returncode:
        tail = '\n'.join(log_file.read_text().splitlines()[-20:])
        raise SystemExit(f"\n{shlex.join(cmd[:4])} ... failed (exit status {process.returncode}). "
                         f"The end of {log_file}:\n{tail}")


class TrainingRun:
    """One `open_clip_train.main` run: its progress bar advances with the logged steps, its loss per step is kept,
    and when it ends every epoch's checkpoint is scored (then all but the last are deleted: ~40 MB each)."""

    def __init__(self, number, name, label, data_args, args, *, samples, epochs, extra=()):
        self.stage, self.name, self.label, self.args, self.epochs = f'{number} {label}', name, label, args, epochs
        self.argv = train_args(args.model, data_args, args.logs, name, epochs=epochs, batch_size=args.batch_size,
                               lr=args.lr, seed=args.seed, extra=extra)
        self.steps_per_epoch = samples // args.batch_size  # OpenCLIP drops the last partial batch
        self.loss = []  # (step, loss) per logged step
        self.accuracy = []  # after each epoch

    @property
    def checkpoints(self) -> Path:
        return self.args.logs / self.name / 'checkpoints'

    def run(self, test_set):
        bar = progress_bar(self.stage, self.epochs * self.steps_per_epoch, 'steps', self.args.verbose)

        def on_line(line):
            logged = TRAIN_LOG_LINE.search(line)
            if logged:
                epoch, samples, loss = int(logged[1]), int(logged[2]), float(logged[3])
                step = epoch * self.steps_per_epoch + math.ceil(samples / self.args.batch_size)
                self.loss.append((step, loss))
                bar.update(step - bar.n)
                bar.set_postfix_str(f'loss {loss:.3g}', refresh=False)

        run_logged([sys.executable, '-m', 'open_clip_train.main', *self.argv],
                   self.args.logs / self.name / 'console.log', self.args.verbose, on_line)
        from .openclip.evaluation import load_weights, zero_shot_accuracy
        model, tokenizer, images, labels = test_set
        for epoch in range(1, self.epochs + 1):
            checkpoint = self.checkpoints / f'epoch_{epoch}.pt'
            self.accuracy.append(zero_shot_accuracy(load_weights(model, checkpoint), tokenizer, images, labels,
                                                    shape_classes()))
            if epoch < self.epochs:
                checkpoint.unlink()
        bar.set_postfix_str(f'loss {self.loss[-1][1]:.3g}, zero-shot top-1 {self.accuracy[-1]:.1%}')
        bar.close()
        return self


def plot(path: Path, runs, reference_accuracy: float, chance: float):
    """accuracy.png: zero-shot top-1 after every epoch (left) and the training loss per step (right) of each
    target, the reference's accuracy as a line. Each loss is its own objective (drrho's DRO objective is not a
    cross-entropy): compare their shapes, not their values."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, (accuracy, loss) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in runs:
        epochs = range(1, len(run.accuracy) + 1)
        accuracy.plot(epochs, [100 * a for a in run.accuracy], marker='o', label=run.label)
        steps, values = zip(*run.loss)
        loss.plot(steps, values, label=run.label)
    accuracy.axhline(100 * reference_accuracy, color='grey', ls='--', label='reference (its own split)')
    accuracy.axhline(100 * chance, color='grey', ls=':', lw=1, label='chance')
    accuracy.set(xlabel='epoch', ylabel='zero-shot top-1 (%)', ylim=(0, None),
                 title='Zero-shot accuracy on the test split')
    accuracy.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss.set(xlabel='step', ylabel='training loss (its own objective)', title='Training loss')
    for ax in (accuracy, loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc='lower right' if ax is accuracy else 'upper right')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# the drrho run's diagnostics drawn in diagnostics.png, as OpenCLIP's TensorBoard logger records them
DIAGNOSTICS = {'train/tau_image_mean': 'τ', 'train/effective_negatives': 'effective negatives per anchor',
               'train/reference_margin': 'mean reference margin', 'train/log_u_image_mean': 'mean log u (images)'}


def tensorboard_scalars(run_dir: Path) -> dict:
    """{tag: (steps, values)} of a run's TensorBoard event file (`--report-to tensorboard`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / 'tensorboard'))
    events.Reload()
    return {tag: tuple(zip(*[(e.step, e.value) for e in events.Scalars(tag)])) for tag in events.Tags()['scalars']}


def plot_diagnostics(path: Path, run_dir: Path):
    """diagnostics.png: what the drrho run logged besides its loss, read back from its TensorBoard event file."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    logged = tensorboard_scalars(run_dir)
    fig, axes = plt.subplots(1, len(DIAGNOSTICS), figsize=(3.2 * len(DIAGNOSTICS), 2.8))
    for ax, (tag, title) in zip(axes, DIAGNOSTICS.items()):
        ax.plot(*logged[tag])
        ax.set(title=title, xlabel='step')
        ax.grid(alpha=0.3)
    fig.suptitle(f'--loss drrho, from {run_dir.name}/tensorboard (train/ tags)', fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(root: Path, reference, targets, setting: dict):
    """The table of the final zero-shot accuracies, results.json (with the run's `setting`: seed, sizes), and the
    figure (when matplotlib is installed)."""
    chance = 1 / len(zero_shot_classes())
    results = {'reference (clip, its own split)': reference.accuracy[-1],
               'target, --loss drrho': targets[0].accuracy[-1], 'target, --loss clip': targets[1].accuracy[-1]}
    print(f"\n{'model':<34} zero-shot top-1 on {TEST_SAMPLES} test images (chance {chance:.1%})")
    for name, accuracy in results.items():
        print(f"{name:<34} {accuracy:.1%}")
    (root / 'results.json').write_text(json.dumps({
        'zero_shot_top1': results, 'test_images': TEST_SAMPLES, 'chance': chance, 'setting': setting,
        'top1_per_epoch': {run.name: run.accuracy for run in (reference, *targets)},
        'loss_per_step': {run.name: run.loss for run in (reference, *targets)}}, indent=1))
    try:
        plot(root / 'accuracy.png', targets, reference.accuracy[-1], chance)
        print(f"\nfigure:  {root / 'accuracy.png'}")
        if (targets[0].args.logs / targets[0].name / 'tensorboard').is_dir():
            plot_diagnostics(root / 'diagnostics.png', targets[0].args.logs / targets[0].name)
            print(f"         {root / 'diagnostics.png'} (the drrho run's diagnostics, from TensorBoard)")
    except ImportError:
        print("\nfigure:  not drawn, matplotlib is not installed (pip install matplotlib)")
    print(f"results: {root / 'results.json'}\nlogs:    {root / 'logs'}/")


def setting(args) -> dict:
    """What decides a run's results (results.json keeps it): the seed, the data's and the training's sizes."""
    return {flag: getattr(args, flag) for flag in
            ('seed', 'samples', 'epochs', 'reference_samples', 'reference_epochs', 'batch_size', 'lr')}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='drrho-openclip-demo', description=__doc__.split('\n')[0])
    p.add_argument('--workdir', default='drrho-demo', help='where data, features and runs go (default: %(default)s)')
    p.add_argument('--epochs', type=int, default=8, help="the targets' epochs (default: %(default)s)")
    p.add_argument('--samples', type=int, default=2048, help="the targets' training pairs (default: %(default)s)")
    p.add_argument('--reference-samples', type=int,
                   help="the reference's training pairs, drawn apart from the targets' (default: 4 x --samples)")
    p.add_argument('--reference-epochs', type=int, help="the reference's epochs (default: 2 x --epochs)")
    p.add_argument('--seed', type=int, default=0,
                   help='training seed of the three runs; the drawn data stays the same (default: %(default)s)')
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--lr', type=float, default=5e-3)
    p.add_argument('--verbose', action='store_true', help="show the commands' full output (OpenCLIP's logs)")
    args = p.parse_args(argv)
    if args.reference_samples is None:
        args.reference_samples = 4 * args.samples
    if args.reference_epochs is None:
        args.reference_epochs = 2 * args.epochs
    if args.batch_size < 2:
        p.error(f'--batch-size must be at least 2 (a contrastive loss needs negatives), not {args.batch_size}')
    for flag in ('epochs', 'reference_epochs'):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    for flag in ('samples', 'reference_samples'):
        if getattr(args, flag) < args.batch_size:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is less than one batch "
                    f"(--batch-size {args.batch_size})")
    return args


def main(argv=None):
    args = parse_args(argv)
    root = Path(args.workdir).resolve()
    args.logs = root / 'logs'
    if args.logs.exists():
        raise SystemExit(f"{args.logs} exists: pick a new --workdir (runs are never overwritten)")
    print(f"DRRho-CLIP demo in {root}; full logs in {args.logs}/", flush=True)
    data = root / 'data'
    stage = progress_bar('[1/5] drawing shapes', args.reference_samples + args.samples + TEST_SAMPLES, 'images',
                         args.verbose)
    ref_csv = make_split(data, 'reference_train', args.reference_samples, seed=1, progress=stage)
    train_csv = make_split(data, 'train', args.samples, seed=2, progress=stage)
    test_csv = make_split(data, 'test', TEST_SAMPLES, seed=3, progress=stage)
    stage.close()
    args.model = write_tiny_model(root / 'tiny_model')
    from .openclip.evaluation import untrained_model
    model, preprocess, tokenizer = untrained_model(args.model)
    test_set = (model, tokenizer, *labelled_images(test_csv, preprocess))

    reference = TrainingRun('[2/5]', 'reference', 'reference model, --loss clip', csv_data_args(ref_csv), args,
                            samples=args.reference_samples, epochs=args.reference_epochs)
    reference.run(test_set)
    reference_checkpoint = reference.checkpoints / f'epoch_{args.reference_epochs}.pt'

    features = root / 'ref_features'
    stage = progress_bar('[3/5] reference features', args.samples, 'samples', args.verbose)

    def on_precompute_line(line):
        done = PRECOMPUTE_PROGRESS.search(line)
        if done:
            stage.update(int(done[1]) - stage.n)

    run_logged([sys.executable, '-m', 'drrho_openclip.precompute', '--model', args.model, '--pretrained',
                reference_checkpoint, '--train-data', train_csv, '--output', features, '--workers', '1'],
               args.logs / 'precompute' / 'console.log', args.verbose, on_precompute_line)
    stage.close()

    # the drrho run also logs to TensorBoard when it is installed (the test extra has it): diagnostics.png
    tensorboard = ['--report-to', 'tensorboard'] if importlib.util.find_spec('tensorboard') else []
    targets = [TrainingRun('[4/5]', 'drrho', 'target, --loss drrho', csv_data_args(train_csv), args,
                           samples=args.samples, epochs=args.epochs,
                           extra=['--loss', 'drrho', '--ref-features', features, *tensorboard]),
               TrainingRun('[5/5]', 'clip', 'target, --loss clip', csv_data_args(train_csv), args,
                           samples=args.samples, epochs=args.epochs)]
    for run in targets:
        run.run(test_set)

    report(root, reference, targets, setting(args))
    return 0


if __name__ == '__main__':
    sys.exit(main())
