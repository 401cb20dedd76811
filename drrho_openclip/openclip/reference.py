"""Reference models: any OpenCLIP model, from a pretrained tag or a local checkpoint file (precompute's features and
training's online reference both load them here)."""
from pathlib import Path

import torch


def create_model(name: str, pretrained: str = None, device='cpu'):
    """An OpenCLIP model in eval mode and its evaluation transform, from a pretrained tag or a local checkpoint file
    (OpenCLIP's own factory ignores `pretrained` for `local-dir:` models, so files are loaded here)."""
    import open_clip
    is_file = pretrained is not None and Path(pretrained).is_file()
    model, _, preprocess = open_clip.create_model_and_transforms(
        name, pretrained=None if is_file else pretrained, device=device)
    if is_file:
        open_clip.load_checkpoint(model, pretrained, device=device)
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
