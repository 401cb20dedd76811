"""Reference models: any OpenCLIP model, from a pretrained tag or a local checkpoint file (precompute's features and
training's online reference both load them here)."""
import logging
from pathlib import Path
from typing import Optional

import torch

CHECKPOINT_SUFFIXES = ('.pt', '.pth', '.bin', '.safetensors', '.ckpt')


def pretrained_problem(name: str, pretrained: Optional[str]) -> Optional[str]:
    """Why `pretrained` cannot give the model `name` its weights, or None. OpenCLIP ignores the `pretrained` of a
    `local-dir:` model, and a mistyped checkpoint path would leave the reference with random weights: a path must
    be a file (a pretrained tag is left to OpenCLIP, which refuses unknown ones)."""
    if not pretrained or Path(pretrained).is_file():
        return None
    if name.startswith('local-dir:'):
        return f"'{pretrained}' is not a file, and a local-dir: model loads its weights from a checkpoint file only"
    if '/' in pretrained or Path(pretrained).suffix in CHECKPOINT_SUFFIXES:
        return f"'{pretrained}' is not a file"
    return None


def create_model(name: str, pretrained: str = None, device='cpu'):
    """An OpenCLIP model in eval mode and its evaluation transform, from a pretrained tag or a local checkpoint file
    (OpenCLIP's own factory ignores `pretrained` for `local-dir:` models, so files are loaded here). It says where
    its weights came from: OpenCLIP's own log says "initialized randomly" before a file is loaded."""
    import open_clip
    problem = pretrained_problem(name, pretrained)
    if problem:
        raise ValueError(f"reference model {name}: {problem}")
    is_file = bool(pretrained) and Path(pretrained).is_file()
    model, _, preprocess = open_clip.create_model_and_transforms(
        name, pretrained=None if is_file or not pretrained else pretrained, device=device)
    if is_file:
        open_clip.load_checkpoint(model, pretrained, device=device)
    if pretrained:
        logging.info(f"drrho-openclip: reference model {name}, weights from '{pretrained}'")
    else:
        logging.warning(f"drrho-openclip: reference model {name} has random weights (no pretrained tag or "
                        f"checkpoint file given)")
    return model.eval(), preprocess


class OnlineReference:
    """Reference features computed on the fly from the learner's batch (its augmentation and tokenizer), on the
    learner's device."""

    def __init__(self, learner: str, name: str, pretrained: str, device):
        import open_clip
        learner_config, config = open_clip.get_model_config(learner), open_clip.get_model_config(name)
        if learner_config is not None and config is not None:
            for part, key in (('vision_cfg', 'image_size'), ('text_cfg', 'context_length'), ('text_cfg', 'vocab_size')):
                a, b = learner_config[part].get(key), config[part].get(key)
                if a != b:
                    raise ValueError(f"--ref-model {name} has {key}={b}, the learner {a}: it cannot read the "
                                     f"learner's batches; precompute its features with drrho-openclip-features")
        self.model = create_model(name, pretrained, device)[0].requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images, texts):
        return self.model.encode_image(images, normalize=True), self.model.encode_text(texts, normalize=True)
