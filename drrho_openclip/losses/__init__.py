"""Contrastive losses for OpenCLIP, all composed from one DRO core (`core.py`).

Each loss follows OpenCLIP's call convention:
`loss(image_features, text_features, logit_scale, ..., output_dict=True)` with the extra keywords `index`,
`ref_image_features` and `ref_text_features` where the loss needs them.
"""
from .core import DROContrastiveLoss, FixedTemperature, LogitScaleTemperature, MovingAverageState
from .registry import create_loss, get_loss_spec, list_losses, loss_options, register_loss
from . import family  # registers the named losses

__all__ = [
    'DROContrastiveLoss', 'FixedTemperature', 'LogitScaleTemperature', 'MovingAverageState',
    'create_loss', 'get_loss_spec', 'list_losses', 'loss_options', 'register_loss',
]
