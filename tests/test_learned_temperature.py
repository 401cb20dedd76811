"""The global τ learned by the loss's own Adam on log τ: the 'auto' start from the first batch's reference margins,
ρ from the batch, its gradient against the paper's objective, its steps, bounds and state. Two processes equal one in
test_losses_distributed.py (scenarios drrho-auto, fastclip)."""
import math

import numpy as np
import pytest
import torch

from drrho_openclip.losses import (LearnedTemperature, create_loss, effective_negatives, get_loss_spec,
                                   reference_margins, rho_for_batch, temperature_for_effective_negatives)
from test_losses_reference import ALPHA, F64, batch, inner_mean, shifted_loss

# These tests are of the τ the loss's own Adam learns (--temperature-optimizer loss, the paper's App. C.3), on the
# paper's ε: drrho's default τ is the model's logit_scale and its ε 1/(B − 1)
OWN_ADAM = dict(temperature_optimizer='loss', positive_in_denominator=False)


def call(loss, image, text, ref_image, ref_text):
    return loss(image, text, None, index=torch.arange(len(image)), ref_image_features=ref_image,
                ref_text_features=ref_text, output_dict=True)['contrastive_loss']


def median_effective_negatives(ref_image, ref_text, tau):
    """From the definitions, in numpy: every anchor's weights softmax_j((s^ref_ii − s^ref_ij)/τ) over its negatives,
    both directions, exp of their entropy; the median as torch takes it (the lower middle of an even count)."""
    sim = (ref_image @ ref_text.T).numpy()
    n_eff = []
    for s in (sim, sim.T):
        for i, row in enumerate(s):
            margins = np.delete(s[i, i] - row, i)
            p = np.exp((margins - margins.max()) / tau)
            p /= p.sum()
            n_eff.append(np.exp(-(p * np.log(p)).sum()))
    return np.sort(n_eff)[(len(n_eff) - 1) // 2]


@pytest.mark.parametrize('n, k', [(32, 8.0), (64, 8.0), (64, 3.0)])
def test_auto_temperature_gives_the_median_anchor_k_effective_negatives(n, k, caplog):
    g = torch.Generator().manual_seed(n + int(k))
    image, text, ref_image, ref_text = batch(g, n, d=8, ref_d=8)
    loss = create_loss('drrho', **OWN_ADAM, num_samples=n, temperature='auto', gamma=1.0, target_negatives=k,
                       lr_tau=0.01).double()
    with caplog.at_level('INFO'):
        call(loss, image, text, ref_image, ref_text)
        tau = loss.metrics()['tau_image_mean']  # the τ the first call used: the one chosen before its step
        call(loss, image, text, ref_image, ref_text)
    # the chosen start gets a log line of its own, once
    said = [r.getMessage() for r in caplog.records if "temperature 'auto' starts at" in r.getMessage()]
    assert said == [f"drrho-openclip: temperature 'auto' starts at τ = {tau:.4g}: the reference shift alone gives "
                    f"the first batch's median anchor {k:g} effective negatives"]
    assert get_loss_spec('drrho').defaults['tau_min'] < tau < get_loss_spec('drrho').defaults['tau_max']
    # the weights see the shift α·m: at τ they are those of the margins m at τ/α
    assert median_effective_negatives(ref_image, ref_text, tau / ALPHA) == pytest.approx(k, rel=1e-6)


@pytest.mark.parametrize('case', ['reference alike for every pair', 'batch of at most k + 1'])
def test_an_auto_temperature_at_a_bound_is_a_warning(case, caplog):
    """Neither start is one the rule chose: with margins all zero every τ spreads an anchor over all B − 1
    negatives, and with B − 1 ≤ k none spreads it over k."""
    n = 16 if case.startswith('reference') else 8
    image, text, ref_image, ref_text = batch(torch.Generator().manual_seed(0), n)
    if case.startswith('reference'):
        ref_image = ref_text = torch.full_like(ref_image, ref_image.shape[1] ** -0.5)
    loss = create_loss('drrho', **OWN_ADAM, num_samples=n, temperature='auto', lr_tau=0.01).double()
    with caplog.at_level('INFO'):
        call(loss, image, text, ref_image, ref_text)
    said = [r for r in caplog.records if "temperature 'auto' starts at" in r.getMessage()]
    bound = 'lower' if case.startswith('reference') else 'upper'
    assert len(said) == 1 and said[0].levelname == 'WARNING' and f"starts at its {bound} bound" in said[0].getMessage()
    limit = get_loss_spec('drrho').defaults['tau_min' if bound == 'lower' else 'tau_max']
    assert loss.metrics()['tau_image_mean'] == pytest.approx(limit, rel=1e-6)  # the τ of the call, before its step


def test_auto_temperature_stays_within_its_bounds():
    g = torch.Generator().manual_seed(0)
    _, _, ref_image, ref_text = batch(g, 16)
    margins = reference_margins(ref_image, ref_text)
    assert margins.shape == (32, 15)
    # more effective negatives than a row has: no τ spreads enough, the upper bound
    assert temperature_for_effective_negatives(margins, 15.5, 0.01, 2.0).item() == pytest.approx(2.0)
    # one effective negative: every τ spreads enough, the lower bound
    assert temperature_for_effective_negatives(margins, 1.0, 0.01, 2.0).item() == pytest.approx(0.01)
    tau = temperature_for_effective_negatives(margins, 5.0, 0.01, 2.0)
    assert effective_negatives(margins, tau).median().item() == pytest.approx(5.0, rel=1e-6)


def test_rho_from_the_batch():
    g = torch.Generator().manual_seed(1)
    n = 24
    image, text, ref_image, ref_text = batch(g, n)
    loss = create_loss('drrho', **OWN_ADAM, num_samples=n, temperature='auto', gamma=1.0, target_negatives=4.0,
                       lr_tau=0.01).double()
    call(loss, image, text, ref_image, ref_text)
    assert loss.metrics()['rho'] == pytest.approx(math.log(23 / 4))
    assert rho_for_batch(5, 8) == 0.0  # no more negatives than the target: no constraint
    values = {}
    for rho in (2.5, 0.0):
        given = create_loss('drrho', **OWN_ADAM, num_samples=n, temperature='auto', gamma=1.0, rho=rho, lr_tau=0.01).double()
        values[rho] = call(given, image, text, ref_image, ref_text).item()
        assert given.rho == rho and 'rho' not in given.metrics()  # logged only when it comes from the batch
    # the same 'auto' τ from the same batch: the two losses differ by the ρ term of both directions, 2ρτ
    tau = given.metrics()['tau_image_mean']
    assert values[2.5] - values[0.0] == pytest.approx(2 * 2.5 * tau, rel=1e-9)


@pytest.mark.parametrize('distill_weight', [0.0, 0.5])
@pytest.mark.parametrize('name', ['drrho', 'fastclip'])
def test_adam_temperature_gradient_is_the_papers(name, distill_weight):
    """Appendix C.3 with γ = 1: Adam on log τ with G = ∂L/∂log τ = τ ∂L/∂τ of L = mean_i [τ log(ε + g_i) +
    τ log(ε + g'_i)] + 2ρτ, by autograd of the formula, at every step: its moments start at G and G² (NaN marks no
    step yet), then m ← β1 m + (1−β1) G, v ← β2 v + (1−β2) G², log τ ← log τ − lr·m/(√v + eps); the next call uses
    the new τ. With KD (λ > 0) the same G: the loss's Adam learns τ from the DRO objective alone, as the paper's τ
    is; KD, whose student scale is 1/τ, reaches τ only where the model's logit_scale learns it
    (--temperature-optimizer model)."""
    n, eps, rho, lr, tau0 = 7, 1e-3, 0.7, 0.02, 0.05
    g = torch.Generator().manual_seed(5)
    kd = dict(distill_weight=distill_weight, reference_logit_scale=5.0) if distill_weight else {}
    loss = create_loss(name, **OWN_ADAM, num_samples=n, gamma=1.0, epsilon=eps, rho=rho, temperature=tau0, lr_tau=lr,
                       learn_temperature=True, **kd).double()
    use_ref = name == 'drrho'
    log_tau, m, v = math.log(tau0), None, None
    for step in range(3):
        image, text, ref_image, ref_text = batch(g, n)
        call(loss, image, text, ref_image, ref_text)
        assert loss.metrics()['tau_image_mean'] == pytest.approx(math.exp(log_tau), rel=1e-12)
        ell_image = shifted_loss(image, text, *((ref_image, ref_text) if use_ref else ()), alpha=ALPHA).detach()
        ell_text = shifted_loss(text, image, *((ref_text, ref_image) if use_ref else ()), alpha=ALPHA).detach()
        leaf = torch.tensor(log_tau, **F64, requires_grad=True)
        tau = leaf.exp()
        objective = (tau * torch.log(eps + inner_mean(ell_image, tau))
                     + tau * torch.log(eps + inner_mean(ell_text, tau))).mean() + 2 * tau * rho
        grad = torch.autograd.grad(objective, leaf)[0].item()
        m = grad if m is None else 0.9 * m + 0.1 * grad  # the moments start at the first gradient
        v = grad ** 2 if v is None else 0.999 * v + 0.001 * grad ** 2
        temperature = loss.temperature
        assert temperature.exp_avg.item() == pytest.approx(m, rel=1e-9)
        assert temperature.exp_avg_sq.item() == pytest.approx(v, rel=1e-9)
        assert temperature.log_tau.item() == pytest.approx(log_tau - lr * m / (math.sqrt(v) + 1e-8), rel=1e-9)
        log_tau = temperature.log_tau.item()
    assert abs(abs(m) / math.sqrt(v) - 1) > 0.01  # the gradients differed: a sign step would move log τ by lr


@pytest.mark.parametrize('name', ['drrho', 'fastclip'])
def test_auto_lr_tau_is_one_over_the_runs_optimiser_steps(name):
    """The default lr_tau 'auto' takes the Adam step of lr_tau = 1/T once the run says it has T optimiser steps;
    before that the loss refuses to train, and a given lr_tau is kept whatever T is."""
    n, steps = 7, 40
    g = torch.Generator().manual_seed(9)
    batches = [batch(g, n) for _ in range(3)]
    auto = create_loss(name, **OWN_ADAM, num_samples=n, gamma=1.0).double()
    with pytest.raises(RuntimeError, match='set_total_steps'):
        call(auto, *batches[0])
    auto.set_total_steps(steps)
    given = create_loss(name, **OWN_ADAM, num_samples=n, gamma=1.0, lr_tau=1 / steps).double()
    kept = create_loss(name, **OWN_ADAM, num_samples=n, gamma=1.0, lr_tau=0.02).double()
    kept.set_total_steps(steps)
    for b in batches:
        for loss in (auto, given, kept):
            call(loss, *b)
    assert auto.temperature.log_tau.item() == given.temperature.log_tau.item() != math.log(0.07)
    assert kept.temperature.lr == 0.02 and kept.temperature.log_tau.item() != auto.temperature.log_tau.item()
    with pytest.raises(ValueError, match='at least one optimiser step'):
        auto.set_total_steps(0)


@pytest.mark.parametrize('tau_objective', ['estimator', 'batch'])
def test_global_tau_steps_on_the_chosen_objective(tau_objective):
    """With γ < 1 a sample's u is from its last visit. By default (the paper's) the global τ's gradient is that of
    the SogCLR estimate with u; with tau_objective 'batch' it is that of this batch's objective (u = g),
    mean_i [τ log(ε + g_i) + τ log(ε + g'_i)] + 2ρτ, whose τ-derivative is ρ − KL(p_i ‖ uniform) of this batch's
    weights. The u-based one overstates it while the model improves, which keeps lowering τ."""
    n, eps, rho, lr, tau0, gamma = 6, 1e-3, 0.7, 0.02, 0.05, 0.3
    g = torch.Generator().manual_seed(11)
    loss = create_loss('drrho', **OWN_ADAM, num_samples=n, gamma=gamma, gamma_decay_epochs=1, epsilon=eps, rho=rho,
                       temperature=tau0, lr_tau=lr, learn_temperature=True, tau_objective=tau_objective).double()
    first = batch(g, n)
    call(loss, *first)  # epoch 0: γ = 1, u = g of this batch
    log_tau = loss.temperature.log_tau.item()
    loss.set_epoch(1)  # γ = 0.3: the revisit's u mixes the first visit's g with this one's
    second = batch(g, n)
    call(loss, *second)

    def directions(image, text, ref_image, ref_text):
        return (shifted_loss(image, text, ref_image, ref_text, alpha=ALPHA),
                shifted_loss(text, image, ref_text, ref_image, alpha=ALPHA))

    def gradient(at_log_tau, now, before=None):
        """∂/∂log τ of the batch objective of `now`; with `before`, of the SogCLR estimate whose u mixes the g of
        `before` (at τ0, its visit) with that of `now`: value log(ε + u), gradient ∇g / (ε + u)."""
        leaf = torch.tensor(at_log_tau, **F64, requires_grad=True)
        tau = leaf.exp()
        objective = 2 * tau * rho
        for side, ell in enumerate(directions(*now)):
            g_now = inner_mean(ell.detach(), tau)
            if before is None:
                objective = objective + tau * torch.log(eps + g_now)
                continue
            g_before = inner_mean(directions(*before)[side].detach(), torch.tensor(tau0, **F64))
            u = ((1 - gamma) * g_before + gamma * g_now).detach()
            objective = objective + tau * (torch.log(eps + u) + (g_now - g_now.detach()) / (eps + u))
        return torch.autograd.grad(objective.mean(), leaf)[0].item()

    g1 = gradient(math.log(tau0), first)  # the first visit: u = g either way
    batch_gradient, state_gradient = gradient(log_tau, second), gradient(log_tau, second, before=first)
    g2 = batch_gradient if tau_objective == 'batch' else state_gradient
    assert loss.temperature.exp_avg.item() == pytest.approx(0.9 * g1 + 0.1 * g2, rel=1e-9)
    assert loss.temperature.exp_avg_sq.item() == pytest.approx(0.999 * g1 ** 2 + 0.001 * g2 ** 2, rel=1e-9)
    # the two forms differ here, so the test tells them apart
    assert abs(state_gradient - batch_gradient) > 0.05 * abs(g2)


def consistent_objective(temperature, slope):
    """A per-anchor objective slope·log τ through the temperature's leaf: its gradient is `slope`, every step."""
    tau, _ = temperature(image_features=torch.zeros(4, 2))
    return slope * tau.log().expand(4)


def test_tau_moves_by_lr_per_step_under_a_consistent_gradient_and_stops_at_its_bounds():
    lr = 0.01
    temperature = LearnedTemperature(0.07, tau_min=0.01, tau_max=1.0, lr=lr).double()
    for _ in range(100):
        temperature.step(consistent_objective(temperature, slope=-0.3))  # G < 0: τ grows
    assert temperature.log_tau.item() == pytest.approx(math.log(0.07) + 100 * lr, rel=1e-6)
    for _ in range(600):
        temperature.step(consistent_objective(temperature, slope=2.0))  # reversed: τ shrinks, down to its bound
    assert temperature.log_tau.item() == pytest.approx(math.log(0.01), rel=1e-12)
    for _ in range(600):
        temperature.step(consistent_objective(temperature, slope=-2.0))  # and up again, to its upper bound
    assert temperature.log_tau.item() == pytest.approx(math.log(1.0), abs=1e-12)
    fixed = LearnedTemperature(0.07, tau_min=0.01, tau_max=1.0, lr=0.0)  # lr_tau 0: a τ that is never stepped
    tau, _ = fixed(image_features=torch.zeros(4, 2))
    fixed.step(tau.expand(4))
    assert fixed.log_tau.item() == math.log(0.07) and not tau.requires_grad


def test_state_round_trips_and_resumes_bit_exactly():
    n = 16
    g = torch.Generator().manual_seed(7)
    batches = [batch(g, n) for _ in range(4)]
    loss = create_loss('drrho', **OWN_ADAM, num_samples=n, temperature='auto', gamma=0.5, gamma_decay_epochs=1).double()
    loss.set_total_steps(len(batches))  # the default lr_tau 'auto', as a training run sets it
    for epoch, b in enumerate(batches[:2]):
        loss.set_epoch(epoch)
        call(loss, *b)
    saved = {k: v.clone() for k, v in loss.state_dict().items()}
    assert {'temperature.log_tau', 'temperature.exp_avg', 'temperature.exp_avg_sq'} <= set(saved)
    assert not torch.isnan(saved['temperature.log_tau']) and not torch.isnan(saved['temperature.exp_avg'])

    resumed = create_loss('drrho', **OWN_ADAM, num_samples=n, temperature='auto', gamma=0.5, gamma_decay_epochs=1).double()
    assert torch.isnan(resumed.temperature.log_tau)  # 'auto': not chosen yet
    resumed.set_total_steps(len(batches))
    resumed.load_state_dict(saved)
    for copy_ in (loss, resumed):
        for epoch, b in enumerate(batches[2:], start=2):
            copy_.set_epoch(epoch)
            call(copy_, *b)
    # the resumed loss kept the saved τ (not one chosen again from its first batch) and stepped it identically
    for key, value in loss.state_dict().items():
        assert torch.equal(resumed.state_dict()[key].nan_to_num(-1), value.nan_to_num(-1)), key


@pytest.mark.parametrize('name, options, message', [
    ('sogclr', dict(temperature='auto'), 'does not shift by'),
    ('drrho', dict(temperature='auto', temperature_optimizer='model'), 'give the initial τ'),
    ('drrho', dict(temperature='auto', learn_temperature=False), "learn_temperature is off"),  # not learned anyway
    ('drrho-paper', dict(temperature='auto'), "learn_temperature is off"),
    ('drrho', dict(temperature=0.05, lr_tau=0.0, rho=3.0, temperature_optimizer='loss'), 'rho has no effect here (lr_tau 0 never steps τ)'),
    ('drrho', dict(temperature=0.05, lr_tau=0.0, tau_min=0.01, temperature_optimizer='loss'), 'tau_min has no effect here'),
    ('fastclip', dict(lr_tau=0.0, tau_objective='batch'), 'tau_objective has no effect here'),
    ('drrho', dict(temperature=0.01, learn_temperature=False, rho=3.0), 'rho has no effect here'),
    ('drrho', dict(temperature=0.01, learn_temperature=False, lr_tau=0.1), 'lr_tau has no effect here'),
    ('drrho', dict(temperature=0.05, learn_temperature=True, target_negatives=4.0, rho=2.0),
     'target_negatives has no effect here'),
    ('drrho', dict(temperature=0.05, learn_temperature=True, temperature_optimizer='model', tau_min=0.02),
     'tau_min has no effect here'),
    ('isogclr', dict(rho=7.0, target_negatives=4.0), 'target_negatives has no effect here'),
    ('drrho', dict(temperature='hot'), "a number or 'auto'"),
    ('drrho', dict(temperature=-0.1), 'temperature must be > 0'),
    ('drrho', dict(temperature='auto', lr_tau=-1.0, temperature_optimizer='loss'), 'lr_tau must be ≥ 0'),
    ('drrho', dict(lr_tau='fast', temperature_optimizer='loss'), "lr_tau must be a number or 'auto'"),
    ('isogclr', dict(lr_tau='auto'), "the per-sample τ's Adam needs a number"),
    ('drrho', dict(temperature='auto', target_negatives=0.5), 'target_negatives must be ≥ 1'),
    ('drrho', dict(temperature_optimizer='sgd', learn_temperature=True, temperature=0.1), "'loss' or 'model'"),
])
def test_bad_temperature_options_raise(name, options, message):
    with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)')):
        create_loss(name, num_samples=8, **options)


def test_drrho_learns_tau_as_the_models_logit_scale_and_the_papers_fixed_tau_is_one_switch_away():
    spec = get_loss_spec('drrho')
    assert spec.defaults['temperature'] == 0.07 and spec.defaults['learn_temperature']
    assert spec.defaults['temperature_optimizer'] == 'model' and spec.defaults['rho'] == 'auto'
    default = create_loss('drrho', num_samples=4)  # τ = 1/logit_scale, learned as CLIP's, with ρ (from the batch)
    assert type(default.temperature).__name__ == 'LogitScaleTemperature' and default.rho is None
    paper = create_loss('drrho', num_samples=4, learn_temperature=False, temperature=0.01)  # its main fixed τ
    assert type(paper.temperature).__name__ == 'FixedTemperature' and paper.rho == 0.0
    own = create_loss('drrho', num_samples=4, temperature_optimizer='loss')  # App. C.3: its own Adam, from 0.07
    assert type(own.temperature).__name__ == 'LearnedTemperature' and own.rho is None
    assert own.temperature.log_tau.exp().item() == pytest.approx(0.07)
    auto = create_loss('drrho', num_samples=4, temperature_optimizer='loss', temperature='auto')
    assert type(auto.temperature).__name__ == 'LearnedTemperature'
    held = create_loss('drrho', num_samples=4, temperature_optimizer='loss', temperature='auto', lr_tau=0.0,
                       tau_min=0.01)  # chosen, then held
    assert type(held.temperature).__name__ == 'LearnedTemperature' and held.temperature.lr == 0
    assert type(create_loss('fastclip', num_samples=4).temperature).__name__ == 'LearnedTemperature'
    assert type(create_loss('sogclr', num_samples=4).temperature).__name__ == 'FixedTemperature'
    for name in ('isogclr', 'tempnet'):
        assert get_loss_spec(name).defaults['rho'] == 'auto'


def test_a_loss_cast_to_16_bits_keeps_its_learned_state_at_its_precision():
    """`loss.to(torch.bfloat16)` (as a model cast to 16 bits takes its loss along) may not lower the precision of the
    state the loss learns: in bfloat16 log τ's spacing near log 0.07 (0.016) exceeds its steps, and τ froze at
    0.0703 while the uncast loss's moved. `.double()` still raises it (the float64 reference tests' way)."""
    g = torch.Generator().manual_seed(21)
    steps = [tuple(x.detach().bfloat16() for x in batch(g, 16, d=8, ref_d=8)) for _ in range(20)]

    def trained(cast):
        loss = cast(create_loss('drrho', **OWN_ADAM, num_samples=16, gamma=0.5, lr_tau=5e-4))
        for features in steps:
            call(loss, *features)
        return loss
    uncast, cast = trained(lambda loss: loss), trained(lambda loss: loss.to(torch.bfloat16))
    assert {k: v.dtype for k, v in cast.state_dict().items()} == {k: v.dtype for k, v in uncast.state_dict().items()}
    moved = uncast.temperature.log_tau - math.log(0.07)
    assert abs(moved) > 5e-3
    torch.testing.assert_close(cast.temperature.log_tau, uncast.temperature.log_tau)
    for name in ('isogclr', 'fastclip', 'clip'):
        options = dict(distill_weight=0.5) if name == 'clip' else dict(num_samples=16, gamma=0.5)
        loss = create_loss(name, **options)
        dtypes = {k: v.dtype for k, v in loss.state_dict().items()}
        assert {k: v.dtype for k, v in loss.half().state_dict().items()} == dtypes
    assert {v.dtype for v in create_loss('sogclr', num_samples=16, gamma=0.5).double().state_dict().values()} == {
        torch.float64}


@pytest.mark.parametrize('name', ['drrho', 'isogclr'])
def test_a_batch_with_a_non_finite_value_skips_the_temperature_step(name):
    """A broken sample or an fp16 overflow: GradScaler skips the model's step, and τ's own Adam skips its own. Stepped,
    τ (isogclr: each τ_i of the batch) and its moments stayed NaN, and so did every later loss that read them."""
    n = 16
    g = torch.Generator().manual_seed(3)
    batches = [list(batch(g, n)) for _ in range(3)]
    batches[1][0] = batches[1][0].clone()
    batches[1][0][0] = float('nan')
    loss = create_loss(name, **(OWN_ADAM if name == 'drrho' else {}), num_samples=n, gamma=0.5).double()
    loss.set_total_steps(len(batches))
    reference = {} if name == 'drrho' else {'ref_image': None, 'ref_text': None}
    states = []
    for epoch, (image, text, ref_image, ref_text) in enumerate(batches):
        loss.set_epoch(epoch)
        value = call(loss, image, text, **{'ref_image': ref_image, 'ref_text': ref_text, **reference})
        assert torch.isfinite(value) != (epoch == 1)
        states.append({k: v.clone() for k, v in loss.temperature.state_dict().items()})
    for key, before in states[0].items():
        assert torch.isfinite(before).all() and torch.isfinite(states[1][key]).all(), key
        if key.startswith(('log_tau', 'tau_')):  # and learning again
            assert torch.isfinite(states[2][key]).all() and not torch.equal(states[2][key], states[1][key]), key
    # skipped where the NaN reached: the global τ's step; isogclr's image 0 and every text anchor (image 0 is among
    # each text's candidates), where the other images' τ_i stepped
    skipped = {'log_tau': ...} if name == 'drrho' else {'tau_image': slice(0, 1), 'tau_text': slice(None)}
    for key, rows in skipped.items():
        assert torch.equal(states[1][key][rows], states[0][key][rows]), key
    if name == 'isogclr':
        assert (states[1]['tau_image'][1:] != states[0]['tau_image'][1:]).all()
