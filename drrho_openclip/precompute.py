"""Precompute reference-model features for a training set (CSV or WebDataset shards).

    drrho-openclip-features --model ViT-B-32 --pretrained openai --train-data 'shards/{00000..00099}.tar' --output ref/
    python -m drrho_openclip.precompute --model local-dir:./ref_model --pretrained ./ref/epoch_5.pt \
        --train-data train.csv --csv-img-key filepath --csv-caption-key title --output ref/

Images go through the reference model's own evaluation transform (no augmentation) and texts through its own
tokenizer, so the features do not depend on the learner's preprocessing.
"""
import argparse
import logging
import sys
from pathlib import Path

import braceexpand
import numpy as np
import pandas as pd
import torch
from PIL import Image
from tqdm import tqdm

from .features import MANIFEST, FeatureStoreWriter, shard_name


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='drrho-openclip-features', description=__doc__.split('\n')[1],
                                allow_abbrev=False)
    p.add_argument('--model', required=True, help='OpenCLIP model name or local-dir:PATH')
    p.add_argument('--pretrained', default=None, help='pretrained tag or local checkpoint file')
    p.add_argument('--train-data', required=True,
                   help="a CSV/TSV file, or WebDataset shards (brace expansion; several sources joined by '::')")
    p.add_argument('--dataset-type', choices=['auto', 'csv', 'webdataset'], default='auto')
    p.add_argument('--csv-separator', default='\t')
    p.add_argument('--csv-img-key', default='filepath')
    p.add_argument('--csv-caption-key', default='title')
    p.add_argument('--output', required=True, help='directory of the feature store to write')
    p.add_argument('--overwrite', action='store_true', help='replace an existing store in --output')
    p.add_argument('--dtype', choices=['float16', 'float32'], default='float16',
                   help='storage dtype (default: %(default)s, half the bytes of float32)')
    p.add_argument('--batch-size', type=int, default=256)
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = p.parse_args(argv)
    if args.dataset_type == 'auto':
        ext = args.train_data.split('::')[0].split('.')[-1].lower()
        args.dataset_type = 'csv' if ext in ('csv', 'tsv') else 'webdataset'
    return args


class _CsvImages(torch.utils.data.Dataset):
    def __init__(self, paths, captions, transform, tokenizer):
        self.paths, self.captions, self.transform, self.tokenizer = paths, captions, transform, tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        image = self.transform(Image.open(str(self.paths[i])))
        return image, self.tokenizer([str(self.captions[i])])[0]


def _shard_samples(url):
    """(key, PIL image, caption) of every image-text sample of one tar shard, in file order."""
    import webdataset as wds
    dataset = wds.WebDataset(url, shardshuffle=False).decode('pilrgb').rename(
        image='jpg;png;jpeg;webp', text='txt')
    for sample in dataset:
        if 'image' in sample and 'text' in sample:
            yield sample['__key__'], sample['image'], sample['text']


def create_model(name: str, pretrained: str = None, device='cpu'):
    """An OpenCLIP model and its evaluation transform, from a pretrained tag or a local checkpoint file (OpenCLIP's
    own factory ignores `pretrained` for `local-dir:` models, so files are loaded here)."""
    import open_clip
    is_file = pretrained is not None and Path(pretrained).is_file()
    model, _, preprocess = open_clip.create_model_and_transforms(
        name, pretrained=None if is_file else pretrained, device=device)
    if is_file:
        open_clip.load_checkpoint(model, pretrained, device=device)
    return model.eval(), preprocess


@torch.no_grad()
def _encode(model, images, texts, device):
    image_features = model.encode_image(images.to(device), normalize=True)
    text_features = model.encode_text(texts.to(device), normalize=True)
    return image_features.float().cpu().numpy(), text_features.float().cpu().numpy()


def main(argv=None):
    import open_clip
    args = parse_args(argv)
    if (Path(args.output) / MANIFEST).exists() and not args.overwrite:
        raise SystemExit(f"{args.output} already holds a reference-feature store; pass --overwrite to replace it")
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    model, preprocess = create_model(args.model, args.pretrained, args.device)
    tokenizer = open_clip.get_tokenizer(args.model)
    writer = None
    progress = tqdm(unit='sample', desc='reference features', dynamic_ncols=True)

    def write(name, keys, image_features, text_features):
        nonlocal writer
        if writer is None:
            writer = FeatureStoreWriter(args.output, args.model, args.pretrained or '', image_features.shape[1],
                                        args.dtype)
        writer.add_shard(name, keys, image_features, text_features)

    if args.dataset_type == 'csv':
        df = pd.read_csv(args.train_data, sep=args.csv_separator)
        for key in (args.csv_img_key, args.csv_caption_key):
            if key not in df.columns:
                raise SystemExit(f"{args.train_data}: no column '{key}' (columns: {', '.join(df.columns)})")
        dataset = _CsvImages(df[args.csv_img_key].tolist(), df[args.csv_caption_key].tolist(), preprocess, tokenizer)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers)
        parts = []
        for images, texts in loader:
            parts.append(_encode(model, images, texts, args.device))
            progress.update(len(images))
        write(shard_name(args.train_data), dataset.paths,
              np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    else:
        urls = [u for source in args.train_data.split('::') for u in braceexpand.braceexpand(source)]
        names = [shard_name(u) for u in urls]
        if len(set(names)) != len(names):
            raise SystemExit('shard file names must be unique: the store keys shards by file name')
        for url, name in zip(urls, names):
            keys, image_parts, text_parts, batch = [], [], [], []

            def flush():
                images = torch.stack([preprocess(img) for _, img, _ in batch])
                texts = tokenizer([str(t) for _, _, t in batch])
                image_features, text_features = _encode(model, images, texts, args.device)
                image_parts.append(image_features)
                text_parts.append(text_features)
                keys.extend(k for k, _, _ in batch)
                progress.update(len(batch))
                batch.clear()

            for sample in _shard_samples(url):
                batch.append(sample)
                if len(batch) == args.batch_size:
                    flush()
            if batch:
                flush()
            if not keys:
                raise SystemExit(f"shard '{url}' holds no image-text samples")
            write(name, keys, np.concatenate(image_parts), np.concatenate(text_parts))
    progress.close()
    writer.close()
    logging.info(f"wrote reference features of {progress.n} samples ({len(writer.shards)} shards) to {args.output}")


if __name__ == '__main__':
    sys.exit(main())
