"""Reference features looked up once per batch: `FeatureStore.batch_features` and the collate function that calls it."""
import numpy as np
import pytest
import torch

from drrho_openclip.openclip.loaders import CollateWithReferenceFeatures
from drrho_openclip.features import FeatureStore, FeatureStoreError, FeatureStoreWriter

SIZES = {'a': 5, 'b': 9, 'c': 4}


def write_store(root, dtype, dim=12, seed=0):
    rng = np.random.default_rng(seed)
    writer = FeatureStoreWriter(root, 'm', '', dim=dim, dtype=dtype)
    for name, count in SIZES.items():
        features = rng.normal(size=(2, count, dim))
        features /= np.linalg.norm(features, axis=-1, keepdims=True)
        if name == 'b':
            features[:, 1] = 0  # a zero vector: int8's scale must not divide by it
        writer.add_shard(name, [f'{name}{i}' for i in range(count)], features[0], features[1])
    assert writer.close()
    return FeatureStore.open(root)


@pytest.mark.parametrize('dtype', ['float16', 'float32', 'int8'])
def test_batch_lookup_equals_the_decoded_rows_of_each_shard(tmp_path, dtype):
    store = write_store(tmp_path / 'ref', dtype)
    decoded = np.concatenate([store.shard_features(name) for name in SIZES])  # [18, 2, dim], shard by shard
    index = torch.tensor([17, 0, 6, 6, 13, 4, 5, 14, 9])  # every shard, out of order, a repeat, shard boundaries
    image, text = store.batch_features(index)
    assert image.dtype == text.dtype == torch.float32 and image.shape == text.shape == (9, 12)
    assert image.is_contiguous() and text.is_contiguous()
    assert torch.equal(image, torch.from_numpy(decoded[index.numpy(), 0]))
    assert torch.equal(text, torch.from_numpy(decoded[index.numpy(), 1]))
    one_image, one_text = store.batch_features(torch.tensor([13]))
    assert torch.equal(one_image[0], image[4]) and torch.equal(one_text[0], text[4])


def test_a_non_finite_value_names_its_shard_and_row(tmp_path):
    store = write_store(tmp_path / 'ref', 'float16')
    path = tmp_path / 'ref' / 'b.features.npy'
    stored = np.load(path)
    stored[3, 1, 7] = np.inf
    np.save(path, stored)
    store = FeatureStore.open(tmp_path / 'ref')
    image, text = store.batch_features(torch.tensor([0, 7, 9]))  # the rows of b before and after
    assert torch.isfinite(image).all() and torch.isfinite(text).all()
    with pytest.raises(FeatureStoreError, match=r"shard 'b', row 3: non-finite features"):
        store.batch_features(torch.tensor([0, 17, 8]))  # b starts at 5
    with pytest.raises(FeatureStoreError, match=r"index 18 is outside .* \(18 samples\)"):
        store.batch_features(torch.tensor([2, 18]))


def test_collate_adds_the_features_of_the_batch_index(tmp_path):
    store = write_store(tmp_path / 'ref', 'int8')
    samples = [(torch.full((3, 2, 2), float(i)), torch.arange(4) + i, {'index': i}) for i in (16, 2, 9)]
    images, texts, extras = CollateWithReferenceFeatures(store)(samples)
    assert images.shape == (3, 3, 2, 2) and torch.equal(images[:, 0, 0, 0], torch.tensor([16., 2., 9.]))
    assert torch.equal(texts[:, 0], torch.tensor([16, 2, 9]))
    assert extras['index'].dtype == torch.int64 and extras['index'].tolist() == [16, 2, 9]
    image, text = store.batch_features(torch.tensor([16, 2, 9]))
    assert torch.equal(extras['ref_image_features'], image) and torch.equal(extras['ref_text_features'], text)
