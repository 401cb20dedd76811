"""Contrastive losses for OpenCLIP, all composed from one DRO core (`core.py`) where the method is a DRO over
negatives, and small modules of their own otherwise (`balanced.py`, `jest.py`).

Each loss follows OpenCLIP's call convention:
`loss(image_features, text_features, logit_scale, ..., output_dict=True)` with the extra keywords `index`,
`ref_image_features`, `ref_text_features` and `accum_step` where the loss needs them.
"""
from .core import DROContrastiveLoss, FixedTemperature, LogitScaleTemperature, MovingAverageState
from .registry import create_loss, get_loss_spec, list_losses, loss_options, register_loss
from .temperatures import PerSampleTemperature, TempNetTemperature, attach_to_model
from . import family  # noqa: F401 - registers the named losses

__all__ = [
    'DROContrastiveLoss', 'FixedTemperature', 'LogitScaleTemperature', 'MovingAverageState',
    'PerSampleTemperature', 'TempNetTemperature', 'attach_to_model',
    'create_loss', 'get_loss_spec', 'list_losses', 'loss_options', 'register_loss',
]
