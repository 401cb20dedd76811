"""Scoring OpenCLIP models outside training, as the demo and the benchmarks do: a model by name without weights, a
training checkpoint's weights, zero-shot top-1 on labelled images; and a model's tokenizer, as precompute uses it."""
import logging

import open_clip
import torch


def tokenizer_of(name: str):
    """The tokenizer of an OpenCLIP model name (`local-dir:` folders included)."""
    return open_clip.get_tokenizer(name)


def untrained_model(name: str):
    """(model in eval mode, its evaluation transform, its tokenizer) of an OpenCLIP model name, no weights loaded."""
    logging.disable(logging.WARNING)  # open_clip warns that no weights were found: a checkpoint is loaded next
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(name)
    finally:
        logging.disable(logging.NOTSET)
    return model.eval(), preprocess, tokenizer_of(name)


def load_weights(model, checkpoint):
    """The weights of an open_clip_train checkpoint into `model`; strict=False: a loss may add parameters."""
    open_clip.load_checkpoint(model, str(checkpoint), strict=False)
    return model


def zero_shot_accuracy(model, tokenizer, images, labels, classes: dict) -> float:
    """Top-1 accuracy of `images` ([n, 3, h, w], preprocessed) against `labels` ([n]) with the classifier built from
    `classes` = {'classnames': [...], 'templates': ['a photo of a {}.', ...]}."""
    with torch.no_grad():
        classifier = open_clip.build_zero_shot_classifier(model, tokenizer, classes['classnames'],
                                                          classes['templates'], device='cpu', use_tqdm=False)
        logits = torch.cat([model.encode_image(chunk, normalize=True) for chunk in images.split(500)]) @ classifier
    return (logits.argmax(dim=1) == labels).float().mean().item()
