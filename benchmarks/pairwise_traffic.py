"""Pairwise-matrix traffic of each loss: how many b×B matrices one forward + backward reads and writes.

    python benchmarks/pairwise_traffic.py              # global batch 2048 (under a minute, any machine)

Writes `benchmarks/results/pairwise_traffic.{md,json}`.

Why: on a GPU with bf16 features the pairwise products run on the tensor cores in a few percent of the loss's time;
what is left is elementwise passes over B×B matrices, bound by memory bandwidth. Their count therefore predicts a
loss's time relative to `ClipLoss` there (not on a CPU, where other costs dominate), and it can be measured exactly
on any machine: every aten operation a forward + backward dispatches is recorded (a `TorchDispatchMode`), and the
bytes of its inputs and outputs that hold at least B²/16 elements are added up, in units of one B×B float32 matrix
(a per-sample tensor of B × w elements passes that threshold when w ≥ B/16, e.g. TempNet's hidden layer: at the
default batch it adds w/B of a unit per pass, small beside the pairwise passes).
Views (transposes, diagonals, slices) move nothing and are not counted; an operation counts each input and output
once, however many times its kernel reads them; a loss whose matrices are smaller than B²/16 (JEST's chunks and
sub-batch) moves more than it shows. The losses run as in `overheads.py` (float32 features of dimension d, world
size 1; the sample index and reference features that training hands them). Measured on the GPU, compare with
`overheads.py --device cuda`: the count is a prediction there, not a substitute.
"""
import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overheads import BASELINE, LossCase  # noqa: E402

VIEWS = {'alias', 'as_strided', 'detach', 'diagonal', 'expand', 'permute', 'select', 'slice', 'split', 'squeeze', 't',
         'transpose', 'unbind', 'unsqueeze', 'view', '_unsafe_view', '_reshape_alias'}


class PairwiseTraffic(TorchDispatchMode):
    """Bytes read and written by the operations that touch pairwise-sized tensors, per operation name."""

    def __init__(self, batch: int):
        super().__init__()
        self.matrix_bytes = batch * batch * 4
        self.threshold = batch * batch // 16
        self.read = self.written = 0.0
        self.by_op = {}

    def _units(self, tensors):
        return sum(t.numel() * t.element_size() for t in tensors
                   if isinstance(t, torch.Tensor) and t.numel() >= self.threshold) / self.matrix_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            inputs = [*args, *(kwargs or {}).values()]
            read, written = self._units(inputs), self._units(out if isinstance(out, (tuple, list)) else (out,))
            if read or written:
                self.read += read
                self.written += written
                self.by_op[name] = self.by_op.get(name, 0.0) + read + written
        return out


def measure(name, batch, dim):
    case = LossCase(name, batch, dim, 'cpu', 'fp32')
    case.run()  # lazy state (per-sample tables, a learned τ's first step) out of the counted call
    with PairwiseTraffic(batch) as traffic:
        case.run()
    return dict(read=traffic.read, written=traffic.written, total=traffic.read + traffic.written,
                by_op=dict(sorted(traffic.by_op.items(), key=lambda kv: -kv[1])))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--batch', type=int, default=2048)
    p.add_argument('--dim', type=int, default=64)
    p.add_argument('--output', default=str(HERE / 'results' / 'pairwise_traffic'), help='path without suffix')
    args = p.parse_args(argv)
    from drrho_openclip.losses import list_losses
    results = {name: measure(name, args.batch, args.dim) for name in [BASELINE, *list_losses()]}
    base = results[BASELINE]['total']
    for r in results.values():
        r['ratio'] = r['total'] / base
    report = dict(batch=args.batch, dim=args.dim, torch=torch.__version__, machine=platform.machine(),
                  results=results)
    lines = [f"# Pairwise-matrix traffic of one forward + backward (global batch {args.batch}, d = {args.dim})", '',
             "B×B float32 matrices read + written by the operations that touch pairwise-sized tensors "
             "(`python benchmarks/pairwise_traffic.py`; what bounds a loss's time on a GPU once its products run "
             f"on the tensor cores). torch {torch.__version__}.", '',
             '| loss | read | written | total | × ClipLoss | largest items |', '|---|---:|---:|---:|---:|---|']
    for name, r in results.items():
        top = ', '.join(f"{op} {units:.0f}" for op, units in list(r['by_op'].items())[:4])
        lines.append(f"| {name} | {r['read']:.1f} | {r['written']:.1f} | {r['total']:.1f} | {r['ratio']:.2f} | "
                     f"{top} |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix('.json').write_text(json.dumps(report, indent=1))
    out.with_suffix('.md').write_text('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
