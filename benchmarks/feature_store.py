"""Reference-feature storage: bytes per sample on disk per dtype, and what each dtype's rounding does to the loss.

    python benchmarks/feature_store.py      # < 1 min on a 2-core CPU

Writes `benchmarks/results/feature_store.json` and `.md`.

Bytes: one shard of N = 10000 samples (the official fork's shard size), for the reference dimensions 512 (ViT-B-32)
and 768 (ViT-L-14). Ours: every file of the shard in a store written by FeatureStoreWriter (features, int8 scales,
and keys, counted apart). Keys: img2dataset's consecutive 9-digit keys (stored as one run record), and, for float16,
also arbitrary 20-character string keys (stored as UTF-8, one entry per sample). The official layout (DRRho-CLIP's
`--cache_ref_model_features`): `torch.save` of a [N, 2, D] float32 tensor per shard, no keys (it cannot index
arbitrary keys: it relies on img2dataset's key arithmetic).

Loss error: the DRRho loss (`create_loss('drrho')`, its defaults: the first step's τ = 0.07, fresh per-sample state)
of a batch of B = 1024 learner features, with the reference features read back from a store of each dtype, against
the same loss with the exact float32 features: |L_dtype − L_float32| / |L_float32|, and the relative L2 error of the
gradient with respect to the learner's features; the maximum over 4 batches. Features are random unit vectors, the
text ones correlated with the image ones, the learner's a noisy copy of the reference's. Two distributions:
`gaussian` (isotropic), and `outlier dims` (8 of the D coordinates 10× larger, as in real CLIP embeddings: the
worst case of a per-vector int8 scale, set by the largest coordinate).

Read rate: `FeatureStore.batch_features(index)` (what a loader worker calls per batch) on 16 batches of 256 random
indices, samples/s.
"""
import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from drrho_openclip.features import FeatureStore, FeatureStoreWriter  # noqa: E402
from drrho_openclip.losses import create_loss  # noqa: E402

DTYPES = ('float32', 'float16', 'int8')
SHARD = 10000
BATCH, BATCHES = 1024, 4


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def reference_features(n, dim, distribution, rng):
    """[n, 2, dim] unit-norm (image, text) pairs, float32."""
    scale = np.ones(dim)
    if distribution == 'outlier dims':
        scale[rng.choice(dim, 8, replace=False)] = 10
    image = rng.normal(size=(n, dim)) * scale
    text = image + rng.normal(size=(n, dim)) * scale
    return np.stack([unit(image), unit(text)], axis=1).astype(np.float32)


def write_store(root, features, dtype, keys=None):
    keys = keys or [f'{i:09d}' for i in range(len(features))]
    writer = FeatureStoreWriter(root, 'bench', '', dim=features.shape[-1], dtype=dtype)
    writer.add_shard('00000000', keys, features[:, 0], features[:, 1])
    writer.close()
    return FeatureStore.open(root)


def bytes_per_sample(tmp, dim, rng):
    features = reference_features(SHARD, dim, 'gaussian', rng)
    official = tmp / f'official-{dim}.pt'
    torch.save(torch.from_numpy(features), official)
    rows = [dict(dim=dim, dtype='float32', layout='official .pt', features=official.stat().st_size / SHARD, keys=0)]
    string_keys = [f'{k:020x}' for k in rng.integers(0, 2 ** 62, SHARD)]
    for dtype, key_kind in [(dtype, 'img2dataset') for dtype in DTYPES] + [('float16', 'string')]:
        store = write_store(tmp / f'{dtype}-{dim}-{key_kind}', features, dtype,
                            string_keys if key_kind == 'string' else None)
        sizes = {f.name: f.stat().st_size for f in store.root.iterdir() if f.suffix == '.npy'}
        keys = sum(size for name, size in sizes.items() if name.endswith('.keys.npy'))
        batches = torch.from_numpy(np.random.default_rng(0).integers(0, SHARD, (16, 256)))
        start = time.perf_counter()
        for index in batches:
            store.batch_features(index)
        rows.append(dict(dim=dim, dtype=dtype, layout=f'ours .npy, {key_kind} keys',
                         features=(sum(sizes.values()) - keys) / SHARD, keys=keys / SHARD,
                         reads_per_s=batches.numel() / (time.perf_counter() - start)))
    for row in rows:
        row['ratio_to_official'] = (row['features'] + row['keys']) / rows[0]['features']
    return rows


def loss_and_grads(reference, learner):
    loss = create_loss('drrho', num_samples=len(learner))
    loss.set_total_steps(1)  # one call, as a one-step run
    image, text = (torch.from_numpy(learner[:, k]).requires_grad_() for k in (0, 1))
    value = loss(image, text, torch.tensor(100.0), index=torch.arange(len(learner)),
                 ref_image_features=torch.from_numpy(reference[:, 0]),
                 ref_text_features=torch.from_numpy(reference[:, 1]))
    value.backward()
    return value.item(), torch.cat([image.grad.flatten(), text.grad.flatten()])


def loss_errors(tmp, dim, distribution, rng):
    exact = reference_features(BATCH * BATCHES, dim, distribution, rng)
    learner = unit(exact + 0.5 * rng.normal(size=exact.shape) / np.sqrt(dim)).astype(np.float32)
    rows = []
    for dtype in DTYPES:
        stored = write_store(tmp / f'loss-{dtype}-{dim}-{distribution}', exact, dtype).shard_features('00000000')
        loss_error = grad_error = 0.0
        for b in range(BATCHES):
            batch = slice(b * BATCH, (b + 1) * BATCH)
            value, grad = loss_and_grads(stored[batch], learner[batch])
            value_exact, grad_exact = loss_and_grads(exact[batch], learner[batch])
            loss_error = max(loss_error, abs(value - value_exact) / abs(value_exact))
            grad_error = max(grad_error, ((grad - grad_exact).norm() / grad_exact.norm()).item())
        rows.append(dict(dim=dim, distribution=distribution, dtype=dtype,
                         max_abs_feature_error=float(np.abs(stored - exact).max()),
                         loss_rel_error=loss_error, grad_rel_error=grad_error))
    return rows


def markdown(result):
    lines = ['# Reference-feature store: bytes per sample and loss error per dtype', '',
             f"{platform.machine()}, torch {torch.__version__}, {result['seconds']:.0f} s. "
             f"See the docstring of `benchmarks/feature_store.py` for the setup.", '',
             f'## Bytes per sample on disk (shard of {SHARD} samples)', '',
             '| dim | dtype | layout | features B | keys B | total / official float32 | reads/s |',
             '|---:|---|---|---:|---:|---:|---:|']
    for r in result['bytes']:
        reads = f"{r['reads_per_s']:,.0f}" if 'reads_per_s' in r else '–'
        lines.append(f"| {r['dim']} | {r['dtype']} | {r['layout']} | {r['features']:.1f} | {r['keys']:.2f} | "
                     f"{r['ratio_to_official']:.4f} | {reads} |")
    lines += ['', f'## DRRho loss error from the stored reference features (batch {BATCH}, max over {BATCHES} '
                  'batches)', '',
              '| dim | features | dtype | max abs feature error | loss rel. error | gradient rel. error |',
              '|---:|---|---|---:|---:|---:|']
    for r in result['loss']:
        lines.append(f"| {r['dim']} | {r['distribution']} | {r['dtype']} | {r['max_abs_feature_error']:.1e} | "
                     f"{r['loss_rel_error']:.1e} | {r['grad_rel_error']:.1e} |")
    return '\n'.join(lines) + '\n'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--output', default=str(ROOT / 'benchmarks' / 'results'),
                   help='folder of feature_store.{json,md} (default: %(default)s)')
    out = Path(p.parse_args(argv).output)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        result = dict(bytes=[row for dim in (512, 768) for row in bytes_per_sample(tmp, dim, rng)],
                      loss=[row for dist in ('gaussian', 'outlier dims') for row in loss_errors(tmp, 512, dist, rng)])
    result['seconds'] = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / 'feature_store.json').write_text(json.dumps(result, indent=1))
    (out / 'feature_store.md').write_text(markdown(result))
    print(markdown(result))


if __name__ == '__main__':
    main()
