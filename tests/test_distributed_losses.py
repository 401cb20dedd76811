"""A 2-process gloo run of a loss equals the 1-process run on the same global batch: value, feature gradients
(as DDP would average them) and per-sample state."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drrho_openclip.losses import create_loss

B, D, N, STEPS = 8, 6, 20, 3


def make_batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(STEPS):
        f = lambda: torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=-1)
        batches.append(dict(image=f(), text=f(), ref_image=f(), ref_text=f(),
                            index=torch.randperm(N, generator=g)[:B], logit_scale=torch.tensor(20.0)))
    return batches


OPTIONS = {
    'drrho': dict(gamma=0.5),
    'drrho-learnable': dict(gamma=0.5, learn_temperature=True, temperature=0.05, rho=1.0),
    'sogclr': dict(gamma=0.5),
}


def build(name, rank, world_size):
    options = dict(OPTIONS[name])
    return create_loss(name.split('-')[0], num_samples=N, rank=rank, world_size=world_size, **options)


def run_steps(name, rank, world_size):
    """Per step: (loss value, image grad, text grad, logit_scale grad) for this rank's rows; then the state."""
    loss_fn = build(name, rank, world_size)
    loss_fn.set_epoch(1)  # γ < 1 from epoch 1 on
    b = B // world_size
    rows = slice(rank * b, (rank + 1) * b)
    out = []
    for batch in make_batches():
        image = batch['image'][rows].clone().requires_grad_()
        text = batch['text'][rows].clone().requires_grad_()
        logit_scale = batch['logit_scale'].clone().requires_grad_()
        value = loss_fn(image, text, logit_scale, index=batch['index'][rows],
                        ref_image_features=batch['ref_image'][rows], ref_text_features=batch['ref_text'][rows])
        value.backward()
        scale_grad = logit_scale.grad if logit_scale.grad is not None else torch.tensor(0.0, dtype=torch.float64)
        out.append((value.detach(), image.grad, text.grad, scale_grad))
    return out, {k: v.clone() for k, v in loss_fn.state_dict().items()}


def _worker(rank, world_size, port, name, out_dir):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=world_size)
    try:
        torch.save(run_steps(name, rank, world_size), os.path.join(out_dir, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.parametrize('name', sorted(OPTIONS))
def test_two_processes_equal_one(name, tmp_path):
    single_steps, single_state = run_steps(name, 0, 1)
    port = free_port()
    procs = [mp.get_context('spawn').Process(target=_worker, args=(r, 2, port, name, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = [torch.load(tmp_path / f'rank{r}.pt') for r in range(2)]
    for step, (value, image_grad, text_grad, scale_grad) in enumerate(single_steps):
        ranks = [results[r][0][step] for r in range(2)]
        # DDP averages gradients over ranks; each rank's loss is the mean over its own anchors
        torch.testing.assert_close(sum(r[0] for r in ranks) / 2, value)
        torch.testing.assert_close(torch.cat([r[1] for r in ranks]) / 2, image_grad)
        torch.testing.assert_close(torch.cat([r[2] for r in ranks]) / 2, text_grad)
        torch.testing.assert_close(sum(r[3] for r in ranks) / 2, scale_grad)
    for rank in range(2):
        for key, value in single_state.items():
            torch.testing.assert_close(results[rank][1][key], value, equal_nan=True)
