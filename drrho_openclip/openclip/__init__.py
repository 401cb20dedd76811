"""drrho-openclip's one boundary to OpenCLIP's training code (open_clip_train 3.3.0), and its plugin entry point
(`open_clip_train.plugins: drrho = drrho_openclip.openclip`).

`patches/open_clip-3.3.0-plugin-api.patch`, applied in memory by the import hook (`import_hook.py`), makes
open_clip_train load the plugins of that entry-point group and call the hooks below where a plugin has them. This
module declares every hook once, with its contract; the work is done in

    flags.py        the plugin's flags, their checks, --help
    run.py          the run the hooks share (stores opened once, the loss), started by check_args
    model.py        the loss: built, attached to the model and moved to its device; the model's logit_scale
    loaders.py      the training loaders' per-sample extras (sample index, reference features)
    checkpoints.py  per-sample state in checkpoints (shard sets next to the checkpoint files)
    reference.py    reference models: the loader precompute also uses, and the online reference
    evaluation.py   models scored outside training (the demo's and the benchmarks' zero-shot), tokenizers

Nothing here imports torch or OpenCLIP at import time: the interpreter start-up hook imports this package.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Tuple, TypedDict

from .import_hook import PluginActivationError, install_import_hook, openclip_main

if TYPE_CHECKING:
    from torch import Tensor


class BatchExtras(TypedDict, total=False):
    """The per-sample tensors a training batch carries besides images and texts, passed to the loss as keywords.
    The loaders attach `index` per sample and the reference features per batch; the loop moves them to the device."""
    index: Tensor               # [b] int64: each sample's dense index, the row of its per-sample state
    ref_image_features: Tensor  # [b, d_ref] float32, L2-normalised reference-model image features
    ref_text_features: Tensor   # [b, d_ref] float32, L2-normalised reference-model text features


class TrainingLoss(Protocol):
    """What the patched training loop asks of a loss that `create_loss` returns. The loop calls `set_epoch`,
    `prepare_batch` and `metrics`, and the plugin `set_total_steps`, only where the loss has them; a loss with
    `prepare_batch` (every loss of this plugin) is a plugin's, given `accum_step` even when its batches carry no
    extras."""

    # set by the plugin for --ref-model: (images, texts) -> reference features, which prepare_batch adds
    reference_encoder: Optional[Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]]

    def __call__(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor, *, output_dict: bool,
                 index: Tensor = ..., ref_image_features: Tensor = ..., ref_text_features: Tensor = ...,
                 accum_step: Optional[int] = None, **model_outputs: Tensor) -> Dict[str, Tensor]:
        """The loss terms. With --accum-freq > 1 the loop calls it accum_freq times on the same window of batches
        (with gradients through another chunk each time), `accum_step` = 0, 1, ...: per-sample state and other
        once-per-step updates happen at step 0 only. Without accumulation `accum_step` is None."""

    def set_total_steps(self, total_steps: int) -> Optional[float]:
        """Once, before training: the run's number of optimiser steps (an 'auto' learning rate of a learned τ).
        Returns the learning rate it set from them, or None."""

    def set_epoch(self, epoch: int) -> None:
        """Before each epoch's first batch (schedules such as the inner learning rate γ)."""

    def prepare_batch(self, images: Tensor, texts: Tensor, extras: BatchExtras) -> BatchExtras:
        """Per batch, before the forward pass, on the device: the extras the loss is called with."""

    def metrics(self) -> Dict[str, float]:
        """At each log step: diagnostics that are not loss terms (logged as train/<name>)."""


# ---- the hooks, in the order of a run -------------------------------------------------------------------------


def add_args(parser) -> None:
    """params.parse_args, before parsing: add the plugin's flags (their own argument group) to OpenCLIP's parser."""
    from .flags import add_args
    add_args(parser)


def check_args(args, parser) -> None:
    """params.parse_args, after parsing, on every rank: check the plugin's flags against the chosen loss
    (parser.error says what to change), open the feature stores, and start the run the other hooks share."""
    from . import run
    from .flags import check_args
    run.start(check_args(args, parser))


def configure_model(model, args) -> None:
    """main, after the model is created on its device, before the optimizer, DDP and resume see it: build the loss
    on the model's device and attach its learnable modules to the model."""
    from . import run
    from .model import configure_model
    configure_model(run.active(), model, args)


def create_loss(args) -> Optional[TrainingLoss]:
    """open_clip_train.main, before OpenCLIP's own create_loss: the loss configure_model built, or None for plain
    `--loss clip` (OpenCLIP then builds its own loss exactly as without the plugin)."""
    from . import run
    from .model import create_loss
    return create_loss(run.active(), args)


def wds_sample_extras(args) -> Optional[Tuple[Callable[[dict], BatchExtras], Callable[[list], tuple]]]:
    """open_clip_train.data.get_wds_dataset, training pipeline: None (OpenCLIP's own batches), or a function of a
    sample (a dict with its `__url__` and `__key__`) giving its extras, and the collation of (image, text, extras)
    samples into a batch."""
    from . import run
    from .loaders import wds_sample_extras
    return wds_sample_extras(run.active(), args)


def wrap_data(data: dict, args) -> dict:
    """open_clip_train.data.get_data, after the datasets are built: the training loader of map-style data (CSV,
    synthetic) with the per-sample extras (WebDataset's come from wds_sample_extras); and the loss's
    `set_total_steps`, where it has one, with the run's optimiser steps as OpenCLIP's scheduler counts them."""
    from . import run
    from .loaders import wrap_data
    return wrap_data(run.active(), data, args)


def resolve_loss_state(loss: TrainingLoss, loss_state: dict, args) -> dict:
    """main, on resume, on every rank, before `loss.load_state_dict`: the checkpoint's loss state with the parts
    kept in files next to the checkpoint read in."""
    from . import run
    from .checkpoints import resolve_loss_state
    return resolve_loss_state(run.active(), loss, loss_state, args)


def checkpoint_loss_state(loss: TrainingLoss, loss_state: dict, completed_epoch: int, checkpoint_files: List[str],
                          args) -> dict:
    """main, after each epoch, on every rank, before rank 0 writes `checkpoint_files` (none: no checkpoint this
    epoch): what goes into checkpoint['loss_state']; sharded per-sample state is written to per-rank files here."""
    from . import run
    from .checkpoints import checkpoint_loss_state
    return checkpoint_loss_state(run.active(), loss, loss_state, completed_epoch, checkpoint_files, args)


def checkpoints_saved(completed_epoch: int, checkpoint_files: List[str], args) -> None:
    """main, after every rank passed the barrier behind the epoch's save: remove the files no checkpoint refers
    to any more."""
    from . import run
    from .checkpoints import checkpoints_saved
    checkpoints_saved(run.active(), completed_epoch, checkpoint_files, args)


__all__ = ['BatchExtras', 'PluginActivationError', 'TrainingLoss', 'install_import_hook', 'openclip_main', 'add_args',
           'check_args', 'configure_model', 'create_loss', 'wds_sample_extras', 'wrap_data', 'resolve_loss_state',
           'checkpoint_loss_state', 'checkpoints_saved']
