"""The DRO loss's diagnostics against a float64 computation from their definitions: the effective number of
negatives per anchor, exp(−Σ_{j≠i} p_ij log p_ij) with p_ij the DRO weights over the negatives, and the mean
reference margin s^ref_ii − s^ref_ij, both averaged over the anchors of both directions; the batch's objective, each
direction's mean log u and mean τ."""
import math

import pytest
import torch
import torch.nn.functional as F

from drrho_openclip.losses import create_loss, get_loss_spec

N = 9
F64 = dict(dtype=torch.float64)


def features(seed, n=N, d=6):
    g = torch.Generator().manual_seed(seed)
    image, text = (F.normalize(torch.randn(n, d, generator=g, **F64), dim=1) for _ in range(2))
    ref_image = F.normalize(image + 0.8 * torch.randn(n, d, generator=g, **F64), dim=1)
    ref_text = F.normalize(text + 0.8 * torch.randn(n, d, generator=g, **F64), dim=1)
    return image, text, ref_image, ref_text


def effective_negatives(sim, ref_sim, tau, log_weight=None):
    """Mean over the rows of exp(entropy of the softmax over j ≠ i of ℓ̂_ij/τ [+ log w̄_ij]), explicitly."""
    values = []
    for i in range(sim.shape[0]):
        others = [j for j in range(sim.shape[1]) if j != i]
        ell = torch.stack([(sim[i, j] - sim[i, i]) - (0 if ref_sim is None else ref_sim[i, j] - ref_sim[i, i])
                           for j in others])
        logits = ell / tau
        if log_weight is not None:
            h = torch.stack([log_weight(sim[i, j]) for j in others])
            logits = logits + h - torch.log(h.exp().mean())
        p = torch.softmax(logits, dim=0)
        values.append(torch.exp(-(p * p.log()).sum()))
    return torch.stack(values)


def inner_means(sim, ref_sim, tau):
    """g_i = mean_{j≠i} exp(ℓ̂_ij/τ) of every row, explicitly."""
    n = sim.shape[0]
    shift = torch.zeros_like(sim) if ref_sim is None else ref_sim - ref_sim.diagonal()[:, None]
    ell = sim - sim.diagonal()[:, None] - shift
    return torch.stack([sum(torch.exp(ell[i, j] / tau) for j in range(n) if j != i) / (n - 1) for i in range(n)])


def reference_margin(ref_sim):
    n = ref_sim.shape[0]
    return sum(ref_sim[i, i] - ref_sim[i, j] for i in range(n) for j in range(n) if j != i) / (n * (n - 1))


def gaussian(mu, sigma):
    return lambda s: -0.5 * ((s - mu) / sigma) ** 2


# drrho's default weight α of the reference's shift (from its registration: the documented default, not the loss's
# attribute); adnce has no reference_weight option, so its shift is the full one
DRRHO_ALPHA = get_loss_spec('drrho').defaults['reference_weight']

EPS, RHO = 1e-3, 0.3  # given where a case reads them: the objective's definition below takes them as given

# case: (loss, options, τ, the negatives' log-weight, α of the shift or None where the case does not shift). Whether
# a case shifts is its own definition here, not the loss's flag: a --reference-shift that the loss ignored would
# otherwise be expected to be ignored
CASES = {
    # τ learned by the loss's own Adam (its first call's τ is the given one), on the paper's ε
    'drrho': ('drrho', dict(temperature=0.05, temperature_optimizer='loss', gamma=0.5, epsilon=EPS,
                            positive_in_denominator=False, rho=RHO), 0.05, None, DRRHO_ALPHA),
    'drrho-tiled': ('drrho', dict(temperature=0.05, temperature_optimizer='loss', gamma=0.5, tile_size=4, epsilon=EPS,
                                  positive_in_denominator=False, rho=RHO), 0.05, None, DRRHO_ALPHA),
    'sogclr': ('sogclr', dict(temperature=0.1, epsilon=EPS), 0.1, None, None),  # a fixed τ: no ρ term
    'adnce-shifted-tiled': ('adnce', dict(temperature=0.2, adnce_mu=0.3, adnce_sigma=0.4, reference_shift=True,
                                          tile_size=2), 0.2, gaussian(0.3, 0.4), 1.0),
    # its τ table is float32: the first call's τ is 0.07 rounded to float32
    'isogclr': ('isogclr', dict(temperature=0.07, tau_min=0.01, epsilon=EPS, rho=RHO), torch.tensor(0.07).item(),
                None, None),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_diagnostics_match_their_definitions(case):
    name, options, tau, log_weight, alpha = CASES[case]
    loss = create_loss(name, num_samples=N, **options).double()
    loss.set_total_steps(1)
    image, text, ref_image, ref_text = features(1)
    image.requires_grad_(), text.requires_grad_()
    loss(image, text, index=torch.arange(N), ref_image_features=ref_image, ref_text_features=ref_text)
    metrics = loss.metrics()
    shifted = alpha is not None
    sim = image.detach() @ text.detach().T
    ref_sim = alpha * ref_image @ ref_text.T if shifted else None  # the shift's, α-weighted
    want = torch.cat([effective_negatives(sim, ref_sim, tau, log_weight),
                      effective_negatives(sim.T, None if ref_sim is None else ref_sim.T, tau, log_weight)]).mean()
    assert 1 <= metrics['effective_negatives'] <= N - 1
    assert math.isclose(metrics['effective_negatives'], want.item(), rel_tol=1e-9)
    if shifted:
        assert math.isclose(metrics['reference_margin'], reference_margin(ref_sim).item(), rel_tol=1e-9)
    else:
        assert 'reference_margin' not in metrics
    assert metrics['tau_image_mean'] == metrics['tau_text_mean'] == pytest.approx(tau, rel=1e-12)
    if log_weight is not None:  # ADNCE's g holds the positive in its denominator: its own test (test_losses_reference)
        return
    # the first visit's u is the batch's g (SogCLR), and the objective is the batch's: mean_i τ log(ε + g_i) over
    # both directions, plus ρ·(τ + τ') where ρ is stepped on (a learned τ)
    g_image = inner_means(sim, ref_sim, tau)
    g_text = inner_means(sim.T, None if ref_sim is None else ref_sim.T, tau)
    assert math.isclose(metrics['log_u_image_mean'], g_image.log().mean().item(), rel_tol=1e-9)
    assert math.isclose(metrics['log_u_text_mean'], g_text.log().mean().item(), rel_tol=1e-9)
    rho = options.get('rho', 0.0)
    want = (tau * torch.log(EPS + g_image) + tau * torch.log(EPS + g_text)).mean() + rho * 2 * tau
    assert math.isclose(metrics['objective'], want.item(), rel_tol=1e-9)


def test_per_sample_temperatures_are_reported_per_direction():
    """isogclr's τ_i of image and text anchors part after a step: each direction's mean is of its own table."""
    loss = create_loss('isogclr', num_samples=N, temperature=0.07, tau_min=0.01).double()
    image, text, ref_image, ref_text = features(3)
    for _ in range(2):
        tables = {side: getattr(loss.temperature, f'tau_{side}').clone() for side in ('image', 'text')}
        loss(image.clone().requires_grad_(), text.clone().requires_grad_(), index=torch.arange(N))
    assert not torch.equal(tables['image'], tables['text'])
    for side in ('image', 'text'):
        assert math.isclose(loss.metrics()[f'tau_{side}_mean'], tables[side].double().mean().item(), rel_tol=1e-12)


def test_effective_negatives_span_one_to_all():
    """Uniform weights count every negative; a temperature near 0 concentrates them on the hardest one."""
    image = text = torch.eye(N, 2 * N, **F64)  # every negative equally far from every anchor
    uniform = create_loss('sogclr', temperature=0.5, gamma=1.0).double()
    uniform(image, text)
    assert math.isclose(uniform.metrics()['effective_negatives'], N - 1, rel_tol=1e-12)
    image, text, _, _ = features(2)
    sharp = create_loss('sogclr', temperature=1e-4, gamma=1.0).double()
    sharp(image, text)
    assert math.isclose(sharp.metrics()['effective_negatives'], 1.0, rel_tol=1e-6)
