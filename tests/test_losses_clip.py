"""The torch-only CLIP and MobileCLIP losses equal OpenCLIP's `ClipLoss` and `DistillClipLoss`: values and
gradients, in one process and in two gloo processes, for every combination of --local-loss / --gather-with-grad."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import on_gloo_ranks
from drrho_openclip.losses.clip import ClipLoss
from drrho_openclip.losses.mobileclip import MobileClipLoss

WORLD, B = 2, 5  # per-rank batch
FLAGS = list(itertools.product([False, True], repeat=2))  # (local_loss, gather_with_grad)
LAMBDA, TEACHER_SCALE = 0.3, 50.0


def full_batch():
    g = torch.Generator().manual_seed(0)
    return [F.normalize(torch.randn(WORLD * B, 6, generator=g, dtype=torch.float64), dim=1) for _ in range(4)]


def openclip_loss(kind, local_loss, gather_with_grad, rank, world_size):
    from open_clip.loss import ClipLoss as OpenClipLoss, DistillClipLoss
    options = dict(local_loss=local_loss, gather_with_grad=gather_with_grad, rank=rank, world_size=world_size)
    return (OpenClipLoss if kind == 'clip' else DistillClipLoss)(**options)


def ours(kind, local_loss, gather_with_grad, rank, world_size):
    options = dict(local_loss=local_loss, gather_with_grad=gather_with_grad, rank=rank, world_size=world_size)
    return ClipLoss(**options) if kind == 'clip' else MobileClipLoss(LAMBDA, TEACHER_SCALE, **options)


def step(loss, kind, rows, reference):
    """(the loss terms, grads of their total wrt image, text, logit_scale) on this rank's rows."""
    image, text, ref_image, ref_text = (x[rows].clone() for x in full_batch())
    image.requires_grad_(), text.requires_grad_()
    logit_scale = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
    if kind == 'clip':
        terms = [loss(image, text, logit_scale)]
    elif reference:  # OpenCLIP's DistillClipLoss: unweighted (contrastive, distill); MobileCLIP's weighting
        contrastive, distill = loss(image, text, logit_scale, ref_image, ref_text, TEACHER_SCALE)
        terms = [(1 - LAMBDA) * contrastive, LAMBDA * distill]
    else:
        out = loss(image, text, logit_scale, ref_image_features=ref_image, ref_text_features=ref_text,
                   output_dict=True)
        terms = [out['contrastive_loss'], out['distill_loss']]
    grads = torch.autograd.grad(sum(terms), [image, text, logit_scale])
    return [t.detach() for t in terms] + list(grads)


def results(rank, world_size):
    rows = slice(rank * B, (rank + 1) * B) if world_size > 1 else slice(None)
    out = {}
    for kind, (local_loss, gather_with_grad) in itertools.product(('clip', 'mobileclip'), FLAGS):
        for source, build in (('openclip', openclip_loss), ('ours', ours)):
            loss = build(kind, local_loss, gather_with_grad, rank, world_size)
            out[kind, local_loss, gather_with_grad, source] = step(loss, kind, rows, reference=source == 'openclip')
    return out


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    return on_gloo_ranks(results, WORLD, tmp_path_factory.mktemp('clip_ranks'))


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize('kind', ['clip', 'mobileclip'])
def test_one_process_equals_openclip(kind):
    single = results(0, 1)
    for local_loss, gather_with_grad in FLAGS:
        assert_same(single[kind, local_loss, gather_with_grad, 'ours'],
                    single[kind, local_loss, gather_with_grad, 'openclip'])


@pytest.mark.parametrize('local_loss, gather_with_grad', FLAGS)
@pytest.mark.parametrize('kind', ['clip', 'mobileclip'])
def test_two_processes_equal_openclip(two_ranks, kind, local_loss, gather_with_grad):
    for rank_results in two_ranks:
        assert_same(rank_results[kind, local_loss, gather_with_grad, 'ours'],
                    rank_results[kind, local_loss, gather_with_grad, 'openclip'])
