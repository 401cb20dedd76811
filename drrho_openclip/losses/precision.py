"""The dtypes the losses compute in.

Pairwise products (similarities, and in backward the gradient times the features) run in the caller's 16-bit autocast
dtype, or outside autocast in the features' own: bf16/fp16 keep the matrix products on the tensor cores, with float32
accumulation and a float32 result. Everything elementwise over the pairs (ℓ̂/τ, log-sum-exp, exp, the weights) is
float32 or wider, since ℓ̂/τ at τ = 0.01 spans hundreds. float32 and float64 features outside autocast compute
exactly as given.
"""
import contextlib
import functools

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 → float32; float32 and float64 are kept as they are."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def autocast_disabled(device: torch.device):
    """A region where the caller's autocast does not apply: the losses choose their dtypes themselves, in forward
    and in backward (which may run inside the caller's autocast region). Devices without autocast need none."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(backward):
    """Decorator of a hand-written autograd backward: it may run inside the caller's autocast region, and chooses
    its dtypes itself. Some upstream gradients may be None (a function that does not materialise them)."""
    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        given = [g for g in grads if g is not None]
        with autocast_disabled(given[0].device) if given else contextlib.nullcontext():
            return backward(ctx, *grads)
    return wrapped


def elementwise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the elementwise work over products of `dtype` features."""
    return torch.promote_types(dtype, torch.float32)


def pairwise_dtype(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.dtype:
    """The dtype of the loss's pairwise products: the caller's 16-bit autocast dtype, where it is on (called outside
    `autocast_disabled`), as the caller's own products get it: on CUDA, autocast runs F.normalize in float32, so
    OpenCLIP's `--precision amp_bf16` hands the loss float32 features. Else the features' own when both are the same
    16-bit dtype (tensor cores), else float32 or wider. Float64 features stay float64, as autocast leaves them."""
    device = image_features.device.type
    dtype = torch.promote_types(image_features.dtype, text_features.dtype)
    if dtype != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        if torch.get_autocast_dtype(device) in HALF_DTYPES:
            return torch.get_autocast_dtype(device)
    return dtype if dtype in HALF_DTYPES else elementwise_dtype(dtype)


@functools.lru_cache(maxsize=None)
def _has_float32_output_mm(device: torch.device) -> bool:
    # `torch.mm(..., out_dtype=torch.float32)` exists for CUDA tensors only (CPU raises NotImplementedError), and
    # only in recent torch: probe once per device
    try:
        probe = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        return torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, NotImplementedError, RuntimeError):
        return False


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, not differentiable, in float32 or wider: a 16-bit product accumulates in float32 (on the tensor cores);
    where the device has no float32-output product, the 16-bit result is upcast."""
    if a.dtype in HALF_DTYPES and b.dtype == a.dtype:
        if a.device.type == 'cuda' and _has_float32_output_mm(a.device):
            return torch.mm(a, b, out_dtype=torch.float32)
        return (a @ b).float()
    return a @ b


def subtract_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out −= a @ b in place, not differentiable: one accumulating product (no a @ b temporary) when `out` has the
    features' dtype, else `product`'s float32 result subtracted."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return out.addmm_(a, b, alpha=-1)
    return out.sub_(product(a, b))


class _Similarities(torch.autograd.Function):
    """anchors @ candidates.T (see `product`), and backward's two products in the features' dtype too, whatever
    autocast region backward runs in (autograd's own matmul backward would follow the caller's autocast)."""

    @staticmethod
    def forward(ctx, anchors, candidates):
        ctx.save_for_backward(anchors, candidates)
        with autocast_disabled(anchors.device):
            return product(anchors, candidates.T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad):
        anchors, candidates = ctx.saved_tensors
        grad = grad.to(anchors.dtype)
        grad_anchors = product(grad, candidates).to(anchors.dtype) if ctx.needs_input_grad[0] else None
        grad_candidates = product(grad.T, anchors).to(candidates.dtype) if ctx.needs_input_grad[1] else None
        return grad_anchors, grad_candidates


def similarities(anchors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[b, B] = anchors @ candidates.T, differentiable, in float32 or wider (see `product`)."""
    return _Similarities.apply(anchors, candidates)
