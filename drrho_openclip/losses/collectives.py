"""Every collective of the losses: all-gather, all-gather with gradient, all-reduce, broadcast of an object; and the
one place that asks the process group which rank this is, for the log lines about the whole run.

Each call names the device its process group communicates on (the features' device), and refuses a tensor that
lives elsewhere: NCCL accepts CUDA tensors only, and a CPU tensor reaching it fails deep inside the backend (a CPU
sample index in an all-gather is how sharded state once crashed on GPUs). The check is a device comparison, no
synchronisation, and runs with one process too, so a single-device run already catches a misplaced tensor.
"""
import logging

import torch
import torch.distributed as dist


def check_device(tensor: torch.Tensor, device: torch.device, what: str = 'a tensor'):
    """Raise unless `tensor` lives on `device` (an index-less device matches any index of its type)."""
    here = tensor.device
    if here.type != device.type or (here.index != device.index and None not in (here.index, device.index)):
        raise RuntimeError(f"{what} is on {here}, but the loss computes and communicates on {device} (the features' "
                           f"device): move the loss with `loss.to({str(device)!r})` and hand it the batch there")


def _all_gather(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient of the global batch and keeps this rank's slice: with
    DDP's averaging, the parameters then get the gradient of the mean loss over all ranks' anchors."""

    @staticmethod
    def forward(ctx, tensor, world_size):
        ctx.rows = tensor.shape[0]
        return _all_gather(tensor, world_size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows], None


def gather_batch(tensor: torch.Tensor, world_size: int, with_grad: bool, device: torch.device) -> torch.Tensor:
    """Concatenate `tensor` from every rank in rank order (the global batch); equal sizes on all ranks."""
    check_device(tensor, device)
    if world_size == 1:
        return tensor
    if with_grad:
        return _GatherWithGrad.apply(tensor, world_size)
    return _all_gather(tensor, world_size)


def all_reduce(tensor: torch.Tensor, world_size: int, device: torch.device) -> torch.Tensor:
    """The sum over ranks of `tensor`, in place."""
    check_device(tensor, device)
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def ranks_where(condition: bool, world_size: int, device: torch.device) -> int:
    """How many ranks have `condition` (every rank calls this, so it is also a barrier): one flag each, summed, so
    that a failure seen by some ranks stops all of them, rather than leaving the others waiting at a collective."""
    flag = torch.tensor([int(condition)], dtype=torch.int64, device=device)
    return int(all_reduce(flag, world_size, device).item())


def broadcast_object(value, world_size: int, device: torch.device):
    """Rank 0's `value` (a picklable object) on every rank. The pickle travels as a tensor on `device`: without one,
    NCCL would take whatever CUDA device is current, which need not be the loss's."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def _first_process(record: logging.LogRecord) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# Lines about the whole run, logged by the first process only: every rank builds the same loss and reads the same flags
# and checkpoint, and 64 ranks would print 64 copies. A line about one rank's own share (its rows of the per-sample
# state, its shards) is logged by that rank with `logging` directly.
run_log = logging.getLogger('drrho_openclip.run')
run_log.addFilter(_first_process)
