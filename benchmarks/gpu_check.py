"""GPU check: every registered loss trained for a few steps through OpenCLIP's own `open_clip_train.main` on one
GPU, precompute with a ViT-B-32-sized model, and the collectives' device discipline with two ranks on one GPU.

    python benchmarks/gpu_check.py                          # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --device cpu --quick     # the same checks on the CPU (fp32, gloo): tries the script
    python benchmarks/gpu_check.py --only train/adnce aggregation/adnce two-ranks/adnce   # the cases of one loss
    python benchmarks/gpu_check.py --only train/balanced aggregation/balanced two-ranks/balanced

Cases (each passes or fails on its own; the exit status is 0 only if every case passed):
- train/LOSS/PRECISION: every registered loss, `--precision amp_bf16` and `amp` (fp32 on the CPU), 2 epochs of a
  tiny CLIP on drawn shapes, reference features precomputed on the device where the loss reads them;
- train/LOSS/sharded, train/LOSS/tiled: every stateful loss with `--state-layout sharded` (one rank), every tileable
  loss with `--tile-size 16`; train/drrho/online-reference: the reference model run by the plugin (`--ref-model`);
- resume/...: a run continued with `--resume latest` (replicated, sharded and tiled state, per-sample τ, TempNet);
- precompute/ViT-B-32: `drrho-openclip-features` with a randomly initialised ViT-B-32 on the device, then `verify`;
- aggregation/...: the DRO aggregations as the device runs them (their passes compiled by TorchInductor on CUDA)
  against the same aggregation run eagerly in float64 on the CPU from the same (dtype-rounded) features: values, and
  the gradients of the features and of 1/τ (untiled: plain, with the reference shift, per-anchor τ, ADNCE's
  log-weights, a rank's block of a larger batch; tiled in three column tiles: the shift, ADNCE, a rank's block;
  float32 and bf16 features; batch 12 and 2048); the same for the balanced loss's half-steps (aggregation/balanced-…:
  both branches with the reference shift, k = 3, a rank's block of rows) and for `drrho`'s column step
  (aggregation/column…: with the reference shift, over the dense core's matrix, and its own products in row blocks);
- two-ranks/...: two processes on one GPU in a `cuda:gloo` process group, which, like NCCL, rejects a CPU tensor in
  any collective (NCCL itself refuses two ranks on one GPU); each rank holds half of a global batch on the device,
  and the loss value, the features' gradients and the per-sample state must equal one process with the whole batch.

Writes benchmarks/results/gpu_check.md and .json (or --out) with the device's name.
"""
import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / 'results'
TILEABLE = ('drrho', 'sogclr', 'fastclip', 'isogclr', 'tempnet', 'adnce')
TWO_RANK_CASES = {  # name: (loss, options)
    'drrho': ('drrho', dict(gamma=0.5, temperature=0.05)),
    'drrho-sharded': ('drrho', dict(gamma=0.5, temperature=0.05, state_layout='sharded')),
    'drrho-tiled-sharded': ('drrho', dict(gamma=0.5, temperature=0.05, tile_size=5, state_layout='sharded')),
    'drrho-learnable+kd': ('drrho', dict(gamma=0.5, learn_temperature=True, rho=1.0, distill_weight=0.3)),
    'sogclr': ('sogclr', dict(gamma=0.5)),
    'fastclip': ('fastclip', dict(gamma=0.5)),
    'isogclr-sharded': ('isogclr', dict(gamma=0.5, lr_tau=0.01, state_layout='sharded')),
    'tempnet-sharded': ('tempnet', dict(gamma=0.5, embed_dim=8, tempnet_width=8, tempnet_prototypes=4,
                                        state_layout='sharded')),
    'adnce': ('adnce', dict(adnce_sigma=0.3)),
    'balanced': ('balanced', dict(balance_steps=3, reference_shift=True)),
}
WORLD, LOCAL_BATCH, DIM, NUM_SAMPLES = 2, 6, 8, 24


def _run(name, cmd, log: Path, env=None):
    """One case as a subprocess: (name, passed, seconds, the log's tail when it failed)."""
    start = time.perf_counter()
    with open(log, 'w') as f:
        code = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    tail = '' if code == 0 else '\n'.join(log.read_text(errors='replace').splitlines()[-15:])
    return name, code == 0, time.perf_counter() - start, tail


def _train(model, csv, logs, name, device, precision, epochs, extra=()):
    return [sys.executable, '-m', 'open_clip_train.main', '--train-data', csv, '--dataset-type', 'csv',
            '--csv-separator', '\t', '--csv-img-key', 'filepath', '--csv-caption-key', 'title', '--model', model,
            '--batch-size', 32, '--epochs', epochs, '--lr', 1e-3, '--warmup', 2, '--workers', 1, '--seed', 0,
            '--precision', precision, '--device', device, '--logs', logs, '--name', name, '--save-frequency', 1,
            '--log-every-n-steps', 4, *extra]


def _keeping_u(loss: str) -> list:
    """Flags that make `loss` keep per-sample u: a loss whose default γ = 1 keeps none (drrho, adnce) is given the
    SogCLR estimator's γ; the others keep theirs."""
    from drrho_openclip.losses import get_loss_spec
    return ['--gamma', 0.5] if get_loss_spec(loss).defaults.get('gamma') == 1.0 else []


def training_cases(work: Path, device: str, quick: bool):
    """[(name, command)] of the training and resume runs, and the set-up they need (data, reference, features)."""
    from drrho_openclip.demo import make_split, write_tiny_model
    from drrho_openclip.losses import get_loss_spec, list_losses
    data = work / 'data'
    csv, ref_csv = make_split(data, 'train', 256, seed=2), make_split(data, 'reference', 256, seed=1)
    model = write_tiny_model(work / 'tiny_model')
    logs = work / 'logs'
    precisions = ('fp32',) if device == 'cpu' else ('amp_bf16', 'amp')
    setup = [_train(model, ref_csv, logs, 'reference', device, precisions[0], 1)]
    reference = logs / 'reference' / 'checkpoints' / 'epoch_1.pt'
    features = work / 'ref_features'
    setup.append([sys.executable, '-m', 'drrho_openclip.precompute', '--model', model, '--pretrained', reference,
                  '--train-data', csv, '--output', features, '--workers', 1, '--device', device])
    losses = ('drrho', 'isogclr', 'tempnet', 'clip') if quick else list_losses()
    cases = []
    for loss in losses:
        spec = get_loss_spec(loss)
        flags = ['--loss', loss] + (['--ref-features', features] if spec.reference == 'required' else [])
        for precision in precisions:
            cases.append((f'train/{loss}/{precision}', _train(model, csv, logs, f'{loss}-{precision}', device,
                                                              precision, 2, flags)))
        if spec.stateful:
            cases.append((f'train/{loss}/sharded', _train(model, csv, logs, f'{loss}-sharded', device, precisions[0],
                                                          2, flags + _keeping_u(loss) + ['--state-layout', 'sharded'])))
        if loss in TILEABLE:
            cases.append((f'train/{loss}/tiled', _train(model, csv, logs, f'{loss}-tiled', device, precisions[0], 2,
                                                        flags + ['--tile-size', 16])))
    cases.append(('train/drrho/online-reference',
                  _train(model, csv, logs, 'drrho-online', device, precisions[0], 2,
                         ['--loss', 'drrho', '--ref-model', model, '--ref-pretrained', reference])))
    resumes = {'drrho': [], 'drrho-sharded': ['--state-layout', 'sharded'], 'drrho-tiled': ['--tile-size', 16],
               'isogclr': [], 'tempnet': []}
    resume_runs = []
    for name, extra in resumes.items():
        loss = name.split('-')[0]  # with per-sample state, so that a resume carries it
        flags = ['--loss', loss, *_keeping_u(loss), *extra] + (['--ref-features', features] if loss == 'drrho' else [])
        first = _train(model, csv, logs, f'resume-{name}', device, precisions[0], 1, flags)
        resumed = _train(model, csv, logs, f'resume-{name}', device, precisions[0], 2, flags + ['--resume', 'latest'])
        resume_runs.append((f'resume/{name}', first, resumed))
    return setup, cases, resume_runs


def precompute_case(work: Path, device: str):
    """A randomly initialised ViT-B-32 (224 px; nothing downloads) over 256 drawn images, then `verify`."""
    from drrho_openclip.demo import make_split
    csv = make_split(work / 'data224', 'train', 256, seed=4)
    out = work / 'vit_b_32_features'
    compute = [sys.executable, '-m', 'drrho_openclip.precompute', '--model', 'ViT-B-32', '--train-data', csv,
               '--output', out, '--device', device, '--batch-size', 128]
    verify = [sys.executable, '-c', 'import sys; from drrho_openclip.precompute import verify; '
                                    'sys.exit(verify(sys.argv[1:]))', out, '--train-data', csv]
    return compute, verify


# ---- two ranks on one device


def _batch(step, device):
    g = torch.Generator().manual_seed(step)
    n = WORLD * LOCAL_BATCH
    normal = lambda d: torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    image, text, ref_image, ref_text = normal(DIM), normal(DIM), normal(DIM - 2), normal(DIM - 2)
    index = torch.randperm(NUM_SAMPLES, generator=g)[:n]
    return [t.to(device) for t in (image, text, ref_image, ref_text, index)]


def _steps(case, rank, world_size, device):
    """Per step: the loss value and the gradients of this rank's features; then the whole per-sample state."""
    from drrho_openclip.losses import create_loss, get_loss_spec, per_sample_tables
    loss_name, options = TWO_RANK_CASES[case]
    run = {k: v for k, v in dict(num_samples=NUM_SAMPLES, rank=rank, world_size=world_size).items()
           if k in get_loss_spec(loss_name).run_options}
    torch.manual_seed(0)
    loss = create_loss(loss_name, **run, **options).to(device)
    if hasattr(loss, 'set_total_steps'):
        loss.set_total_steps(2)  # the two steps below (a learned τ's lr_tau 'auto')
    logit_scale = torch.tensor(1 / 0.07, device=device).log().exp().requires_grad_()
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH) if world_size > 1 else slice(None)
    out = []
    for step, epoch in enumerate((0, 1)):
        loss.set_epoch(epoch) if hasattr(loss, 'set_epoch') else None
        image, text, ref_image, ref_text, index = _batch(step, device)
        image, text = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
        value = loss(image, text, logit_scale, index=index[rows], ref_image_features=ref_image[rows],
                     ref_text_features=ref_text[rows])
        value.backward()
        out.append([value.detach(), image.grad, text.grad])
    tables = per_sample_tables(loss)
    state = {key: getattr(module, key.rsplit('.', 1)[-1]) for key, (module, _) in tables.items()}
    sharded = any(sharding.sharded for _, sharding in tables.values())
    return out, state, sharded


def _two_rank_worker(rank, case, device, port, results):
    import torch.distributed as dist
    backend = 'gloo' if device == 'cpu' else 'cuda:gloo'
    dist.init_process_group(backend, init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=WORLD)
    steps, state, sharded = _steps(case, rank, WORLD, device)
    if sharded:  # every rank's block, concatenated in rank order, is the whole table
        state = {k: torch.cat(_gather_objects(v.cpu(), dist)) for k, v in state.items()}
    results[rank] = ([[t.cpu() for t in step] for step in steps], {k: v.cpu() for k, v in state.items()})
    dist.barrier()  # no rank leaves while another is still in a collective
    # Leave without tearing the group down: torch 2.6's gloo destructor joins its worker thread while holding the
    # GIL, which that thread may need to free a finished collective's tensors, and hung now and then. A rank that
    # raises before this line makes mp.spawn stop the other and raise.
    os._exit(0)


def _gather_objects(tensor, dist):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, tensor)
    return parts


def two_rank_case(case, device, port):
    import torch.multiprocessing as mp
    start = time.perf_counter()
    try:
        whole_steps, whole_state, _ = _steps(case, 0, 1, device)
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_two_rank_worker, args=(case, device, port, results), nprocs=WORLD)
            ranks = [results[r] for r in range(WORLD)]
        for step, whole in enumerate(whole_steps):
            value, image_grad, text_grad = (t.cpu() for t in whole)
            parts = [ranks[r][0][step] for r in range(WORLD)]
            # loss value: the mean over ranks (DDP averages); gradients: each rank's rows, summed over ranks by
            # the gather's backward, i.e. WORLD × the one-process gradient of the mean loss
            torch.testing.assert_close(sum(p[0] for p in parts) / WORLD, value, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(torch.cat([p[1] for p in parts]) / WORLD, image_grad, rtol=1e-3, atol=1e-5)
            torch.testing.assert_close(torch.cat([p[2] for p in parts]) / WORLD, text_grad, rtol=1e-3, atol=1e-5)
        for key, table in whole_state.items():
            torch.testing.assert_close(ranks[0][1][key], table.cpu(), rtol=1e-4, atol=1e-5, equal_nan=True)
        return f'two-ranks/{case}', True, time.perf_counter() - start, ''
    except Exception as error:  # noqa: BLE001 - every case reports on its own
        return f'two-ranks/{case}', False, time.perf_counter() - start, f'{type(error).__name__}: {error}'


# the untiled aggregation, the tiled one ('tiled-…': three column tiles, the last narrower) on the same inputs, and
# the balanced loss's half-steps ('balanced-…': k = 2 unless k3; a rank-block's columns normalised over its rows),
# and `drrho`'s column step with the reference shift ('column': over the dense core's matrix, one process, its
# gradient through the core's backward; 'column-rows': each direction's own product in row blocks, as with a tile size)
AGGREGATION_VARIANTS = ('plain', 'reference', 'per-anchor-tau', 'adnce', 'rank-block',
                        'tiled-reference', 'tiled-adnce', 'tiled-rank-block',
                        'balanced-reference', 'balanced-k3', 'balanced-rank-block', 'column', 'column-rows')


def _aggregation_inputs(variant, batch, dtype, seed):
    """(args, kwargs) of an aggregation in `dtype` on the CPU, every tensor a leaf; 1/τ float32 or wider."""
    variant = variant.removeprefix('tiled-').removeprefix('balanced-')
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    unit = lambda: F.normalize(torch.randn(batch, 64, generator=g, dtype=torch.float64), dim=1).to(dtype)
    image, text = unit().requires_grad_(), unit().requires_grad_()
    width = batch if variant == 'per-anchor-tau' else ()
    inv_tau_image = (15 + 10 * torch.rand(width, generator=g, dtype=torch.float64)).requires_grad_()
    inv_tau_text = (15 + 10 * torch.rand(width, generator=g, dtype=torch.float64)).requires_grad_()
    kwargs = {}
    if variant == 'reference' or variant.startswith('column'):
        kwargs['reference'] = (unit(), unit())
    if variant == 'adnce':
        from drrho_openclip.losses.adnce import adnce_log_weight
        kwargs['negative_log_weight'] = adnce_log_weight(0.1, 0.3)
    return (image, text, inv_tau_image, inv_tau_text), kwargs


def _on_device(args, kwargs, device, dtype):
    """The inputs of a case on `device`: `args` as leaves (features in `dtype`, 1/τ float32 or wider) and the
    reference features (ref_image, ref_text) in `dtype`, or None."""
    leaves = [a.detach().to(device, dtype if a.dim() == 2 else torch.promote_types(dtype, torch.float32))
              .requires_grad_() for a in args]
    reference = tuple(r.to(device, dtype) for r in kwargs['reference']) if 'reference' in kwargs else None
    return leaves, reference


def _aggregate(args, kwargs, variant, device, dtype):
    """(log g image, log g text, gradients of image, text, 1/τ image, 1/τ text) on `device`, features in `dtype`."""
    from drrho_openclip.losses.dense import dense_aggregate
    from drrho_openclip.losses.tiled import make_tiled_aggregate
    aggregate = dense_aggregate
    if variant.startswith('tiled-'):
        aggregate, variant = make_tiled_aggregate(args[0].shape[0] // 3 + 1), variant.removeprefix('tiled-')
    leaves, reference = _on_device(args, kwargs, device, dtype)
    image, text, inv_tau_image, inv_tau_text = leaves
    if reference is not None:
        reference = (*reference, *reference)  # one process: its anchors are the candidates
    if variant == 'rank-block':  # rank 1 of 2: the second half of the anchors against the whole batch
        half = image.shape[0] // 2
        out = aggregate(image[half:], text[half:], image, text, half, inv_tau_image, inv_tau_text)
    else:
        out = aggregate(image, text, image, text, 0, inv_tau_image, inv_tau_text, reference,
                        kwargs.get('negative_log_weight'))
    upstream = torch.linspace(-1, 2, out[0].numel(), device=device, dtype=out[0].dtype)
    grads = torch.autograd.grad((out[0] * upstream).sum() + (out[1] * upstream.flip(0)).sum(), leaves)
    return [t.detach().cpu().double() for t in (*out, *grads)]


def _balance(args, kwargs, variant, device, dtype):
    """(A_k at the positives of the image and text branches, gradients of image, text and 1/τ) of the balanced
    loss's half-steps on `device`, features in `dtype`, from the same products as the loss."""
    from drrho_openclip.losses.balanced import balance_at_positives
    from drrho_openclip.losses.precision import product, similarities
    leaves, reference = _on_device(args[:3], kwargs, device, dtype)
    image, text, inv_tau = leaves
    steps = 3 if variant == 'balanced-k3' else 2
    if variant == 'balanced-rank-block':  # rank 1 of 2's rows, its columns' normalisers over its own rows alone
        half = image.shape[0] // 2
        values = balance_at_positives(similarities(image[half:], text), inv_tau, steps, offset=half)[:1]
    else:
        d = similarities(image, text)
        if reference is not None:
            d = d - product(reference[0], reference[1].T)
        values = balance_at_positives(d, inv_tau, steps, transposed=True)[0::2]
    upstream = torch.linspace(-1, 2, values[0].numel(), device=device, dtype=values[0].dtype)
    grads = torch.autograd.grad(sum((value * upstream.flip(0) ** n).sum() for n, value in enumerate(values)),
                                leaves)
    return [t.detach().cpu().double() for t in (*values, *grads)]


def _column(args, kwargs, variant, device, dtype):
    """(the column step's [b] value, gradients of image and text) on `device`, features in `dtype`; each anchor's
    log u drawn once from the batch size, so the device and the float64 run see the same."""
    from drrho_openclip.losses.columns import column_step
    from drrho_openclip.losses.dense import dense_aggregate
    leaves, reference = _on_device(args[:2], kwargs, device, dtype)
    image, text = leaves
    batch = image.shape[0]
    tau_image, tau_text = (1 / a.detach().to(device, torch.promote_types(dtype, torch.float32)) for a in args[2:])
    g = torch.Generator().manual_seed(batch)
    log_u_image, log_u_text = (torch.randn(batch, generator=g).to(device) for _ in range(2))
    shift, rows, pairs = (*reference, *reference), batch // 3 + 1, None
    if variant == 'column':
        rows, pairs = 0, dense_aggregate(image, text, image, text, 0, 1 / tau_image, 1 / tau_text, shift,
                                         keep_pairs=True)[2]
    value = column_step(image, text, image, text, shift, tau_image, tau_text, log_u_image, log_u_text, -3.0, 1,
                        rows=rows, pairs=pairs)
    upstream = torch.linspace(-1, 2, batch, device=device, dtype=value.dtype)
    return [t.detach().cpu().double() for t in (value, *torch.autograd.grad((value * upstream).sum(), leaves))]


def aggregation_name(variant, dtype, batch):
    return f"aggregation/{variant}/{str(dtype).removeprefix('torch.')}/{batch}"


def aggregation_case(variant, dtype, batch, device):
    name = aggregation_name(variant, dtype, batch)
    start = time.perf_counter()
    torch._dynamo.reset()  # every case compiled afresh (past dynamo's recompile limit it would run eagerly)
    try:
        args, kwargs = _aggregation_inputs(variant, batch, dtype, seed=batch)
        run = (_balance if variant.startswith('balanced-') else _column if variant.startswith('column')
               else _aggregate)
        on_device = run(args, kwargs, variant, device, dtype)
        exact = run(args, kwargs, variant, 'cpu', torch.float64)
        # values: the same rounded inputs, float32 arithmetic, except that a device without a float32-output
        # 16-bit product (the CPU) rounds the similarities to bf16; gradients: bf16 ones are rounded to bf16
        from drrho_openclip.losses.precision import _has_float32_output_mm
        exact_products = dtype == torch.float32 or _has_float32_output_mm(torch.device(device))
        tolerances = (1e-4 if exact_products else 1e-2, 1e-4 if dtype == torch.float32 else 2e-2)
        values = {_balance: len(on_device) - 3, _column: 1}.get(run, 2)  # the rest are gradients
        for k, (got, want) in enumerate(zip(on_device, exact)):
            error = ((got - want).norm() / want.norm()).item()
            if not error <= tolerances[k >= values]:  # NaN fails too
                raise AssertionError(f"output {k}: relative error {error:.2e} > {tolerances[k >= values]:.0e}")
        return name, True, time.perf_counter() - start, ''
    except Exception as error:  # noqa: BLE001 - every case reports on its own
        return name, False, time.perf_counter() - start, f'{type(error).__name__}: {error}'


def select(names, prefixes):
    """The names that start with one of `prefixes` (all of them when `prefixes` is None); ValueError naming a prefix
    that matches none."""
    if prefixes is None:
        return list(names)
    unmatched = [prefix for prefix in prefixes if not any(name.startswith(prefix) for name in names)]
    if unmatched:
        raise ValueError(f"{', '.join(unmatched)} matches no case")
    return [name for name in names if any(name.startswith(prefix) for prefix in prefixes)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cuda', help="'cuda' (default) or 'cpu' to try the script")
    p.add_argument('--quick', action='store_true',
                   help="the training runs of four losses instead of every loss's (the other cases run in full)")
    p.add_argument('--parallel', type=int, default=4, help='training runs at a time (default: %(default)s)')
    p.add_argument('--workdir', default=None, help='data, features and runs (default: a temporary directory)')
    p.add_argument('--out', default=str(RESULTS / 'gpu_check'), help='results prefix (.md and .json are added)')
    p.add_argument('--only', nargs='+', metavar='PREFIX',
                   help='run only the cases whose names (as in the results) start with one of these')
    args = p.parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check is for a GPU machine (try it on the CPU with --device cpu)")
    cpu = platform.processor() or platform.machine()
    device_name = torch.cuda.get_device_name() if args.device == 'cuda' else f'CPU ({cpu})'
    work = Path(args.workdir or tempfile.mkdtemp(prefix='gpu_check_'))
    logs = work / 'case_logs'
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    results = []

    def record(result):
        results.append(result)
        print(f"{'ok  ' if result[1] else 'FAIL'} {result[0]} ({result[2]:.0f} s)", flush=True)
        if not result[1]:
            print('    ' + result[3].replace('\n', '\n    '), flush=True)

    setup, cases, resumes = training_cases(work, args.device, args.quick)
    compute, verify = precompute_case(work, args.device)
    aggregations = {aggregation_name(variant, dtype, batch): (variant, dtype, batch)
                    for variant in AGGREGATION_VARIANTS for dtype in (torch.float32, torch.bfloat16)
                    for batch in (12, 2048)}
    two_ranks = {f'two-ranks/{case}': case for case in TWO_RANK_CASES}
    runs = {name: lambda cmd=cmd, name=name: _run(name, cmd, logs / (name.replace('/', '_') + '.log'), env)
            for name, cmd in cases}
    runs.update({r[0]: lambda r=r: _run_resume(r, logs, env) for r in resumes})
    runs['precompute/ViT-B-32'] = lambda: _run_pair('precompute/ViT-B-32', compute, verify, logs, env)
    try:
        chosen = set(select([*runs, *aggregations, *two_ranks], args.only))
    except ValueError as error:
        p.error(f'--only: {error}')
    if chosen & {*(name for name, _ in cases), *(r[0] for r in resumes)}:  # they train from the set-up's features
        for k, cmd in enumerate(setup):
            record(_run(f'setup/{k}', cmd, logs / f'setup{k}.log', env))
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        jobs = [pool.submit(run) for name, run in runs.items() if name in chosen]
        for job in concurrent.futures.as_completed(jobs):
            record(job.result())
    for name, (variant, dtype, batch) in aggregations.items():
        if name in chosen:
            record(aggregation_case(variant, dtype, batch, args.device))
    for k, (name, case) in enumerate(two_ranks.items()):
        if name in chosen:
            record(two_rank_case(case, args.device, 29500 + k))

    passed = sum(r[1] for r in results)
    summary = dict(device=device_name, torch=torch.__version__, python=platform.python_version(),
                   passed=passed, failed=len(results) - passed,
                   cases=[dict(case=n, passed=ok, seconds=round(s, 1), error=e) for n, ok, s, e in sorted(results)])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix('.json').write_text(json.dumps(summary, indent=1))
    lines = [f"# GPU check on {device_name}", '',
             f"torch {torch.__version__}, Python {platform.python_version()}: {passed} passed, "
             f"{len(results) - passed} failed (`python benchmarks/gpu_check.py"
             f"{' ' + ' '.join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ''}`)", '',
             '| case | result | seconds |', '|---|---|---|']
    lines += [f"| {c['case']} | {'ok' if c['passed'] else 'FAILED: ' + c['error'].splitlines()[-1][:120]} | "
              f"{c['seconds']} |" for c in summary['cases']]
    out.with_suffix('.md').write_text('\n'.join(lines) + '\n')
    print(f"\n{passed} passed, {len(results) - passed} failed; {out.with_suffix('.md')}; logs in {logs}")
    return 0 if passed == len(results) else 1


def _run_pair(name, first, second, logs, env, expect=None):
    """A case of two commands, the second only after the first passed (e.g. train, then resume); `expect`: a line the
    second one's output must contain."""
    log = logs / (name.replace('/', '_') + '.log')
    first_result = _run(name, first, log, env)
    if not first_result[1]:
        return first_result
    second_log = log.with_suffix('.second.log')
    _, passed, seconds, tail = _run(name, second, second_log, env)
    if passed and expect is not None and expect not in second_log.read_text(errors='replace'):
        passed, tail = False, f"'{expect}' not in {second_log}"
    return name, passed, first_result[2] + seconds, tail


def _run_resume(resume, logs, env):
    name, first, resumed = resume
    return _run_pair(name, first, resumed, logs, env, expect='=> resuming checkpoint')


if __name__ == '__main__':
    sys.exit(main())
