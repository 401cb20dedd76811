"""Two gloo processes with half the batch each equal one process with the whole batch: loss values, gradients
(features: the sum over ranks, as all_gather's backward gives it; logit_scale and TempNet: the mean, as DDP gives
it), and the replicated per-sample tables. JEST's draws are per rank, conditioned on the global selection."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import on_gloo_ranks, without_dropout
from drrho_openclip.losses import create_loss, get_loss_spec
from drrho_openclip.losses.distill import TEACHER_SCALE_RANGE, calibrated_logit_scale

WORLD, B = 2, 6  # per-rank batch
NUM_SAMPLES = 20

# (loss, options, epochs of the steps)
SCENARIOS = {
    'drrho': ('drrho', dict(gamma=0.5, gamma_decay_epochs=1, temperature=0.05, learn_temperature=False), (0, 1)),
    # the default: CLIP's estimator (γ = 1, ε = 1/(B − 1) of the global batch), τ the model's logit_scale, ρ from the
    # batch, the column half-step: each rank's columns over the gathered anchors
    'drrho-default': ('drrho', {}, (0, 1, 1)),
    # the default before: SogCLR's u, the paper's ε, τ learned from 0.07 by the loss's Adam; the column step over the
    # gathered anchors and their gathered u
    'drrho-estimator': ('drrho', dict(gamma=0.5, gamma_decay_epochs=1, positive_in_denominator=False,
                                      temperature_optimizer='loss', lr_tau=0.05), (0, 1, 1)),
    'drrho-learnable': ('drrho', dict(gamma=0.5, gamma_decay_epochs=1, learn_temperature=True, rho=1.0,
                                      temperature=0.07, temperature_optimizer='model'), (0, 1)),
    # τ chosen from the gathered batch's reference margins, learned by the loss's Adam with the all-reduced gradient
    'drrho-auto': ('drrho', dict(temperature='auto', temperature_optimizer='loss', gamma=0.5, gamma_decay_epochs=1,
                                 lr_tau=0.05), (0, 1, 1)),
    'drrho-auto-tiled': ('drrho', dict(temperature='auto', temperature_optimizer='loss', gamma=0.5,
                                       gamma_decay_epochs=1, lr_tau=0.05, tile_size=5), (0, 1)),
    'fastclip': ('fastclip', dict(gamma=0.5, gamma_decay_epochs=1, lr_tau=0.05), (0, 1, 1)),
    # the DRO without the column half-step (the paper's; drrho-paper's), and sogclr with it in blocks of 4 rows
    'drrho-no-column': ('drrho', dict(gamma=0.5, gamma_decay_epochs=1, temperature_optimizer='loss', lr_tau=0.05,
                                      column_step=False), (0, 1, 1)),
    'sogclr-column-tiled': ('sogclr', dict(gamma=0.5, gamma_decay_epochs=1, column_step=True, tile_size=4), (0, 1)),
    'sogclr': ('sogclr', dict(gamma=0.5, gamma_decay_epochs=1), (0, 1)),
    'drrho-tiled': ('drrho', dict(gamma=0.5, gamma_decay_epochs=1, temperature=0.05, learn_temperature=False,
                                  tile_size=5), (0, 1)),
    'isogclr-tiled': ('isogclr', dict(gamma=0.5, gamma_decay_epochs=1, lr_tau=0.01, tile_size=4), (0, 1, 1)),
    'drrho+kd': ('drrho', dict(gamma=1.0, temperature=0.05, distill_weight=0.3), (0,)),
    'fastclip+kd': ('fastclip', dict(gamma=0.5, gamma_decay_epochs=1, distill_weight=0.3, rho=8.5,
                                     temperature_optimizer='model'), (0, 1)),
    'fastclip+kd-adam': ('fastclip', dict(gamma=0.5, gamma_decay_epochs=1, distill_weight=0.3, lr_tau=0.05), (0, 1)),
    'isogclr': ('isogclr', dict(gamma=0.5, gamma_decay_epochs=1, lr_tau=0.01), (0, 1, 1)),
    'tempnet': ('tempnet', dict(embed_dim=5, tempnet_width=8, tempnet_prototypes=4, gamma=0.5), (0, 1)),
    'adnce': ('adnce', dict(adnce_sigma=0.3), (0,)),
    'balanced2': ('balanced', dict(balance_steps=2), (0,)),
    'balanced3': ('balanced', dict(balance_steps=3, reference_shift=True), (0,)),
    'balanced+kd': ('balanced', dict(balance_steps=2, reference_shift=True, distill_weight=0.4), (0, 0)),
    # the teacher's scale calibrated on the gathered first batch ('auto'), then kept
    'clip+kd': ('clip', dict(distill_weight=0.4), (0, 0)),
    # the reference's scale given, as test_jest_selection_is_global's float64 reference takes it
    'jest': ('jest', dict(selection_ratio=0.5, num_chunks=3, reference_logit_scale=100.0), (0,)),
    'jest-topk': ('jest-topk', dict(selection_ratio=0.5, num_chunks=2, reference_logit_scale=100.0), (0,)),
    # the reference's scale calibrated on the gathered first batch ('auto'), then kept: its reference tells the pairs
    # apart (PAIRED_REFERENCE), so the scale lies inside its range and one rank's half would calibrate another
    'jest-auto': ('jest', dict(selection_ratio=0.5, num_chunks=2), (0, 0)),
}
# Scenarios whose reference text features are their reference images' plus noise (jest-auto: a calibrated scale of 15.8
# on the whole of step 0's batch, 100 and 16.3 on the ranks' halves). Elsewhere the reference's pairs are independent
# draws, no better than chance: the scale sits at its lower bound 1 whatever rows it is calibrated on.
PAIRED_REFERENCE = {'jest-auto', 'balanced+kd'}


def full_batch(step, scenario=None):
    g = torch.Generator().manual_seed(step)
    n = WORLD * B
    image, text = (F.normalize(torch.randn(n, 5, generator=g, dtype=torch.float64), dim=1) for _ in range(2))
    ref_image = F.normalize(image[:, :4] + 0.5 * torch.randn(n, 4, generator=g, dtype=torch.float64), dim=1)
    ref_text = F.normalize(text[:, :4] + 0.5 * torch.randn(n, 4, generator=g, dtype=torch.float64), dim=1)
    index = torch.randperm(NUM_SAMPLES, generator=g)[:n]
    if scenario in PAIRED_REFERENCE:  # drawn last: the other scenarios' batches stay as they were
        ref_text = F.normalize(ref_image + 0.3 * torch.randn(n, 4, generator=g, dtype=torch.float64), dim=1)
    return image, text, ref_image, ref_text, index


def run(scenario, rank, world_size):
    """Every step's (value, feature grads, logit_scale grad, parameter grads) and the final state_dict."""
    name, options, epochs = SCENARIOS[scenario]
    if get_loss_spec(name).stateful:
        options = dict(options, num_samples=NUM_SAMPLES)
    loss = without_dropout(create_loss(name, rank=rank, world_size=world_size, **options).double())
    torch.manual_seed(0)
    loss.load_state_dict(create_loss(name, **options).double().state_dict())  # same TempNet
    if hasattr(loss, 'set_total_steps'):
        loss.set_total_steps(len(epochs))  # as a training run does (a learned τ's lr_tau 'auto')
    rows = slice(rank * B, (rank + 1) * B) if world_size > 1 else slice(None)
    params = list(loss.parameters())
    steps = []
    for step, epoch in enumerate(epochs):
        if hasattr(loss, 'set_epoch'):
            loss.set_epoch(epoch)
        image, text, ref_image, ref_text, index = full_batch(step, scenario)
        image, text = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
        logit_scale = torch.tensor(15.0, dtype=torch.float64, requires_grad=True)
        out = loss(image, text, logit_scale, index=index[rows], ref_image_features=ref_image[rows],
                   ref_text_features=ref_text[rows], output_dict=True)
        total = sum(out.values())
        grads = torch.autograd.grad(total, [image, text, logit_scale] + params, allow_unused=True)
        grads = [torch.zeros(()) if g is None else g for g in grads]
        value = total.detach().clone()
        if world_size > 1:  # DDP's view: the mean over ranks of the value and of replicated parameters' grads
            for t in [value] + grads[2:]:
                dist.all_reduce(t)
                t /= world_size
        steps.append([value] + grads)
    return steps, {k: v.clone() for k, v in loss.state_dict().items()}


def every_scenario(rank, world_size):
    return {scenario: run(scenario, rank, world_size) for scenario in SCENARIOS}


@pytest.fixture(scope='module')
def distributed(tmp_path_factory):
    return on_gloo_ranks(every_scenario, WORLD, tmp_path_factory.mktemp('ranks'))


@pytest.mark.parametrize('scenario', [s for s in SCENARIOS if not s.startswith('jest')])  # JEST: below
def test_two_ranks_equal_one(distributed, scenario):
    single_steps, single_state = run(scenario, 0, 1)
    for rank, results in enumerate(distributed):
        steps, state = results[scenario]
        for got, want in zip(steps, single_steps):
            value, g_image, g_text, *replicated = got
            rows = slice(rank * B, (rank + 1) * B)
            torch.testing.assert_close(value, want[0], rtol=1e-9, atol=1e-12)
            # all_gather's backward sums every rank's loss; the single process averages them
            torch.testing.assert_close(g_image, WORLD * want[1][rows], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(g_text, WORLD * want[2][rows], rtol=1e-9, atol=1e-12)
            for a, b in zip(replicated, want[3:]):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        for key, value in single_state.items():  # the tables are replicated, whole, on every rank
            torch.testing.assert_close(state[key], value, equal_nan=True, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize('scenario', ['jest', 'jest-topk', 'jest-auto'])
def test_jest_selection_is_global(distributed, scenario):
    from test_losses_reference import clip_reference, jest_reference
    name, options, epochs = SCENARIOS[scenario]
    teacher = options.get('reference_logit_scale', 'auto')
    if teacher == 'auto':  # the one process's: calibrated on the whole first batch, kept for the second
        teacher = calibrated_logit_scale(*full_batch(0, scenario)[2:4]).item()
    for step in range(len(epochs)):
        image, text, ref_image, ref_text, _ = full_batch(step, scenario)
        ranks = [tuple(x[r * B:(r + 1) * B] for x in (image, text, ref_image, ref_text)) for r in range(WORLD)]
        # each rank's noise: its loss's draws at this step (keyed by rank and by the selections before: they differ)
        noises = [jest_noise(name, options, r, step) for r in range(WORLD)]
        selected = jest_reference(ranks, 15.0, teacher, options['selection_ratio'], options['num_chunks'],
                                  name == 'jest-topk', noises)
        rows = torch.tensor([r * B + i for r in range(WORLD) for i in selected[r]])
        image, text = image.requires_grad_(), text.requires_grad_()
        logit_scale = torch.tensor(15.0, dtype=torch.float64, requires_grad=True)
        want = clip_reference(image[rows], text[rows], logit_scale)
        want_grads = torch.autograd.grad(want, [image, text, logit_scale])
        for rank, results in enumerate(distributed):
            value, g_image, g_text, g_scale = results[scenario][0][step]
            local = slice(rank * B, (rank + 1) * B)
            torch.testing.assert_close(value, want.detach(), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(g_image, WORLD * want_grads[0][local], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(g_text, WORLD * want_grads[1][local], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(g_scale, want_grads[2], rtol=1e-9, atol=1e-12)


def jest_noise(name, options, rank, step):
    """The Gumbel draws of `rank`'s loss at its `step`-th selection, by chunk."""
    loss = create_loss(name, rank=rank, world_size=WORLD, **options)
    loss.selections.fill_(step)
    return lambda chunk: loss._gumbel(torch.zeros(B, dtype=torch.float64), chunk)


def test_jest_auto_teacher_scale_is_the_whole_batch_s_on_every_rank(distributed):
    """'auto' calibrates the teacher's scale on the gathered first batch: every rank keeps the one process's value.
    The selection alone may not show a rank that calibrated on its own rows (a few points of learnability can leave
    it unchanged): the kept value is compared directly."""
    _, single_state = run('jest-auto', 0, 1)
    want = single_state['reference_logit_scale.value']
    torch.testing.assert_close(want, calibrated_logit_scale(*full_batch(0, 'jest-auto')[2:4]), rtol=1e-12, atol=0)
    low, high = TEACHER_SCALE_RANGE
    assert 1.5 * low < want < high / 1.5, want  # inside its range, where the rows it is calibrated on matter
    for rank, results in enumerate(distributed):
        got = results['jest-auto'][1]['reference_logit_scale.value']
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=lambda m: f'rank {rank}: {m}')
