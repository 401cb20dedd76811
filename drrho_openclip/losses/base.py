"""What the losses share beyond their arithmetic: where reference features come from, how the last call's
diagnostics reach the training loop's logger, how a later call of an accumulation window leaves τ alone, draws
that resume exactly, and learned state that a dtype cast leaves at its precision."""
import torch


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of int64 keys (xorshift-multiply mixing, wrapping in int64): distinct keys, unrelated values."""
    for multiplier in (0x5851F42D4C957F2D, 0x14057B7EF767814F):
        keys = (keys ^ (keys >> 29)) * multiplier
    return keys


def keyed_uniform(keys: torch.Tensor) -> torch.Tensor:
    """One float64 draw in [0, 1) per int64 key, a function of the key alone: the same whichever rank, step or
    restart makes it, so a run resumes exactly without a generator state to checkpoint (and without touching the
    global RNG that OpenCLIP reseeds at every start)."""
    return ((mix64(keys) >> 11) & ((1 << 52) - 1)).to(torch.float64) / float(1 << 52)


class KeepsStatePrecision:
    """Mixin of the modules whose buffers are a loss's learned state (u, τ and its Adam moments, the teacher's
    chosen scale): `loss.to(dtype)`, `.half()` or `.bfloat16()` may raise their precision but never lower it, as a
    model cast to 16 bits would otherwise take its loss's state along. In bfloat16 a step of log τ (about lr_tau,
    10⁻³–10⁻⁵) is far below the spacing near log 0.07 (0.016): τ froze, silently."""

    def _apply(self, fn, *args, **kwargs):
        before = {name: b for name, b in self._buffers.items() if b is not None and b.is_floating_point()}
        super()._apply(fn, *args, **kwargs)
        for name, original in before.items():
            buffer = self._buffers[name]
            if buffer.is_floating_point() and torch.finfo(buffer.dtype).eps > torch.finfo(original.dtype).eps:
                self._buffers[name] = original.to(buffer.device)  # the values as they were, not rounded and back
        return self


def check_eval_call(loss, accum_step):
    """An accumulation window is a training step's: a loss in eval mode scores one whole batch per call."""
    if not loss.training and accum_step is not None:
        raise ValueError("accum_step is for training: in eval mode a call scores one whole batch")


def keep_in_graph(value: torch.Tensor, *tensors) -> torch.Tensor:
    """`value` plus zero times each of `tensors` that requires grad: they get a zero gradient. A later call of an
    accumulation window uses the first call's τ as a constant (τ's gradient came whole with that call), yet DDP
    requires every parameter that the window's first backward reached (the model's logit_scale, TempNet's weights)
    to take part in each later backward too, or it stops at the next step."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            value = value + 0 * tensor.sum().to(value.dtype)
    return value


def fixed_within_window(tensor: torch.Tensor, accum_step) -> torch.Tensor:
    """`tensor` (τ or a logit scale) as a constant on a later call of an accumulation window (accum_step > 0): its
    gradient depends only on the window's feature values, so it came whole with the window's first call."""
    return keep_in_graph(tensor.detach(), tensor) if accum_step else tensor


# accum_step k > 0 replays the window whose first call (accum_step=0) chose what the window keeps (state, τ, draws)
WINDOW_NOT_OPENED = ("accum_step > 0 continues an accumulation window: call the loss on the window's first chunk "
                     "with accum_step=0 first")


class ReferenceFeatures:
    """Mixin of every loss that reads reference features: checks that the batch carries them, and fills them from
    an online reference model when one is set."""

    # callable (images, texts) -> (ref_image_features, ref_text_features), set for an online reference model;
    # a plain attribute, not a submodule, so the reference weights never enter the loss's state_dict
    reference_encoder = None

    def prepare_batch(self, images, texts, extras: dict) -> dict:
        if self.reference_encoder is None:
            return extras
        ref_image, ref_text = self.reference_encoder(images, texts)
        return {**extras, 'ref_image_features': ref_image, 'ref_text_features': ref_text}

    @staticmethod
    def require_reference(ref_image_features, ref_text_features, purpose: str):
        """Raise unless the batch carries both reference feature sets; `purpose` says what this loss needs them
        for (e.g. "shifts by the reference model")."""
        if ref_image_features is None or ref_text_features is None:
            raise ValueError(f"this loss {purpose}: the batch carries no reference features (in OpenCLIP, pass "
                             f"--ref-features DIR or --ref-model; called directly, ref_image_features= and "
                             f"ref_text_features=)")


class LastCallMetrics:
    """Mixin: `metrics()` reports the 0-dim tensors the last training call kept in `self._last` as Python floats (one
    host synchronisation, when the training loop logs, not at every call). A call in eval mode keeps nothing there:
    held-out batches scored between a step and its logging do not stand in for that step's diagnostics."""

    def metrics(self) -> dict:
        return {key: value.item() if isinstance(value, torch.Tensor) else float(value)
                for key, value in self._last.items()}
