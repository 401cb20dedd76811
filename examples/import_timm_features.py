"""Reference features from a model that is not an OpenCLIP model, imported into a store that training reads.

    python examples/import_timm_features.py [--workdir import-example] [--samples 256]

Runs offline on a CPU in under a minute:
1. draws a small image-caption CSV (the demo's shapes; use your own CSV or WebDataset shards instead);
2. computes image features with a timm backbone (`resnet18`, random weights here: `pretrained=True` and a real
   model for actual use) and text features with a stand-in text tower (a hashed bag of words), one row per sample;
3. saves them per data shard -- a CSV file is one shard, named after the file, keyed by its image paths -- as
   `features/<shard>.npz` with the arrays image_features, text_features and keys;
4. imports them: `drrho-openclip-features import features/ --train-data train.csv --output ref/ --normalize`
   (`--normalize`: like SigLIP's get_image_features, this model's embeddings are not unit-norm), and checks the
   store with `drrho-openclip-features verify`.

A real reference maps images and texts into one space, e.g. a Hugging Face SigLIP:
`model.get_image_features(**processor(images=...))` and `model.get_text_features(**processor(text=...))`; only
step 2 changes.
"""
import argparse
import sys
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import timm
import torch
from PIL import Image

from drrho_openclip.demo import make_split
from drrho_openclip.precompute import main as features_command


def image_features(paths, batch_size=64):
    """[n, 512] pooled features of a timm ResNet-18 (random weights: no download), through timm's own transform."""
    model = timm.create_model('resnet18', pretrained=False, num_classes=0).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    rows = []
    with torch.no_grad():
        for start in range(0, len(paths), batch_size):
            images = torch.stack([transform(Image.open(p).convert('RGB')) for p in paths[start:start + batch_size]])
            rows.append(model(images))
    return torch.cat(rows).numpy()


def text_features(captions, dim=512, buckets=4096):
    """[n, dim] stand-in text tower: the mean of a fixed random embedding of each word's hash."""
    table = torch.nn.EmbeddingBag(buckets, dim, mode='mean')
    torch.nn.init.normal_(table.weight, generator=torch.Generator().manual_seed(0))
    words = [[zlib.crc32(w.encode()) % buckets for w in caption.lower().split()] for caption in captions]
    offsets = torch.tensor([0] + [len(w) for w in words[:-1]]).cumsum(0)
    with torch.no_grad():
        return table(torch.tensor([i for w in words for i in w]), offsets).numpy()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--workdir', default='import-example')
    p.add_argument('--samples', type=int, default=256)
    args = p.parse_args(argv)
    root = Path(args.workdir).resolve()
    train_csv = make_split(root / 'data', 'train', args.samples, seed=0)
    data = pd.read_csv(train_csv, sep='\t')

    features = root / 'features'
    features.mkdir(parents=True, exist_ok=True)
    np.savez(features / 'train.npz',  # shard 'train': the CSV file's name without its extension
             keys=np.array(data['filepath'], dtype=str),  # a CSV's keys: its image paths, row by row
             image_features=image_features(data['filepath'].tolist()),
             text_features=text_features(data['title'].tolist()))

    store = root / 'ref'
    features_command(['import', features, '--train-data', train_csv, '--output', store, '--normalize',
                      '--model', 'timm resnet18 + hashed bag of words (random weights)', '--overwrite'])
    if features_command(['verify', store, '--train-data', train_csv]):
        return 1
    print(f"\ntrain with it: python -m open_clip_train.main --loss drrho --ref-features {store} "
          f"--train-data {train_csv} --dataset-type csv --csv-separator $'\\t' --csv-img-key filepath "
          f"--csv-caption-key title ...")
    return 0


if __name__ == '__main__':
    sys.exit(main())
