"""Contrastive losses for OpenCLIP, all composed from one DRO core (`core.py`) where the method is a DRO over
negatives, and small modules of their own otherwise (`balanced.py`, `jest.py`).

Each loss follows OpenCLIP's call convention:
`loss(image_features, text_features, logit_scale, ..., output_dict=True)` with the extra keywords `index`,
`ref_image_features`, `ref_text_features` and `accum_step` where the loss needs them.
"""
from .core import (STATE_LAYOUTS, DROContrastiveLoss, FixedTemperature, LogitScaleTemperature, MovingAverageState,
                   per_sample_tables)
from .registry import OPTION_HELP, create_loss, get_loss_spec, list_losses, loss_options, option_names, register_loss
from .state_shards import load_state_shards, save_state_shards
from .tiled import DEFAULT_TILE_SIZE
from .temperatures import PerSampleTemperature, TempNetTemperature, attach_to_model
from . import family  # noqa: F401 - registers the named losses

__all__ = [
    'DROContrastiveLoss', 'FixedTemperature', 'LogitScaleTemperature', 'MovingAverageState',
    'PerSampleTemperature', 'TempNetTemperature', 'attach_to_model', 'per_sample_tables',
    'STATE_LAYOUTS', 'DEFAULT_TILE_SIZE', 'load_state_shards', 'save_state_shards',
    'OPTION_HELP', 'create_loss', 'get_loss_spec', 'list_losses', 'loss_options', 'option_names', 'register_loss',
]
