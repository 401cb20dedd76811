"""The embedded default job: DRRho-CLIP end to end on procedurally drawn shapes, on a CPU, with no download.

    python -m drrho_openclip.demo [--workdir DIR] [--epochs N]

1. draws coloured shapes with compositional captions ("a small red circle on a light background") into three
   disjoint CSV splits: the reference model's training set, the target's training set and a test set;
2. trains a tiny reference CLIP on its split with `--loss clip` (OpenCLIP's own training, `open_clip_train.main`);
3. precomputes the reference features of the target's training set (`drrho_openclip.precompute`);
4. trains the target twice on its split: with `--loss drrho --ref-features ...`, and with `--loss clip` for comparison;
5. prints the zero-shot top-1 accuracy of the three models on the test split (classes: colour × shape).
"""
import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

COLORS = {'red': (220, 40, 40), 'green': (40, 170, 60), 'blue': (40, 70, 220), 'yellow': (230, 210, 40),
          'purple': (150, 60, 190)}
SHAPES = ('circle', 'square', 'triangle', 'cross')
SIZES = {'small': 0.22, 'large': 0.4}
BACKGROUNDS = {'light': (235, 235, 235), 'dark': (45, 45, 45)}
IMAGE_SIZE = 32

TINY_MODEL = {
    "model_cfg": {"embed_dim": 32,
                  "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
                  "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}},
    "preprocess_cfg": {},
}


def class_prompt(color, shape):
    return f"a {color} {shape}"


def zero_shot_classes():
    return [(c, s) for c in COLORS for s in SHAPES]


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


def make_split(root: Path, name: str, count: int, seed: int) -> Path:
    """Draw `count` image-caption pairs into root/name/ and write root/name.csv (tab-separated: filepath, title)."""
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
    csv = root / f"{name}.csv"
    csv.write_text('\n'.join(rows) + '\n')
    return csv


def write_tiny_model(folder: Path) -> str:
    """A ~3M-parameter CLIP config OpenCLIP loads with `--model local-dir:<folder>` (no weights, no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'open_clip_config.json').write_text(json.dumps(TINY_MODEL))
    return f"local-dir:{folder}"


def zero_shot_accuracy(model_name: str, checkpoint: str, test_csv: Path) -> float:
    """Top-1 accuracy of colour×shape classification with the prompts 'a {colour} {shape}'."""
    import open_clip
    import pandas as pd
    import torch
    from PIL import Image
    from .precompute import create_model
    model, preprocess = create_model(model_name, checkpoint)
    tokenizer = open_clip.get_tokenizer(model_name)
    df = pd.read_csv(test_csv, sep='\t')
    with torch.no_grad():
        classes = model.encode_text(tokenizer([class_prompt(c, s) for c, s in zero_shot_classes()]), normalize=True)
        images = torch.stack([preprocess(Image.open(p)) for p in df['filepath']])
        predicted = (model.encode_image(images, normalize=True) @ classes.T).argmax(dim=1)
    return (predicted == torch.tensor(df['label'].values)).float().mean().item()


def run(cmd, **kw):
    print('$ ' + ' '.join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def train_command(model, csv, logs, name, epochs, batch_size, lr, extra=()):
    return [sys.executable, '-m', 'open_clip_train.main', '--train-data', csv, '--dataset-type', 'csv',
            '--csv-separator', '\t', '--csv-img-key', 'filepath', '--csv-caption-key', 'title',
            '--model', model, '--batch-size', batch_size, '--epochs', epochs, '--lr', lr, '--wd', '0.1',
            '--warmup', '10', '--workers', '1', '--precision', 'fp32', '--device', 'cpu', '--seed', '0',
            '--logs', logs, '--name', name, '--save-frequency', epochs, '--log-every-n-steps', '20', *extra]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--workdir', default='drrho-demo', help='where data, features and runs go (default: %(default)s)')
    p.add_argument('--epochs', type=int, default=8)
    p.add_argument('--samples', type=int, default=2048, help='training pairs per split')
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--lr', type=float, default=5e-3)
    args = p.parse_args(argv)

    root = Path(args.workdir).resolve()
    if (root / 'logs').exists():
        raise SystemExit(f"{root}/logs exists: pick a new --workdir (runs are never overwritten)")
    data = root / 'data'
    print(f"[1/5] drawing shapes into {data}", flush=True)
    ref_csv = make_split(data, 'reference_train', args.samples, seed=1)
    train_csv = make_split(data, 'train', args.samples, seed=2)
    test_csv = make_split(data, 'test', 400, seed=3)
    model = write_tiny_model(root / 'tiny_model')
    logs = root / 'logs'

    print("[2/5] training the reference model (--loss clip) on its own split", flush=True)
    run(train_command(model, ref_csv, logs, 'reference', args.epochs, args.batch_size, args.lr))
    ref_checkpoint = logs / 'reference' / 'checkpoints' / f'epoch_{args.epochs}.pt'

    print("[3/5] precomputing reference features of the target's training split", flush=True)
    features = root / 'ref_features'
    run([sys.executable, '-m', 'drrho_openclip.precompute', '--model', model, '--pretrained', ref_checkpoint,
         '--train-data', train_csv, '--output', features, '--workers', '1'])

    print("[4/5] training the target with --loss drrho, and with --loss clip for comparison", flush=True)
    run(train_command(model, train_csv, logs, 'drrho', args.epochs, args.batch_size, args.lr,
                      ['--loss', 'drrho', '--ref-features', features]))
    run(train_command(model, train_csv, logs, 'clip', args.epochs, args.batch_size, args.lr))

    print("[5/5] zero-shot top-1 on the test split (20 classes: colour x shape)", flush=True)
    final = lambda name: str(logs / name / 'checkpoints' / f'epoch_{args.epochs}.pt')
    results = {
        'reference (clip, its own split)': zero_shot_accuracy(model, str(ref_checkpoint), test_csv),
        'target, --loss drrho': zero_shot_accuracy(model, final('drrho'), test_csv),
        'target, --loss clip': zero_shot_accuracy(model, final('clip'), test_csv),
    }
    print(f"\n{'model':<34} zero-shot top-1 (chance {1 / len(zero_shot_classes()):.1%})")
    for name, accuracy in results.items():
        print(f"{name:<34} {accuracy:.1%}")
    (root / 'results.json').write_text(json.dumps(results, indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())
