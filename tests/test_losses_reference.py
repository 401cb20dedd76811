"""Every loss against a float64 reference written from its paper's formulas (not from the package's helpers).

Notation: n anchors (one process, so the global batch), ℓ̂_ij = (s_ij − s_ii) − (s^ref_ij − s^ref_ii), the mean over
the n − 1 candidates j ≠ i. Per-sample tables are float32 in the losses, so values read back from them after a
step agree to float32's precision only.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import without_dropout
from drrho_openclip.losses import create_loss, get_loss_spec

F64 = dict(dtype=torch.float64)
TIGHT = dict(rtol=1e-10, atol=1e-12)
TABLE = dict(rtol=2e-6, atol=1e-7)  # through a float32 table
ALPHA = get_loss_spec('drrho').defaults['reference_weight']  # drrho's default weight of the reference's shift


def unit(g, n, d):
    return F.normalize(torch.randn(n, d, generator=g, **F64), dim=1)


def batch(g, n, d=6, ref_d=4):
    """Features (leaves), and reference features correlated with them (so ℓ̂ is not ℓ with noise)."""
    image, text = unit(g, n, d), unit(g, n, d)
    ref_image = F.normalize(image[:, :ref_d] + 0.5 * unit(g, n, ref_d), dim=1)
    ref_text = F.normalize(text[:, :ref_d] + 0.5 * unit(g, n, ref_d), dim=1)
    return image.requires_grad_(), text.requires_grad_(), ref_image, ref_text


def off_diagonal(n):
    return ~torch.eye(n, dtype=torch.bool)


def shifted_loss(anchors, candidates, ref_anchors=None, ref_candidates=None, alpha=1.0):
    """ℓ̂_ij (seed 001, §4): the pairwise loss minus the reference model's, weighted by α (1 in the paper)."""
    s = anchors @ candidates.T
    ell = s - s.diagonal()[:, None]
    if ref_anchors is not None:
        r = ref_anchors @ ref_candidates.T
        ell = ell - alpha * (r - r.diagonal()[:, None])
    return ell


def inner_mean(ell, tau):
    """g_i = E_{j ∈ B\\{i}} exp(ℓ̂_ij / τ_i) (Eq. 10), τ a number or one per row."""
    tau = torch.as_tensor(tau, **F64).reshape(-1, 1)
    return (torch.exp(ell / tau) * off_diagonal(len(ell))).sum(1) / (len(ell) - 1)


def moving_average(table, index, g, gamma):
    """u_i ← (1−γ) u_i + γ g_i for the batch (Eq. 10); an unvisited sample (NaN) takes g_i."""
    old = table[index]
    table[index] = torch.where(torch.isnan(old), g, (1 - gamma) * old + gamma * g)
    return table[index]


def cosine_gamma(epoch, gamma_min, decay_epochs):
    """FastCLIP's cosine schedule of SogCLR's inner learning rate: γ_e = γ_min + (1 − γ_min)·½(1 + cos(π·min(e/E, 1))),
    so 1 in epoch 0 (u starts at the mini-batch estimate), γ_min from epoch E on."""
    return gamma_min + (1 - gamma_min) * 0.5 * (1 + math.cos(math.pi * min(epoch / decay_epochs, 1.0)))


def pair_weights(ell, tau, u, eps):
    """w_ij = exp(ℓ̂_ij/τ_i) / (ε + u_i), 0 on the positive (detached: Eq. 11's coefficients)."""
    tau = torch.as_tensor(tau, **F64).reshape(-1, 1)
    return (torch.exp(ell / tau) / (eps + u[:, None]) * off_diagonal(len(ell))).detach()


def grads(value, wrt):
    return torch.autograd.grad(value, wrt, allow_unused=True)


def assert_close(got, want, **tol):
    tol = tol or TIGHT
    if isinstance(got, (tuple, list)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)
    else:
        torch.testing.assert_close(got, want, **tol)


# ---------------------------------------------------------------------------------------------------------------
# DRRho-CLIP / SogCLR (seed 001, Eq. 10–11, Algorithm 1) and the learnable τ of Appendix C.3


def sogclr_step(loss, name, g, n, epoch, index, tables, tau, eps, gamma, decay_epochs):
    """One training call of `loss` (drrho or sogclr) on a drawn batch, and the float64 SogCLR reference of its DRO:
    `tables` (u of the images, of the texts; NaN where unvisited) updated as the loss's should be. Returns the
    loss's value, the features, ℓ̂ of both directions, their rows' u, the objective's value and the surrogate whose
    gradient is the estimator's."""
    loss.set_epoch(epoch)
    index = torch.tensor(index)
    image, text, ref_image, ref_text = batch(g, n)
    out = loss(image, text, index=index, ref_image_features=ref_image, ref_text_features=ref_text,
               output_dict=True)['contrastive_loss']
    use_ref = name == 'drrho'
    ell_image = shifted_loss(image, text, *((ref_image, ref_text) if use_ref else ()), alpha=ALPHA)
    ell_text = shifted_loss(text, image, *((ref_text, ref_image) if use_ref else ()), alpha=ALPHA)
    step_gamma = cosine_gamma(epoch, gamma, decay_epochs)
    u1 = moving_average(tables[0], index, inner_mean(ell_image, tau).detach(), step_gamma)
    u2 = moving_average(tables[1], index, inner_mean(ell_text, tau).detach(), step_gamma)
    value = (tau * torch.log(eps + u1) + tau * torch.log(eps + u2)).mean()
    surrogate = (((pair_weights(ell_image, tau, u1, eps) * ell_image).sum(1)
                  + (pair_weights(ell_text, tau, u2, eps) * ell_text).sum(1)) / (n - 1)).mean()
    return out, (image, text), (ell_image, ell_text), (u1, u2), value, surrogate


@pytest.mark.parametrize('decay_epochs', [1, 3])
@pytest.mark.parametrize('name', ['drrho', 'sogclr'])
def test_sogclr_estimator_over_steps(name, decay_epochs):
    """u over several steps with γ < 1 (epoch 0 has γ = 1), the value τ·log(ε + u) per anchor and direction,
    and the gradient E_i Σ_j w_ij ∇ℓ̂_ij / (n−1) over both directions (= Eq. 11's τ/(ε+u_i) ∇ E_j exp(ℓ̂_ij/τ)).
    With 3 decay epochs, γ on its cosine from 1 to γ_min in epochs 1 and 2 (the defaults decay over 16 or 18: a γ
    that jumped to γ_min, or decayed on another schedule, would weigh the revisits' old u wrongly)."""
    num_samples, n, tau, eps, gamma = 14, 5, 0.05, 1e-3, 0.6
    # drrho learns its τ unless told not to; the DRO alone, without drrho's column step (tested below)
    fixed = dict(learn_temperature=False, column_step=False) if name == 'drrho' else {}
    loss = create_loss(name, num_samples=num_samples, temperature=tau, epsilon=eps, positive_in_denominator=False,
                       gamma=gamma, gamma_decay_epochs=decay_epochs, **fixed)
    u_image = torch.full((num_samples,), float('nan'), **F64)
    u_text = u_image.clone()
    g = torch.Generator().manual_seed(1)
    # revisits, and first visits after epoch 0 (10, 11, 12: u takes g despite γ < 1); 13 is never seen; epochs 3
    # and 4 are past a 3-epoch decay (γ = γ_min)
    schedule = [(0, [0, 1, 2, 3, 4]), (0, [5, 6, 7, 8, 9]), (1, [2, 3, 4, 10, 11]), (1, [7, 1, 0, 6, 5]),
                (2, [8, 9, 10, 3, 12]), (2, [0, 2, 4, 6, 11]), (3, [1, 3, 5, 7, 9]), (4, [12, 10, 8, 2, 0])]
    for epoch, index in schedule:
        out, features, _, _, value, surrogate = sogclr_step(loss, name, g, n, epoch, index, (u_image, u_text), tau,
                                                            eps, gamma, decay_epochs)
        assert_close(out, value, **TABLE)
        assert_close(grads(out, features), grads(surrogate, features), **TABLE)
        assert_close(loss.state.log_u_image.double(), torch.log(u_image), equal_nan=True, **TABLE)
        assert_close(loss.state.log_u_text.double(), torch.log(u_text), equal_nan=True, **TABLE)
    assert torch.isnan(loss.state.log_u_image[13])


def column_half_step(ell, tau, u, eps):
    """Each candidate j's column after the anchors' rows: τ log (1/n) Σ_k exp(ℓ̂_kj/τ) / (ε + u_k) over the anchors k,
    the positive k = j included, ε + u_k anchor k's row normaliser (a constant)."""
    return tau * torch.log((torch.exp(ell / tau) / (eps + u.detach()[:, None])).sum(0) / len(ell))


@pytest.mark.parametrize('tile_size', [0, 2])
@pytest.mark.parametrize('name', ['drrho', 'sogclr'])
def test_column_step_over_steps(name, tile_size):
    """--column-step: the DRO's value and SogCLR gradient (as above) plus, per sample j, the image anchors' column of
    its text and the text anchors' column of its image, each row normalised by that anchor's u of this step; over
    steps with γ < 1, so the rows' u are not the batch's g. Dense, and in blocks of 2 rows (the tiled core's)."""
    num_samples, n, tau, eps, gamma = 10, 5, 0.05, 1e-3, 0.6
    fixed = dict(learn_temperature=False) if name == 'drrho' else {}
    loss = create_loss(name, num_samples=num_samples, temperature=tau, epsilon=eps, positive_in_denominator=False,
                       gamma=gamma, gamma_decay_epochs=1, column_step=True, tile_size=tile_size, **fixed)
    u_image = torch.full((num_samples,), float('nan'), **F64)
    u_text = u_image.clone()
    g = torch.Generator().manual_seed(3)
    for epoch, index in [(0, [0, 1, 2, 3, 4]), (1, [2, 3, 4, 5, 6]), (1, [7, 8, 0, 1, 9]), (2, [0, 2, 4, 6, 8])]:
        out, features, (ell_image, ell_text), (u1, u2), rows, rows_surrogate = sogclr_step(
            loss, name, g, n, epoch, index, (u_image, u_text), tau, eps, gamma, 1)
        columns = (column_half_step(ell_image, tau, u1, eps) + column_half_step(ell_text, tau, u2, eps)).mean()

        assert_close(out, rows + columns, **TABLE)
        assert_close(grads(out, features), grads(rows_surrogate + columns, features), **TABLE)
        assert loss.metrics()['column_step'] == pytest.approx(columns.item(), rel=1e-6)


def test_column_step_refuses_what_it_has_no_form_for():
    """Per-sample τ's would mix every anchor's τ in a column, and ADNCE's log-weights are not the DRO's own: those
    losses have no such option, and the core refuses them."""
    from drrho_openclip.losses.adnce import adnce_log_weight
    from drrho_openclip.losses.core import DROContrastiveLoss
    from drrho_openclip.losses.temperatures import FixedTemperature
    for name, run in (('isogclr', dict(num_samples=8)), ('tempnet', dict(num_samples=8, embed_dim=6)), ('adnce', {})):
        with pytest.raises(ValueError, match=f"loss '{name}' has no option column_step"):
            create_loss(name, column_step=True, **run)
    with pytest.raises(ValueError, match="no form with log-weights of the candidates"):
        DROContrastiveLoss(FixedTemperature(0.07), None, negative_log_weight=adnce_log_weight(0.4, 1.0),
                           positive_in_denominator=True, column_step=True)
    per_sample = create_loss('isogclr', num_samples=8, gamma=1.0)
    per_sample.column_step = True
    image, text, _, _ = batch(torch.Generator().manual_seed(0), 4)
    with pytest.raises(ValueError, match="the column step needs a global temperature"):
        per_sample(image.float(), text.float(), index=torch.arange(4))


@pytest.mark.parametrize('name', ['drrho', 'fastclip'])
def test_learnable_temperature_gradient(name):
    """Appendix C.3: min over θ and τ of mean_i τ log(ε + g_i) (both directions) + 2τρ. Its τ-derivative under the
    SogCLR estimator is Σ_dir mean_i [log(ε+u_i) − Σ_j w_ij ℓ̂_ij/τ/(n−1)] + 2ρ; the loss gets τ = 1/logit_scale."""
    num_samples, n, eps, gamma, rho = 9, 6, 1e-3, 0.5, 0.7
    options = dict(num_samples=num_samples, epsilon=eps, positive_in_denominator=False, gamma=gamma,
                   gamma_decay_epochs=1, rho=rho, temperature=0.07, temperature_optimizer='model')
    drrho = dict(learn_temperature=True, column_step=False) if name == 'drrho' else {}  # the DRO alone
    loss = create_loss(name, **drrho, **options)
    u_image = torch.full((num_samples,), float('nan'), **F64)
    u_text = u_image.clone()
    g = torch.Generator().manual_seed(2)
    for epoch in (0, 1, 1):
        loss.set_epoch(epoch)
        index = torch.randperm(num_samples, generator=g)[:n]
        image, text, ref_image, ref_text = batch(g, n)
        logit_scale = torch.tensor(1 / (0.04 + 0.02 * epoch), **F64, requires_grad=True)
        out = loss(image, text, logit_scale, index=index, ref_image_features=ref_image, ref_text_features=ref_text,
                   output_dict=True)['contrastive_loss']

        tau = 1 / logit_scale.detach()
        use_ref = name == 'drrho'
        ell_image = shifted_loss(image, text, *((ref_image, ref_text) if use_ref else ()), alpha=ALPHA).detach()
        ell_text = shifted_loss(text, image, *((ref_text, ref_image) if use_ref else ()), alpha=ALPHA).detach()
        step_gamma = 1.0 if epoch == 0 else gamma
        u1 = moving_average(u_image, index, inner_mean(ell_image, tau), step_gamma)
        u2 = moving_average(u_text, index, inner_mean(ell_text, tau), step_gamma)
        dtau = sum((torch.log(eps + u) - (pair_weights(ell, tau, u, eps) * ell).sum(1) / tau / (n - 1)).mean()
                   for ell, u in ((ell_image, u1), (ell_text, u2))) + 2 * rho
        value = (tau * torch.log(eps + u1) + tau * torch.log(eps + u2)).mean() + 2 * tau * rho
        assert_close(out, value, **TABLE)
        # dL/d logit_scale = dL/dτ · dτ/d logit_scale, τ = 1/logit_scale
        assert_close(grads(out, logit_scale)[0], dtau * -tau ** 2, **TABLE)
        if epoch == 0:  # γ = 1: u = g, the estimator's τ-derivative is the objective's own (autograd on C.3)
            tau_leaf = tau.clone().requires_grad_()
            objective = (tau_leaf * torch.log(eps + inner_mean(ell_image, tau_leaf))
                         + tau_leaf * torch.log(eps + inner_mean(ell_text, tau_leaf))).mean() + 2 * tau_leaf * rho
            assert_close(dtau, grads(objective, tau_leaf)[0])


@pytest.mark.parametrize('tile_size', [0, 4])
@pytest.mark.parametrize('alpha', [0.0, 0.5, 1.7])
def test_reference_weight_scales_the_shift(alpha, tile_size):
    """--reference-weight α: ℓ̂_ij = ℓ_ij − α(s^ref_ij − s^ref_ii). With γ = 1 the loss is the mini-batch objective
    of Appendix C.3, so its value and its gradients in the features and in the learned τ are autograd's on the
    formula; dense and tiled (4 columns of 7) alike."""
    n, eps, rho = 7, 1e-3, 0.7
    loss = create_loss('drrho', gamma=1.0, epsilon=eps, positive_in_denominator=False, rho=rho, temperature=0.07,
                       temperature_optimizer='model', reference_weight=alpha, tile_size=tile_size, column_step=False)
    image, text, ref_image, ref_text = batch(torch.Generator().manual_seed(5), n)
    logit_scale = torch.tensor(1 / 0.05, **F64, requires_grad=True)
    out = loss(image, text, logit_scale, ref_image_features=ref_image, ref_text_features=ref_text)

    tau = 1 / logit_scale
    ell_image = shifted_loss(image, text, ref_image, ref_text, alpha=alpha)
    ell_text = shifted_loss(text, image, ref_text, ref_image, alpha=alpha)
    want = (tau * torch.log(eps + inner_mean(ell_image, tau))
            + tau * torch.log(eps + inner_mean(ell_text, tau))).mean() + 2 * tau * rho
    assert_close(out, want)
    assert_close(grads(out, (image, text, logit_scale)), grads(want, (image, text, logit_scale)))
    paper = create_loss('drrho', gamma=1.0, epsilon=eps, positive_in_denominator=False, rho=rho, temperature=0.07,
                        temperature_optimizer='model', tile_size=tile_size, reference_weight=1.0)(image, text, logit_scale,
                                                                    ref_image_features=ref_image,
                                                                    ref_text_features=ref_text)
    assert not torch.isclose(out, paper)  # α is not silently dropped


@pytest.mark.parametrize('tile_size', [0, 4])
@pytest.mark.parametrize('alpha', [0.0, ALPHA, 1.0])
def test_positive_in_denominator_is_clips_loss_on_the_shifted_logits(alpha, tile_size):
    """--positive-in-denominator: ε = 1/(B − 1), so that with γ = 1 each anchor's τ log(ε + g_i) is τ times CLIP's
    cross-entropy over the logits z_ij = (s_ij − α s^ref_ij)/τ, less log(B − 1): the loss (both directions, summed) is
    2τ (CLIP's loss on z − log(B − 1)), values and gradients in the features and in τ; dense and tiled alike, and the
    same as the number ε = 1/(B − 1) given as --epsilon."""
    n = 7
    options = dict(gamma=1.0, rho=0.0, temperature=0.07, temperature_optimizer='model', reference_weight=alpha,
                   tile_size=tile_size, column_step=False)
    loss = create_loss('drrho', positive_in_denominator=True, **options)
    image, text, ref_image, ref_text = batch(torch.Generator().manual_seed(12), n)
    logit_scale = torch.tensor(1 / 0.05, **F64, requires_grad=True)
    refs = dict(ref_image_features=ref_image, ref_text_features=ref_text)
    out = loss(image, text, logit_scale, **refs)

    tau = 1 / logit_scale
    z = (image @ text.T - alpha * ref_image @ ref_text.T) / tau
    labels = torch.arange(n)
    clip = (F.cross_entropy(z, labels) + F.cross_entropy(z.T, labels)) / 2
    want = 2 * tau * (clip - math.log(n - 1))
    assert_close(out, want)
    assert_close(grads(out, (image, text, logit_scale)), grads(want, (image, text, logit_scale)))
    given = create_loss('drrho', epsilon=1 / (n - 1), positive_in_denominator=False, **options)(image, text, logit_scale, **refs)
    assert_close(out, given)
    with pytest.raises(ValueError, match="epsilon"):  # the ε it replaces is not silently dropped
        create_loss('drrho', positive_in_denominator=True, epsilon=1e-3, **options)


@pytest.mark.parametrize('column_step', [False, True])
def test_distill_weight_is_kds_share_as_in_clip(column_step):
    """λ gives KD the share of the gradient it has in MobileCLIP's (1−λ)·CLIP + λ·KD. With CLIP's estimator (γ = 1,
    ε = 1/(B − 1)), α = 0 and a fixed τ, drrho's rows are 2τ·(CLIP's loss − log(B − 1)), so drrho with λ is
    2τ·(`clip` with λ) up to a constant: the same gradients in the features, times 2τ. The column step adds one
    cross-entropy per direction to the DRO term, and KD's factor follows it (4τ·KD)."""
    n, lam, teacher, tau = 7, 0.5, 30.0, 0.05
    image, text, ref_image, ref_text = batch(torch.Generator().manual_seed(21), n)
    refs = dict(ref_image_features=ref_image, ref_text_features=ref_text)
    options = dict(gamma=1.0, temperature=tau, learn_temperature=False, reference_weight=0.0,
                   distill_weight=lam, reference_logit_scale=teacher)
    logit_scale = torch.tensor(1 / tau, **F64)
    kd = kd_reference(image, text, ref_image, ref_text, logit_scale, teacher)
    out = create_loss('drrho', column_step=column_step, **options)(image, text, logit_scale, output_dict=True, **refs)
    assert_close(out['distill_loss'], lam * (4 if column_step else 2) * tau * kd)
    if column_step:
        return
    mobileclip = create_loss('clip', distill_weight=lam, reference_logit_scale=teacher)(
        image, text, logit_scale, output_dict=True, **refs)
    assert_close(sum(out.values()), 2 * tau * (sum(mobileclip.values()) - (1 - lam) * math.log(n - 1)))
    wrt = (image, text)
    assert_close(grads(sum(out.values()), wrt), [2 * tau * g for g in grads(sum(mobileclip.values()), wrt)])


def test_reference_weight_zero_reads_no_reference():
    """α = 0 is drrho's DRO unshifted (the ablation of the shift): a batch without reference features trains it, the
    same to the bit as with them, and its per-sample u is of the unshifted loss."""
    image, text, ref_image, ref_text = batch(torch.Generator().manual_seed(6), 7)
    index = torch.arange(7)
    results = []
    for reference in ({}, dict(ref_image_features=ref_image, ref_text_features=ref_text)):
        loss = create_loss('drrho', num_samples=7, gamma=0.5, temperature_optimizer='loss', reference_weight=0.0)
        loss.set_total_steps(1)
        features = [f.detach().clone().requires_grad_() for f in (image, text)]
        out = loss(*features, torch.tensor(1.0), index=index, **reference)
        out.backward()
        results.append((out.detach(), *(f.grad for f in features), loss.temperature.log_tau.clone(),
                        *(t.clone() for t in loss.state_dict().values() if t.dim() == 1 and len(t) == 7)))
    assert len(results[0]) > 4  # the u tables were compared too
    for without, with_ in zip(*results):
        assert torch.equal(without, with_)
    assert not create_loss('drrho', num_samples=7, reference_weight=0.0).reference_shift


def test_reference_weight_must_not_be_negative():
    with pytest.raises(ValueError, match='α must be ≥ 0'):
        create_loss('drrho', num_samples=4, reference_weight=-0.5)


def test_fastclip_is_a_registration_over_the_core():
    from drrho_openclip.losses import get_loss_spec
    spec = get_loss_spec('fastclip')
    # ρ from the batch by default (the paper's 8.5 is rho=8.5); τ learned by the loss's own Adam
    assert spec.defaults['learn_temperature'] and spec.defaults['rho'] == 'auto' and spec.defaults['temperature'] == 0.07
    loss = create_loss('fastclip', num_samples=4)
    assert loss.rho is None and loss.target_negatives == 8 and not loss.reference_shift
    assert math.isclose(loss.log_eps, math.log(1e-14))
    assert create_loss('fastclip', num_samples=4, rho=8.5).rho == 8.5


# ---------------------------------------------------------------------------------------------------------------
# Distillation (seed 001, Eq. 12 and 16)


def kd_reference(image, text, ref_image, ref_text, scale, teacher_scale):
    """Eq. 16 with the per-anchor mean and the average of the two directions (the official code's and MobileCLIP's
    normalisation: Eq. 16 as printed, times |B|/2)."""
    n = len(image)
    student = scale * image @ text.T            # s(x_i, y_j)/τ
    teacher = teacher_scale * ref_image @ ref_text.T
    i2t = -(teacher.softmax(1) * student.log_softmax(1)).sum() / n
    t2i = -(teacher.softmax(0) * student.log_softmax(0)).sum() / n  # anchors y_i: softmax over the images x_k
    return (i2t + t2i) / 2


def clip_reference(image, text, scale):
    logits = scale * image @ text.T
    labels = torch.arange(len(image))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_mobileclip_distillation():
    """clip with distill_weight λ: (1−λ)·CLIP + λ·KD (Eq. 12), the teacher at its logit scale."""
    g = torch.Generator().manual_seed(3)
    image, text, ref_image, ref_text = batch(g, 7)
    logit_scale = torch.tensor(14.0, **F64, requires_grad=True)
    lam, teacher = 0.75, 50.0
    out = create_loss('clip', distill_weight=lam, reference_logit_scale=teacher)(
        image, text, logit_scale, ref_image_features=ref_image, ref_text_features=ref_text, index=torch.arange(7),
        output_dict=True)
    want_c = (1 - lam) * clip_reference(image, text, logit_scale)
    want_d = lam * kd_reference(image, text, ref_image, ref_text, logit_scale, teacher)
    assert_close(out['contrastive_loss'], want_c)
    assert_close(out['distill_loss'], want_d)
    wrt = (image, text, logit_scale)
    assert_close(grads(sum(out.values()), wrt), grads(want_c + want_d, wrt))


def test_auto_teacher_scale_minimises_the_references_own_clip_loss():
    """'auto': the t in [1, 100] minimising the reference's CLIP loss on the first batch (a float64 grid search
    here); then kept, saved and restored; and KD with it equals KD given that number."""
    from drrho_openclip.losses.distill import calibrated_logit_scale
    g = torch.Generator().manual_seed(5)
    n = 40
    for noise, expected in ((0.3, None), (0.0, 100.0), (None, 1.0)):
        ref_image = unit(g, n, 8)
        ref_text = ref_image if noise == 0.0 else F.normalize(
            (ref_image if noise else unit(g, n, 8)) + (noise or 0) * torch.randn(n, 8, generator=g, **F64), dim=1)
        if noise == 0.0:  # a perfect reference: orthogonal rows, every positive far above its negatives
            ref_image = ref_text = torch.eye(n, **F64)
        got = calibrated_logit_scale(ref_image, ref_text).item()
        if expected is None:  # in between: the minimum of the convex loss
            grid = torch.logspace(0, 2, 20001, **F64)
            best = grid[torch.stack([clip_reference(ref_image, ref_text, t) for t in grid]).argmin()].item()
            assert 1 < got < 100 and got == pytest.approx(best, rel=1e-3)
        else:  # the reference's positives always win (the upper bound), or it is no better than chance
            assert got == pytest.approx(expected, rel=1e-6)

    image, text, ref_image, ref_text = batch(g, 7)
    logit_scale = torch.tensor(14.0, **F64)
    auto = create_loss('clip', distill_weight=0.5)
    call = lambda loss: loss(image, text, logit_scale, ref_image_features=ref_image,  # noqa: E731
                             ref_text_features=ref_text, output_dict=True)
    first = call(auto)
    chosen = auto.teacher_logit_scale.value.item()
    assert chosen == pytest.approx(calibrated_logit_scale(ref_image, ref_text).item())
    given = create_loss('clip', distill_weight=0.5, reference_logit_scale=chosen)
    for key, value in call(given).items():
        assert_close(first[key], value)
    other = batch(g, 7)
    auto(other[0], other[1], logit_scale, ref_image_features=other[2], ref_text_features=other[3])
    assert auto.teacher_logit_scale.value.item() == chosen  # kept: not chosen again from a later batch
    resumed = create_loss('clip', distill_weight=0.5)
    resumed.load_state_dict(auto.state_dict())
    resumed(other[0], other[1], logit_scale, ref_image_features=other[2], ref_text_features=other[3])
    assert resumed.teacher_logit_scale.value.item() == chosen
    assert 'teacher_logit_scale.value' not in given.state_dict()  # a given number is configuration, not state


@pytest.mark.parametrize('name', ['fastclip', 'drrho'])
def test_dro_distillation(name):
    """fastclip / drrho with λ: (1−λ)·(their DRO loss) + λ·2τ·KD with the student at logit scale 1/τ (2: the DRO loss
    sums its two directions' τ-scaled cross-entropies, KD averages them); fastclip's contrastive part is not shifted
    by the reference (the official fork's leak)."""
    n, eps, lam, teacher = 6, 1e-4, 0.25, 100.0
    g = torch.Generator().manual_seed(4)
    image, text, ref_image, ref_text = batch(g, n)
    learn = name == 'fastclip'
    logit_scale = torch.tensor(1 / 0.05, **F64, requires_grad=True)
    options = dict(gamma=1.0, epsilon=eps, positive_in_denominator=False, distill_weight=lam,
                   reference_logit_scale=teacher)
    # the paper's settings: fastclip's τ the model's logit_scale with ρ 8.5, drrho's τ fixed at 0.01, no column step
    options.update(dict(temperature_optimizer='model', rho=8.5) if learn else dict(temperature=0.01,
                                                                                   learn_temperature=False,
                                                                                   column_step=False))
    out = create_loss(name, **options)(image, text, logit_scale, ref_image_features=ref_image,
                                       ref_text_features=ref_text, output_dict=True)

    tau = 1 / logit_scale if learn else torch.tensor(0.01, **F64)
    rho = 8.5 if learn else 0.0
    ref = (ref_image, ref_text) if name == 'drrho' else ()
    ref_t = (ref_text, ref_image) if name == 'drrho' else ()
    ell_image, ell_text = shifted_loss(image, text, *ref, alpha=ALPHA), shifted_loss(text, image, *ref_t, alpha=ALPHA)
    dro = (tau * torch.log(eps + inner_mean(ell_image, tau))
           + tau * torch.log(eps + inner_mean(ell_text, tau))).mean() + 2 * tau * rho
    want_c = (1 - lam) * dro
    want_d = lam * 2 * tau.detach() * kd_reference(image, text, ref_image, ref_text, 1 / tau, teacher)
    assert_close(out['contrastive_loss'], want_c)
    assert_close(out['distill_loss'], want_d)
    # γ = 1: the DRO gradient is the objective's own, so autograd on the formula is the reference
    wrt = (image, text, logit_scale) if learn else (image, text)
    assert_close(grads(sum(out.values()), wrt), grads(want_c + want_d, wrt))


# ---------------------------------------------------------------------------------------------------------------
# iSogCLR / FastCLIP-v2: per-sample τ_i with a per-sample Adam


def test_isogclr_tables_over_steps():
    num_samples, n, eps, gamma, rho = 10, 5, 1e-3, 0.5, 1.0
    tau0, tau_min, tau_max, lr, beta1, beta2, adam_eps = 0.05, 0.035, 0.07, 0.01, 0.9, 0.999, 1e-8
    loss = create_loss('isogclr', num_samples=num_samples, epsilon=eps, gamma=gamma, gamma_decay_epochs=1, rho=rho,
                       temperature=tau0, tau_min=tau_min, tau_max=tau_max, lr_tau=lr, tau_beta1=beta1,
                       tau_beta2=beta2, tau_eps=adam_eps)
    tables = {k: torch.full((num_samples,), float('nan'), **F64)
              for k in ('u_image', 'u_text', 'm_image', 'm_text', 'v_image', 'v_text')}
    tables['tau_image'] = torch.full((num_samples,), tau0, **F64)
    tables['tau_text'] = tables['tau_image'].clone()
    g = torch.Generator().manual_seed(5)
    clamped = set()
    for epoch in (0, 0, 1, 1, 1, 2):
        loss.set_epoch(epoch)
        index = torch.randperm(num_samples, generator=g)[:n]
        image, text, _, _ = batch(g, n)
        out = loss(image, text, index=index, output_dict=True)['contrastive_loss']

        step_gamma = 1.0 if epoch == 0 else gamma
        value, surrogate = 0, 0
        for side, ell in (('image', shifted_loss(image, text)), ('text', shifted_loss(text, image))):
            tau = tables[f'tau_{side}'][index].clone()
            u = moving_average(tables[f'u_{side}'], index, inner_mean(ell, tau).detach(), step_gamma)
            w = pair_weights(ell, tau, u, eps)
            value = value + (tau * torch.log(eps + u) + rho * tau).mean()
            surrogate = surrogate + ((w * ell).sum(1) / (n - 1)).mean()  # ∇_θ τ_i log(ε+g_i) → Σ_j w_ij ∇ℓ̂_ij
            # G_i = ∂F_i/∂τ_i, then Adam with the square root, clipped to [τ_min, τ_max]
            G = torch.log(eps + u) - (w * ell.detach()).sum(1) / tau / (n - 1) + rho
            m_old, v_old = tables[f'm_{side}'][index], tables[f'v_{side}'][index]
            m = torch.where(torch.isnan(m_old), G, beta1 * m_old + (1 - beta1) * G)
            v = torch.where(torch.isnan(v_old), G ** 2, beta2 * v_old + (1 - beta2) * G ** 2)
            new_tau = tau - lr * m / (torch.sqrt(v) + adam_eps)
            clamped |= {'low' for t in new_tau if t < tau_min} | {'high' for t in new_tau if t > tau_max}
            tables[f'm_{side}'][index], tables[f'v_{side}'][index] = m, v
            tables[f'tau_{side}'][index] = new_tau.clamp(tau_min, tau_max)

        assert_close(out, value, **TABLE)
        assert_close(grads(out, (image, text)), grads(surrogate, (image, text)), **TABLE)
        temperature = loss.temperature
        for side in ('image', 'text'):
            assert_close(getattr(temperature, f'tau_{side}').double(), tables[f'tau_{side}'], **TABLE)
            assert_close(getattr(temperature, f'exp_avg_{side}').double(), tables[f'm_{side}'], equal_nan=True,
                         **TABLE)
            assert_close(getattr(temperature, f'exp_avg_sq_{side}').double(), tables[f'v_{side}'], equal_nan=True,
                         rtol=1e-5, atol=1e-7)
            assert_close(getattr(loss.state, f'log_u_{side}').double(), torch.log(tables[f'u_{side}']),
                         equal_nan=True, **TABLE)
    assert clamped == {'low', 'high'}, "the schedule should hit both bounds"


# ---------------------------------------------------------------------------------------------------------------
# ADNCE (adnce.md §1.10, §5)


def adnce_reference(image, text, tau, mu, sigma, ref_image=None, ref_text=None):
    """CLIP-ADNCE, the recommended variant: per anchor −s_ii/τ + log(e^{s_ii/τ} + Σ_{j≠i} w̄_ij e^{s_ij/τ}) with
    w̄ the detached Gaussian weights of the cosine, mean 1 over the anchor's negatives; ½ of both directions.
    With reference features (--reference-shift, α = 1) the logits are the shifted similarities s_ij − s^ref_ij, so
    that every term is e^{ℓ̂_ij/τ} relative to the positive's, while w̄ stays the Gaussian of the raw cosine s_ij (the
    hardness ADNCE re-weights by is the learner's own, adnce.py)."""
    n = len(image)
    S = image @ text.T
    R = ref_image @ ref_text.T if ref_image is not None else torch.zeros_like(S)
    off = off_diagonal(n)
    total = 0
    for sim, ref in ((S, R), (S.T, R.T)):
        w = torch.exp(-(sim.detach() - mu) ** 2 / (2 * sigma ** 2)) * off
        w_bar = (n - 1) * w / w.sum(1, keepdim=True)
        logits = sim - ref
        pos = logits.diagonal()
        total = total + (-pos / tau + torch.log(torch.exp(pos / tau) + (w_bar * torch.exp(logits / tau)).sum(1))).mean()
    return total / 2


@pytest.mark.parametrize('with_ref', [False, True])
@pytest.mark.parametrize('sigma', [0.2, 1.0, 1e6])
def test_adnce(sigma, with_ref):
    """Through the core, with ε = 1/(n−1) standing for the positive: 2τ (L_ADNCE − log(n−1)); σ → ∞ is CLIP.
    With --reference-shift (ADNCE has no reference_weight option: α = 1), the same over ℓ̂_ij; the reference
    features are passed either way, and without the shift must not be read."""
    n, tau, mu = 7, 0.1, 0.3
    g = torch.Generator().manual_seed(6)
    image, text, ref_image, ref_text = batch(g, n)
    loss = create_loss('adnce', temperature=tau, adnce_mu=mu, adnce_sigma=sigma, reference_shift=with_ref)
    out = loss(image, text, ref_image_features=ref_image, ref_text_features=ref_text, output_dict=True)
    refs = (ref_image, ref_text) if with_ref else ()
    want = 2 * tau * (adnce_reference(image, text, tau, mu, sigma, *refs) - math.log(n - 1))
    assert_close(out['contrastive_loss'], want)
    assert_close(grads(out['contrastive_loss'], (image, text)), grads(want, (image, text)))
    if with_ref:  # the shift matters at these features
        unshifted = 2 * tau * (adnce_reference(image, text, tau, mu, sigma) - math.log(n - 1))
        assert abs(want.item() - unshifted.item()) > 1e-4
        return
    if sigma == 1e6:
        assert_close(want, 2 * tau * (clip_reference(image, text, 1 / tau) - math.log(n - 1)), rtol=1e-9, atol=1e-9)
    else:  # the weights matter
        plain = 2 * tau * (clip_reference(image, text, 1 / tau) - math.log(n - 1))
        assert abs(want.item() - plain.item()) > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# TempNet (tempnet.md §2.2, §3.1)


def tempnet_reference(net, e, mask=1.0):
    """τ = τ_min + (τ_max − τ_min) σ(Σ_j a_j (ω_j − 1/M) σ(ŝ_j) + c), ŝ = P̄ x, x = σ(W e + b) · the dropout mask,
    ω = softmax(ŝ/exp κ)."""
    x = torch.sigmoid(e @ net.transform.weight.T + net.transform.bias) * mask
    P = net.prototypes / net.prototypes.norm(dim=1, keepdim=True)
    s_hat = x @ P.T
    omega = torch.softmax(s_hat / torch.exp(net.log_pool_temperature), dim=1)
    z = ((omega - 1 / P.shape[0]) * torch.sigmoid(s_hat) * net.pool.weight[0]).sum(1) + net.pool.bias[0]
    return net.tau_min + (net.tau_max - net.tau_min) * torch.sigmoid(z)


def test_tempnet_dropout_is_keyed_by_sample_and_epoch():
    """TempNet's dropout (rate p, the kept units scaled by 1/(1−p)) draws each sample's mask from its index and the
    epoch: the same sample gets the same mask in any batch, order or rank, and another one the next epoch. The loss
    applies it to each direction's σ(W e + b) while it trains, keyed by the batch's index and, for the image and
    the text network, 2·epoch and 2·epoch + 1 (the two networks' masks differ)."""
    from drrho_openclip.losses.temperatures import sample_keyed_dropout
    p, n, units = 0.5, 512, 64
    ones = torch.ones(n, units, **F64)
    index = torch.arange(n) * 3 + 11
    masked = sample_keyed_dropout(ones, index, 0, p)
    assert set(masked.unique().tolist()) == {0.0, 1 / (1 - p)}
    assert abs((masked == 0).double().mean().item() - p) < 0.02  # 32768 draws: a standard deviation of 0.003
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_keyed_dropout(ones[order], index[order], 0, p), masked[order])
    assert torch.equal(sample_keyed_dropout(ones[:5], index[:5], 0, p), masked[:5])
    next_epoch = sample_keyed_dropout(ones, index, 1, p)
    assert abs((next_epoch != masked).double().mean().item() - 2 * p * (1 - p)) < 0.02  # independent masks
    num_samples, b, d, width = 9, 6, 6, 8
    loss = create_loss('tempnet', num_samples=num_samples, embed_dim=d, gamma=0.8, tempnet_width=width,
                       tempnet_prototypes=5, tau_min=0.02, tau_max=0.2).double()
    loss.set_epoch(3)
    image, text, _, _ = batch(torch.Generator().manual_seed(4), b, d)
    batch_index = torch.tensor([8, 1, 5, 0, 3, 7])
    loss(image, text, index=batch_index)
    for side, anchors, key in (('image', image, 6), ('text', text, 7)):
        net = getattr(loss.temperature, side)
        mask = sample_keyed_dropout(torch.ones(b, width, **F64), batch_index, key, net.dropout)
        assert loss.metrics()[f'tau_{side}_mean'] == pytest.approx(
            tempnet_reference(net, anchors.detach(), mask).mean().item(), rel=1e-12)
        assert abs(tempnet_reference(net, anchors.detach()).mean().item() - loss.metrics()[f'tau_{side}_mean']) > 1e-6


@pytest.mark.parametrize('shift', [False, True])
def test_tempnet_over_steps(shift):
    """The backbone gets L_clip = Σ_dir mean_i Σ_j sg(W_ij) ℓ̂_ij/(n−1); TempNet gets L_temp = Σ_dir mean_i sg(G_i) τ_i
    with G_i = log(ε+u_i) + ρ − Σ_j W_ij ℓ̂_ij/τ_i/(n−1) (tempnet.md §3.1, in the core's ε convention). With
    --reference-shift, ℓ̂_ij = (s_ij − s_ii) − (s^ref_ij − s^ref_ii): tempnet has no reference_weight option, so its
    shift is the paper's full one (α = 1), in the pair weights, u and TempNet's G alike."""
    num_samples, n, d, eps, gamma, rho = 9, 6, 6, 1e-6, 0.8, 2.0
    loss = create_loss('tempnet', num_samples=num_samples, embed_dim=d, epsilon=eps, gamma=gamma, rho=rho,
                       tempnet_width=8, tempnet_prototypes=5, tau_min=0.02, tau_max=0.2,
                       reference_shift=shift).double()
    without_dropout(loss)
    nets = loss.temperature
    params = list(nets.parameters())
    u_tables = {side: torch.full((num_samples,), float('nan'), **F64) for side in ('image', 'text')}
    g = torch.Generator().manual_seed(7)
    for epoch in (0, 1, 1):
        loss.set_epoch(epoch)
        index = torch.randperm(num_samples, generator=g)[:n]
        image, text, ref_image, ref_text = batch(g, n, d)
        # the reference features are passed either way: without the shift the loss must not read them
        out = loss(image, text, index=index, ref_image_features=ref_image, ref_text_features=ref_text,
                   output_dict=True)['contrastive_loss']

        step_gamma = 1.0 if epoch == 0 else gamma
        refs = ((ref_image, ref_text), (ref_text, ref_image)) if shift else ((), ())
        value, l_clip, l_temp = 0, 0, 0
        for side, net, anchors, ell in (('image', nets.image, image, shifted_loss(image, text, *refs[0], alpha=1.0)),
                                        ('text', nets.text, text, shifted_loss(text, image, *refs[1], alpha=1.0))):
            tau = tempnet_reference(net, anchors.detach())
            u = moving_average(u_tables[side], index, inner_mean(ell, tau).detach(), step_gamma)
            W = pair_weights(ell, tau.detach(), u, eps)
            G = (torch.log(eps + u) + rho - (W * ell).sum(1) / tau / (n - 1)).detach()
            value = value + (tau * torch.log(eps + u) + rho * tau).mean()
            l_clip = l_clip + ((W * ell).sum(1) / (n - 1)).mean()
            l_temp = l_temp + (G * tau).mean()
        assert_close(out, value, **TABLE)
        # l_clip reaches only the features, l_temp only TempNet (stop-gradients), so their sum is the reference
        wrt = (image, text, *params)
        assert_close(grads(out, wrt), grads(l_clip + l_temp, wrt), **TABLE)
        assert grads(l_clip, params)[0] is None and grads(l_temp, (image,))[0] is None


def test_tempnet_architecture():
    from drrho_openclip.losses.temperatures import TempNet
    net = TempNet(256, tau_min=0.005, tau_max=0.05)  # the paper's bounds
    assert sum(p.numel() for p in net.parameters()) == 131_586  # the paper's "0.13M"
    e = F.normalize(torch.randn(512, 256), dim=1)
    tau = net.eval()(e)
    assert (tau >= 0.005).all() and (tau <= 0.05).all() and abs(tau.mean().item() - 0.03) < 0.01
    with torch.no_grad():
        net.pool.weight.fill_(1e4)
        net.pool.bias.fill_(-1e4)
    tau = net(1e3 * e)
    assert torch.isfinite(tau).all() and (tau >= 0.005).all() and (tau <= 0.05).all()


# ---------------------------------------------------------------------------------------------------------------
# Balanced CLIP loss (balancing.md §1.4, §4.1)


def balanced_reference(image, text, scale, k, ref_image=None, ref_text=None):
    sim = image @ text.T
    if ref_image is not None:
        sim = sim - ref_image @ ref_text.T
    A = B = scale * sim
    for t in range(1, k + 1):
        A = torch.log_softmax(A, dim=1 if t % 2 else 0)   # P: images' rows first
        B = torch.log_softmax(B, dim=0 if t % 2 else 1)   # Q: texts' columns first
    return -(A.diagonal() + B.diagonal()).mean() / 2


@pytest.mark.parametrize('with_ref', [False, True])
@pytest.mark.parametrize('k', [1, 2, 3])
def test_balanced(k, with_ref):
    g = torch.Generator().manual_seed(8 + k)
    image, text, ref_image, ref_text = batch(g, 7)
    logit_scale = torch.tensor(9.0, **F64, requires_grad=True)
    loss = create_loss('balanced', balance_steps=k, reference_shift=with_ref)
    out = loss(image, text, logit_scale, ref_image_features=ref_image, ref_text_features=ref_text,
               output_dict=True)['contrastive_loss']
    refs = (ref_image, ref_text) if with_ref else ()
    want = balanced_reference(image, text, logit_scale, k, *refs)
    assert_close(out, want)
    wrt = (image, text, logit_scale)
    assert_close(grads(out, wrt), grads(want, wrt))
    assert math.isclose(loss.metrics()['clip_loss'], balanced_reference(image, text, logit_scale, 1, *refs).item(),
                        rel_tol=1e-9)
    if k == 1 and not with_ref:
        from open_clip.loss import ClipLoss
        assert_close(out, ClipLoss()(image, text, logit_scale))


@pytest.mark.parametrize('with_ref', [False, True])
def test_balanced_distillation(with_ref):
    """balanced with distill_weight λ: (1−λ)·L^(k) + λ·KD, the student at the loss's scale, the teacher at its own."""
    g = torch.Generator().manual_seed(21)
    image, text, ref_image, ref_text = batch(g, 7)
    logit_scale = torch.tensor(11.0, **F64, requires_grad=True)
    lam, teacher = 0.4, 30.0
    out = create_loss('balanced', balance_steps=2, reference_shift=with_ref, distill_weight=lam,
                      reference_logit_scale=teacher)(image, text, logit_scale, ref_image_features=ref_image,
                                                     ref_text_features=ref_text, output_dict=True)
    refs = (ref_image, ref_text) if with_ref else ()
    want_c = (1 - lam) * balanced_reference(image, text, logit_scale, 2, *refs)
    want_d = lam * kd_reference(image, text, ref_image, ref_text, logit_scale, teacher)
    assert_close(out['contrastive_loss'], want_c)
    assert_close(out['distill_loss'], want_d)
    wrt = (image, text, logit_scale)
    assert_close(grads(sum(out.values()), wrt), grads(want_c + want_d, wrt))


@pytest.mark.parametrize('k', [2, 3])
def test_balanced_in_float32_at_a_large_batch(k):
    """Float32 at batch 2048: the value and every gradient within 1e-5 of float64, the temperature's too (a sum of
    b×N products, which a float32 dot product rounds about 30 times more than a tree-summed reduction)."""
    g = torch.Generator().manual_seed(k)
    image, text = (F.normalize(torch.randn(2048, 64, generator=g, **F64), dim=1) for _ in range(2))
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [image.to(dtype).requires_grad_(), text.to(dtype).requires_grad_(),
                  torch.tensor(20.0, dtype=dtype, requires_grad=True)]
        out = create_loss('balanced', balance_steps=k)(*leaves)
        results.append([t.double() for t in (out, *torch.autograd.grad(out, leaves))])
    for got, want in zip(results[1], results[0]):
        assert ((got - want).norm() / want.norm()).item() < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# JEST (seed 001 §6.2, C.2)


def jest_reference(ranks, s, t, ratio, chunks, topk, noises):
    """Per-rank draws, conditioned on the global selection so far. Learnability of candidate i given S:
    chunk 1: d_i = t s^ref_ii − s s_ii; later: ½ Σ_dir [(−L_ii + lse_{j∈S} L_ij) − (−R_ii + lse_{j∈S} R_ij)].
    A draw without replacement ∝ exp(score) is the top of score + Gumbel noise (noises[rank](chunk): the b draws of
    that rank's chunk; that they are Gumbel is test_jest_first_chunk_draws_by_softmax's)."""
    b = len(ranks[0][0])
    n_select = round(b * ratio)
    sizes = [len(c) for c in torch.arange(n_select).tensor_split(chunks)]
    selected = [[] for _ in ranks]
    for chunk, size in enumerate(sizes):
        S = [(r, i) for r in range(len(ranks)) for i in selected[r]]
        for r, (image, text, ref_image, ref_text) in enumerate(ranks):
            scores = torch.empty(b, **F64)
            for i in range(b):
                L_ii, R_ii = s * image[i] @ text[i], t * ref_image[i] @ ref_text[i]
                score = R_ii - L_ii
                if chunk > 0:
                    def lse(scale, anchor, column):  # log Σ_{j∈S} exp(scale · anchor · feature_j)
                        return torch.logsumexp(torch.stack([scale * anchor @ ranks[q][column][j] for q, j in S]), 0)
                    score = score + 0.5 * ((lse(s, image[i], 1) - lse(t, ref_image[i], 3))
                                           + (lse(s, text[i], 0) - lse(t, ref_text[i], 2)))
                scores[i] = -math.inf if i in selected[r] else score
            if chunk == 0 or not topk:
                scores = scores + noises[r](chunk)
            selected[r] += scores.topk(size).indices.tolist()
    return selected


@pytest.mark.parametrize('name, chunks', [('jest', 1), ('jest', 2), ('jest', 3), ('jest-topk', 2), ('jest-topk', 3)])
def test_jest_selection_and_loss(name, chunks):  # jest-topk with one chunk is jest, and refused
    n, ratio, teacher = 20, 0.3, 100.0
    g = torch.Generator().manual_seed(9)
    image, text, ref_image, ref_text = batch(g, n)
    logit_scale = torch.tensor(20.0, **F64, requires_grad=True)
    loss = create_loss(name, selection_ratio=ratio, num_chunks=chunks, reference_logit_scale=teacher)
    twin = create_loss(name, selection_ratio=ratio, num_chunks=chunks, reference_logit_scale=teacher)
    want_rows = jest_reference([(image.detach(), text.detach(), ref_image, ref_text)], 20.0, teacher, ratio, chunks,
                               name == 'jest-topk', [lambda chunk: twin._gumbel(torch.zeros(n, **F64), chunk)])[0]
    assert len(want_rows) == 6
    assert loss.select(image, text, logit_scale, ref_image, ref_text).tolist() == want_rows
    loss.selections.zero_()  # the loss's own call draws the same noise again
    out = loss(image, text, logit_scale, ref_image_features=ref_image, ref_text_features=ref_text,
               output_dict=True)['contrastive_loss']
    want = clip_reference(image[want_rows], text[want_rows], logit_scale)
    assert_close(out, want)
    wrt = (image, text, logit_scale)
    assert_close(grads(out, wrt), grads(want, wrt))
    metrics = loss.metrics()
    assert metrics['selection_rate'] == pytest.approx(0.3)
    assert metrics['extra_forward_fraction'] == pytest.approx(20 / 6 - 1)


def test_jest_first_chunk_draws_by_softmax():
    """The first chunk is drawn without replacement ∝ exp(d_i) (the official code used d_i − min d)."""
    n, draws = 6, 4000
    g = torch.Generator().manual_seed(11)
    image, text, ref_image, ref_text = (x.detach() for x in batch(g, n))
    loss = create_loss('jest', selection_ratio=2 / n, num_chunks=1, reference_logit_scale=3.0)  # new noise per call
    d = 3.0 * (ref_image * ref_text).sum(1) - 2.0 * (image * text).sum(1)
    p = torch.softmax(d, 0)
    # P(i among 2 draws without replacement) = p_i + Σ_{j≠i} p_j p_i / (1 − p_j)
    inclusion = p + torch.stack([sum(p[j] * p[i] / (1 - p[j]) for j in range(n) if j != i) for i in range(n)])
    counts = torch.zeros(n, **F64)
    for _ in range(draws):
        counts[loss.select(image, text, 2.0, ref_image, ref_text)] += 1
    assert (counts / draws - inclusion).abs().max() < 0.03
    linear = (d - d.min()) / (d - d.min()).sum()
    linear_inclusion = linear + torch.stack([sum(linear[j] * linear[i] / (1 - linear[j]) for j in range(n) if j != i)
                                             for i in range(n)])
    assert (inclusion - linear_inclusion).abs().max() > 0.1  # the test tells the two apart


def test_jest_refuses_a_super_batch_beyond_the_rows_its_draws_are_keyed_by():
    loss = create_loss('jest')
    assert sum(loss.chunk_sizes(1 << 24)) == round((1 << 24) * 0.2)
    with pytest.raises(ValueError, match=r"JEST draws among at most 16777216 rows per rank, got a super-batch of "
                                         r"16777217"):
        loss.chunk_sizes((1 << 24) + 1)


def test_jest_resumes_its_draws_exactly_whatever_the_global_rng():
    """OpenCLIP reseeds torch's global RNG at every start: JEST's noise is keyed by its checkpointed count of
    selections (and the run's seed and rank), so a resumed loss selects as the uninterrupted one does, instead of
    replaying the draws of the run's first steps."""
    g = torch.Generator().manual_seed(13)
    batches = [tuple(x.detach() for x in batch(g, 40)) for _ in range(4)]
    options = dict(selection_ratio=0.25, num_chunks=2, reference_logit_scale=1.0)  # scales at which the noise counts

    def selections(loss, steps):
        return [loss.select(image, text, 1.0, ref_image, ref_text).tolist()
                for image, text, ref_image, ref_text in steps]

    torch.manual_seed(0)
    uninterrupted = create_loss('jest', seed=5, **options)
    selections(uninterrupted, batches[:2])
    state = {key: value.clone() for key, value in uninterrupted.state_dict().items()}  # as a checkpoint holds it
    later = selections(uninterrupted, batches[2:])
    torch.manual_seed(0)  # the restart's
    resumed = create_loss('jest', seed=5, **options)
    resumed.load_state_dict(state)
    assert selections(resumed, batches[2:]) == later

    def first_noise(**run):
        return create_loss('jest', **options, **run)._gumbel(torch.zeros(40, **F64), 0)
    noise = first_noise(seed=5)
    assert torch.equal(noise, first_noise(seed=5))
    for other in (first_noise(seed=6), first_noise(seed=5, rank=1), create_loss('jest', seed=5, **options)._gumbel(
            torch.zeros(40, **F64), 1)):
        assert not torch.isclose(noise, other).any()  # another run, rank or chunk: other draws


@pytest.mark.parametrize('name', ['drrho', 'drrho-column', 'sogclr', 'isogclr'])
def test_eval_mode_is_the_batch_objective(name):
    """In eval mode the value is the mini-batch objective of the current τ, mean_i τ_i log(ε + g_i) over both
    directions plus ρ(τ_image + τ_text), whatever u holds: here after training steps that set u and moved τ. With
    drrho's column step (its default), plus the columns with the batch's own g as the rows' normalisers."""
    num_samples, n, eps = 24, 12, 1e-3
    columns = name == 'drrho-column'
    name = 'drrho' if columns else name
    drrho = dict(column_step=columns, temperature_optimizer='loss') if name == 'drrho' else {}  # τ its own Adam's
    loss = create_loss(name, num_samples=num_samples, epsilon=eps, positive_in_denominator=False, gamma=0.5,
                       gamma_decay_epochs=1, **drrho)
    if hasattr(loss, 'set_total_steps'):
        loss.set_total_steps(4)
    g = torch.Generator().manual_seed(5)
    for epoch in (0, 1, 1):
        loss.set_epoch(epoch)
        image, text, ref_image, ref_text = batch(g, n)
        index = torch.randperm(num_samples, generator=g)[:n]
        loss(image, text, index=index, ref_image_features=ref_image, ref_text_features=ref_text)
    image, text, ref_image, ref_text = (x.detach() for x in batch(g, n))
    index = torch.randperm(num_samples, generator=g)[:n]  # per-sample τ reads its rows; u is not read
    loss.eval()
    with torch.no_grad():
        out = loss(image, text, index=index, ref_image_features=ref_image, ref_text_features=ref_text)

    if name == 'isogclr':
        tau_image, tau_text = loss.temperature.tau_image[index].double(), loss.temperature.tau_text[index].double()
    elif name == 'drrho':
        tau_image = tau_text = loss.temperature.log_tau.exp()
    else:
        tau_image = tau_text = torch.tensor(get_loss_spec(name).defaults['temperature'], **F64)
    use_ref = name == 'drrho'
    ell_image = shifted_loss(image, text, *((ref_image, ref_text) if use_ref else ()), alpha=ALPHA)
    ell_text = shifted_loss(text, image, *((ref_text, ref_image) if use_ref else ()), alpha=ALPHA)
    rho = loss.rho if loss.rho is not None else math.log((n - 1) / loss.target_negatives)
    g_image, g_text = inner_mean(ell_image, tau_image), inner_mean(ell_text, tau_text)
    value = (tau_image * torch.log(eps + g_image) + tau_text * torch.log(eps + g_text)
             + rho * (tau_image + tau_text)).mean()
    if columns:
        value = value + (column_half_step(ell_image, tau_image, g_image, eps)
                         + column_half_step(ell_text, tau_text, g_text, eps)).mean()
    assert_close(out, value, **TABLE)
