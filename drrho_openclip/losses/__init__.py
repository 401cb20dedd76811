"""Contrastive losses for OpenCLIP, on torch alone: the DRO family composed from one core (`core.py`), and small
modules of their own where the method is not a DRO over negatives (`clip.py`, `mobileclip.py`, `balanced.py`,
`jest.py`).

The core's parts, one concern per module: `dense.py` and `tiled.py` (the two aggregations, one contract, over the
passes of `passes.py`, compiled on CUDA GPUs that support it: `compiles_for`; `balanced.py` compiles its own passes
the same way),
`temperatures.py` (every temperature source), `state.py` (per-sample tables, their layouts across ranks and their
checkpoint files), `collectives.py` (every collective, device-checked), `precision.py` (the dtypes the losses
compute in). `registry.py` names the losses and their options; `family.py` registers them.

Each loss follows OpenCLIP's call convention:
`loss(image_features, text_features, logit_scale, ..., output_dict=True)` with the extra keywords `index`,
`ref_image_features`, `ref_text_features` and `accum_step` where the loss needs them. A loss's per-sample tables
and constants are registered buffers: `loss.to(device)` puts all of it on the features' device, where every call
computes and communicates.
"""
from .balanced import BalancedClipLoss
from .core import DROContrastiveLoss
from .distill import REFERENCE_SCALE_STATE_KEYS
from .passes import compiles_for
from .registry import (AUTO, OPTION_HELP, OPTION_TYPES, TAU_OBJECTIVES, TEMPERATURE_OPTIMIZERS, create_loss,
                       float_or_auto, get_loss_spec, inactive_options, list_losses, loss_options, option_names,
                       reads_reference_features, register_loss)
from .state import (STATE_LAYOUTS, MovingAverageState, gamma_at_epoch, load_state_shards, per_sample_tables,
                    save_state_shards)
from .temperatures import (ATTACHED_PREFIX, FixedTemperature, LearnedTemperature, LogitScaleTemperature,
                           PerSampleTemperature, TempNetTemperature, attach_to_model, attached_names,
                           effective_negatives, reference_margins, rho_for_batch, temperature_for_effective_negatives)
from .tiled import DEFAULT_TILE_SIZE
from . import family  # noqa: F401 - registers the named losses

__all__ = [
    'BalancedClipLoss', 'DROContrastiveLoss', 'compiles_for', 'FixedTemperature', 'LearnedTemperature',
    'LogitScaleTemperature', 'MovingAverageState', 'PerSampleTemperature', 'TempNetTemperature', 'ATTACHED_PREFIX',
    'attach_to_model', 'attached_names',
    'gamma_at_epoch', 'per_sample_tables',
    'effective_negatives', 'reference_margins', 'rho_for_batch', 'temperature_for_effective_negatives',
    'STATE_LAYOUTS', 'DEFAULT_TILE_SIZE', 'REFERENCE_SCALE_STATE_KEYS', 'load_state_shards', 'save_state_shards',
    'AUTO', 'OPTION_HELP', 'OPTION_TYPES', 'TAU_OBJECTIVES', 'TEMPERATURE_OPTIMIZERS', 'create_loss', 'float_or_auto',
    'get_loss_spec', 'inactive_options', 'list_losses', 'loss_options', 'option_names',
    'reads_reference_features', 'register_loss',
]
