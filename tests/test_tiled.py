"""The tiled row aggregation equals the core's untiled one: values, gradients, and the DRO loss built on it."""
import functools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from drrho_openclip.losses import create_loss
from drrho_openclip.losses.dense import dense_aggregate, log_mean_exp_rows
from drrho_openclip.losses.tiled import (
    DEFAULT_TILE_SIZE, RowNormalizedLogWeight, make_tiled_aggregate, tiled_log_mean_exp_rows)

B_ANCHORS, B_CANDIDATES, DIM, REF_DIM = 6, 17, 5, 4   # 17 is prime: only 1 and 17 divide it
TILE_SIZES = [1, 3, 7, B_CANDIDATES, B_CANDIDATES + 5]
OFFSETS = [0, 5, B_CANDIDATES - B_ANCHORS]          # the positive block at the start, straddling tiles, at the end


def tiled_rows(tile_size):
    return functools.partial(tiled_log_mean_exp_rows, tile_size=tile_size)


def _inputs(seed, inv_tau_kind, with_ref, b=B_ANCHORS, n=B_CANDIDATES, ref_grad=False):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    anchors = torch.randn(b, DIM, generator=g, **f64).requires_grad_()
    candidates = torch.randn(n, DIM, generator=g, **f64).requires_grad_()
    if inv_tau_kind == 'scalar':
        inv_tau = torch.tensor(1.7, **f64).requires_grad_()
    else:
        inv_tau = (0.5 + 2 * torch.rand(b, generator=g, **f64)).requires_grad_()
    ref_anchors = ref_candidates = None
    if with_ref:
        ref_anchors = torch.randn(b, REF_DIM, generator=g, **f64).requires_grad_(ref_grad)
        ref_candidates = torch.randn(n, REF_DIM, generator=g, **f64).requires_grad_(ref_grad)
    upstream = torch.randn(b, generator=g, **f64)  # a non-uniform upstream gradient
    return anchors, candidates, inv_tau, ref_anchors, ref_candidates, upstream


def _value_and_grads(fn, anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, upstream,
                     negative_log_weight=None):
    out = fn(anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, negative_log_weight)
    wrt = [t for t in (anchors, candidates, inv_tau, ref_anchors, ref_candidates) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, wrt, upstream)
    return out, grads


def _assert_same(reference, tiled, tol=1e-9):
    (out_ref, grads_ref), (out_tiled, grads_tiled) = reference, tiled
    assert out_tiled.shape == out_ref.shape and out_tiled.dtype == out_ref.dtype
    torch.testing.assert_close(out_tiled, out_ref, rtol=tol, atol=tol)
    assert len(grads_tiled) == len(grads_ref)
    for got, want in zip(grads_tiled, grads_ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize('with_ref', [False, True])
@pytest.mark.parametrize('inv_tau_kind', ['scalar', 'per_row'])
@pytest.mark.parametrize('offset', OFFSETS)
@pytest.mark.parametrize('tile_size', TILE_SIZES)
def test_matches_untiled(tile_size, offset, inv_tau_kind, with_ref):
    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(tile_size * 100 + offset, inv_tau_kind, with_ref)
    args = (anchors, candidates, offset, inv_tau, ref_a, ref_c, upstream)
    reference = _value_and_grads(log_mean_exp_rows, *args)
    tiled = _value_and_grads(tiled_rows(tile_size), *args)
    _assert_same(reference, tiled)
    # the gradients are not trivially zero (so the comparison means something)
    assert all(g.abs().max() > 1e-3 for g in reference[1])


@pytest.mark.parametrize('aggregation', ['untiled', 'tiled'])
def test_inverse_temperature_may_be_a_number(aggregation):
    """Both entry points take 1/τ as a plain number, as their docstrings say, with the value of a 0-dim tensor."""
    rows = log_mean_exp_rows if aggregation == 'untiled' else tiled_rows(3)
    g = torch.Generator().manual_seed(0)
    anchors, candidates = torch.randn(4, 5, generator=g), torch.randn(9, 5, generator=g)
    torch.testing.assert_close(rows(anchors, candidates, 2, 10.0), rows(anchors, candidates, 2, torch.tensor(10.0)))


def test_large_inverse_temperature_is_stable():
    """τ = 0.01 on unit features: logits of ±400 overflow a naive exp; the streaming max must keep it exact."""
    anchors, candidates, _, ref_a, ref_c, upstream = _inputs(7, 'scalar', True)
    with torch.no_grad():
        for t in (anchors, candidates, ref_a, ref_c):
            t /= t.norm(dim=1, keepdim=True)
    inv_tau = torch.tensor(100.0, dtype=torch.float64, requires_grad=True)
    args = (anchors, candidates, 4, inv_tau, ref_a, ref_c, upstream)
    reference = _value_and_grads(log_mean_exp_rows, *args)
    tiled = _value_and_grads(tiled_rows(4), *args)
    assert reference[0].abs().max() > 50  # far outside exp's float range at these logits
    assert torch.isfinite(tiled[0]).all()
    _assert_same(reference, tiled)


@pytest.mark.parametrize('tile_size', [1, 4, B_CANDIDATES])
def test_reference_gradients_when_required(tile_size):
    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(3, 'per_row', True, ref_grad=True)
    args = (anchors, candidates, 2, inv_tau, ref_a, ref_c, upstream)
    reference = _value_and_grads(log_mean_exp_rows, *args)
    tiled = _value_and_grads(tiled_rows(tile_size), *args)
    assert len(reference[1]) == 5
    _assert_same(reference, tiled)


def _elementwise_log_weight(sim, mask):
    # row-separable: depends on s_ij only (ADNCE-like Gaussian hardness weighting, unnormalised)
    return -0.5 * (sim - 0.3) ** 2 / 0.7


def _aliasing_log_weight(sim, mask):
    return sim   # a view of the similarities themselves: the implementation must not modify it in place


def _constant_log_weight(sim, mask):
    return torch.tensor(0.25, dtype=sim.dtype)   # broadcast, not [b, T]


def _formula_log_mean_exp(anchors, candidates, offset, inv_tau, ref_anchors, ref_candidates, negative_log_weight):
    """log mean_{j≠i} exp(ℓ̂_ij·inv_tau_i + log w_ij), written out with autograd and a loop over the anchors."""
    rows = []
    for i in range(anchors.shape[0]):
        pos = offset + i
        ell = anchors[i] @ candidates.T - anchors[i] @ candidates[pos]
        if ref_anchors is not None:
            ell = ell - (ref_anchors[i] @ ref_candidates.T - ref_anchors[i] @ ref_candidates[pos])
        inv = inv_tau if inv_tau.dim() == 0 else inv_tau[i]
        terms = ell * inv
        if negative_log_weight is not None:
            mask = torch.zeros(1, candidates.shape[0], dtype=torch.bool)
            mask[0, pos] = True
            sim_row = (anchors[i] @ candidates.T).detach()[None]
            terms = terms + negative_log_weight(sim_row, mask)[0].detach()
        keep = torch.arange(candidates.shape[0]) != pos
        rows.append(torch.logsumexp(terms[keep], 0) - math.log(candidates.shape[0] - 1))
    return torch.stack(rows)


@pytest.mark.parametrize('log_weight', [None, _elementwise_log_weight])
@pytest.mark.parametrize('inv_tau_kind', ['scalar', 'per_row'])
@pytest.mark.parametrize('offset', OFFSETS)
def test_untiled_gradients_match_the_formula(offset, inv_tau_kind, log_weight):
    """The untiled function's hand-written backward against autograd of the formula, reference gradients included."""
    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(50 + offset, inv_tau_kind, True, ref_grad=True)
    args = (anchors, candidates, offset, inv_tau, ref_a, ref_c, upstream, log_weight)
    _assert_same(_value_and_grads(_formula_log_mean_exp, *args), _value_and_grads(log_mean_exp_rows, *args))


def test_one_similarity_matrix_serves_both_directions():
    """With the whole batch as anchors, both directions come from one product and equal separate computations."""
    image, text, inv_tau, ref_image, ref_text, _ = _inputs(9, 'per_row', True, b=B_CANDIDATES)
    inv_tau_text = (inv_tau.detach() * 0.7).requires_grad_()
    reference = (ref_image, ref_text, ref_image, ref_text)
    both = dense_aggregate(image, text, image, text, 0, inv_tau, inv_tau_text, reference)
    apart = (log_mean_exp_rows(image, text, 0, inv_tau, ref_image, ref_text),
             log_mean_exp_rows(text, image, 0, inv_tau_text, ref_text, ref_image))
    weights = torch.randn(2, B_CANDIDATES, dtype=torch.float64)
    wrt = (image, text, inv_tau, inv_tau_text)
    grads_both = torch.autograd.grad((weights * torch.stack(both)).sum(), wrt)
    grads_apart = torch.autograd.grad((weights * torch.stack(apart)).sum(), wrt)
    for got, want in zip(both + grads_both, apart + grads_apart):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('log_weight', [None, _elementwise_log_weight, RowNormalizedLogWeight(_elementwise_log_weight)])
@pytest.mark.parametrize('tile_size', [1, 3, 7, B_CANDIDATES + 1])
def test_one_pass_over_the_tiles_serves_both_directions(tile_size, log_weight):
    """With the whole batch as anchors, a tile's columns are whole text rows: the tiled aggregation computes both
    directions in one pass, equal to each direction computed apart (untiled), values and every gradient."""
    image, text, inv_tau, ref_image, ref_text, _ = _inputs(19, 'per_row', True, b=B_CANDIDATES, ref_grad=True)
    inv_tau_text = (inv_tau.detach().flip(0) * 0.7).requires_grad_()
    reference = (ref_image, ref_text, ref_image, ref_text)
    both = make_tiled_aggregate(tile_size)(image, text, image, text, 0, inv_tau, inv_tau_text, reference,
                                           log_weight)
    apart = (log_mean_exp_rows(image, text, 0, inv_tau, ref_image, ref_text, log_weight),
             log_mean_exp_rows(text, image, 0, inv_tau_text, ref_text, ref_image, log_weight))
    weights = torch.randn(2, B_CANDIDATES, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wrt = (image, text, inv_tau, inv_tau_text, ref_image, ref_text)
    grads_both = torch.autograd.grad((weights * torch.stack(both)).sum(), wrt)
    grads_apart = torch.autograd.grad((weights * torch.stack(apart)).sum(), wrt)
    for got, want in zip(both + grads_both, apart + grads_apart):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('log_weight', [_elementwise_log_weight, _aliasing_log_weight, _constant_log_weight])
@pytest.mark.parametrize('normalized', [False, True])
@pytest.mark.parametrize('tile_size', [1, 3, 7, B_CANDIDATES + 1])
@pytest.mark.parametrize('with_ref', [True, False])  # without a reference a tile is the similarities themselves
def test_negative_log_weight(tile_size, normalized, log_weight, with_ref):
    nlw = RowNormalizedLogWeight(log_weight) if normalized else log_weight
    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(11 + tile_size, 'per_row', with_ref)
    args = (anchors, candidates, 5, inv_tau, ref_a, ref_c, upstream, nlw)
    reference = _value_and_grads(log_mean_exp_rows, *args)
    tiled = _value_and_grads(tiled_rows(tile_size), *args)
    _assert_same(reference, tiled)
    # the weights change the result (except a constant weight normalised away), so this is not the unweighted
    # case in disguise
    unweighted = log_mean_exp_rows(*args[:6])
    if not (normalized and log_weight is _constant_log_weight):
        assert (unweighted - reference[0]).abs().max() > 1e-2
    else:
        torch.testing.assert_close(tiled[0], unweighted)


def test_row_normalized_log_weight_averages_to_one_over_negatives():
    sim = torch.randn(4, 9, dtype=torch.float64)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[torch.arange(4), torch.arange(4) + 2] = True
    log_w = RowNormalizedLogWeight(_elementwise_log_weight)(sim, mask)
    mean_w = log_w.exp().masked_fill(mask, 0).sum(1) / 8
    torch.testing.assert_close(mean_w, torch.ones(4, dtype=torch.float64))


def test_row_normalized_log_weight_leaves_the_callers_weights_alone():
    """h may be a tensor its callable keeps (a table of weights, a view of the similarities): normalising reads it."""
    sim = torch.randn(4, 9, dtype=torch.float64)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[torch.arange(4), torch.arange(4) + 2] = True
    kept = torch.randn(4, 9, dtype=torch.float64)
    before = kept.clone()
    RowNormalizedLogWeight(lambda s, m: kept)(sim, mask)
    assert torch.equal(kept, before)


def test_log_weight_sees_tiles_and_the_tile_mask():
    seen = []

    def recording(sim, mask):
        seen.append((sim.shape, mask.clone(), sim.requires_grad))
        return torch.zeros_like(sim)

    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(5, 'scalar', False)
    offset, tile = 5, 4
    out = tiled_log_mean_exp_rows(anchors, candidates, offset, inv_tau, negative_log_weight=recording,
                                  tile_size=tile)
    out.backward(upstream)
    n_tiles = -(-B_CANDIDATES // tile)
    assert len(seen) == 2 * n_tiles  # once per tile in forward, once in backward
    assert all(shape[0] == B_ANCHORS and shape[1] <= tile for shape, _, _ in seen)
    assert not any(requires_grad for _, _, requires_grad in seen)
    full_mask = torch.cat([mask for _, mask, _ in seen[:n_tiles]], dim=1)
    expected = torch.zeros(B_ANCHORS, B_CANDIDATES, dtype=torch.bool)
    expected[torch.arange(B_ANCHORS), torch.arange(B_ANCHORS) + offset] = True
    assert torch.equal(full_mask, expected)


def test_gradcheck():
    anchors, candidates, inv_tau, ref_a, ref_c, _ = _inputs(9, 'per_row', True, b=3, n=7, ref_grad=True)
    fn = functools.partial(tiled_log_mean_exp_rows, offset=2, tile_size=3)
    assert torch.autograd.gradcheck(
        lambda a, c, t, ra, rc: fn(a, c, inv_tau=t, ref_anchors=ra, ref_candidates=rc),
        (anchors, candidates, inv_tau, ref_a, ref_c))


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (what bounds the working memory)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize('normalized_weight', [False, True])
def test_never_materialises_the_pairwise_matrix(normalized_weight):
    b = n = 64
    tile, dim = 8, 4   # b·tile = 512, candidates n·dim = 256, the pairwise matrix b·n = 4096
    g = torch.Generator().manual_seed(0)
    anchors = torch.randn(b, dim, generator=g, dtype=torch.float64, requires_grad=True)
    candidates = torch.randn(n, dim, generator=g, dtype=torch.float64, requires_grad=True)
    ref_a = torch.randn(b, dim, generator=g, dtype=torch.float64)
    ref_c = torch.randn(n, dim, generator=g, dtype=torch.float64)
    inv_tau = torch.full((b,), 3.0, dtype=torch.float64, requires_grad=True)
    nlw = RowNormalizedLogWeight(_elementwise_log_weight) if normalized_weight else None
    sizes = {}
    for name, fn in [('untiled', log_mean_exp_rows), ('tiled', tiled_rows(tile))]:
        with _LargestTensor() as probe:
            fn(anchors, candidates, 0, inv_tau, ref_a, ref_c, nlw).sum().backward()
        sizes[name] = probe.largest
    assert sizes['untiled'] >= b * n       # the probe does see a b×B matrix when one exists
    assert sizes['tiled'] <= b * tile


def test_distillation_in_chunks_holds_a_chunk_of_rows_at_a_time():
    """The KD term of a tiled run takes T anchors at a time and recomputes their logits in backward: the same value
    and gradients as all rows at once, never a b×B matrix."""
    from drrho_openclip.losses.distill import distillation_loss
    b = n = 64
    rows, dim = 8, 4
    g = torch.Generator().manual_seed(0)
    student = [torch.nn.functional.normalize(torch.randn(b, dim, generator=g, dtype=torch.float64), dim=1)
               for _ in range(2)]
    teacher = [torch.nn.functional.normalize(torch.randn(b, dim, generator=g, dtype=torch.float64), dim=1)
               for _ in range(2)]
    sizes, results = {}, {}
    for name, rows_per_chunk in [('whole', 0), ('chunked', rows)]:
        image, text = (x.clone().requires_grad_() for x in student)
        scale = torch.tensor(14.0, dtype=torch.float64, requires_grad=True)
        with _LargestTensor() as probe:
            value = distillation_loss((image, text), (image, text), teacher, teacher, scale, 20.0, rows_per_chunk)
            grads = torch.autograd.grad(value, (image, text, scale))
        sizes[name], results[name] = probe.largest, (value, *grads)
    for got, want in zip(results['chunked'], results['whole']):
        torch.testing.assert_close(got, want)
    assert sizes['whole'] >= b * n
    assert sizes['chunked'] <= rows * n


def _log_g_by_definition(anchors, candidates, offset, inv_tau, ref_anchors=None, ref_candidates=None):
    """log mean_{j≠i} exp(ℓ̂_ij·inv_tau_i) written out, every derivative left to autograd."""
    sim = anchors @ candidates.T
    ell = sim - sim.diagonal(offset)[:, None]
    if ref_anchors is not None:
        ref_sim = ref_anchors @ ref_candidates.T
        ell = ell - (ref_sim - ref_sim.diagonal(offset)[:, None])
    logits = ell * (inv_tau.reshape(-1, 1) if inv_tau.dim() else inv_tau)
    negatives = torch.ones_like(logits, dtype=torch.bool)
    negatives.diagonal(offset).fill_(False)
    return torch.logsumexp(logits.masked_fill(~negatives, float('-inf')), dim=1) - math.log(logits.shape[1] - 1)


@pytest.mark.parametrize('with_ref', [False, True])
@pytest.mark.parametrize('inv_tau_kind', ['scalar', 'per_row'])
@pytest.mark.parametrize('aggregation', ['untiled', 'tiled'])
def test_matches_the_definition_in_value_and_every_gradient(aggregation, inv_tau_kind, with_ref):
    """Both aggregations against the plain expression (float64 autograd), the temperature's gradient included,
    which the aggregations compute in forward and hand to autograd as a first-order term."""
    fn = log_mean_exp_rows if aggregation == 'untiled' else tiled_rows(4)
    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(11, inv_tau_kind, with_ref, ref_grad=with_ref)
    args = (anchors, candidates, 5, inv_tau, ref_a, ref_c, upstream)
    definition = _value_and_grads(lambda *a: _log_g_by_definition(*a[:6]), *args)
    _assert_same(definition, _value_and_grads(fn, *args), tol=1e-10)
    assert definition[1][2].abs().min() > 1e-3  # the temperature's gradient is not trivially zero


@pytest.mark.parametrize('aggregation', ['untiled', 'tiled'])
def test_temperature_gradient_with_negative_log_weights(aggregation):
    """The weights are constants of the graph, so the derivative in 1/τ alone can be checked numerically."""
    fn = log_mean_exp_rows if aggregation == 'untiled' else tiled_rows(4)
    anchors, candidates, inv_tau, ref_a, ref_c, _ = _inputs(13, 'per_row', True)
    anchors, candidates = anchors.detach(), candidates.detach()
    nlw = RowNormalizedLogWeight(_elementwise_log_weight)
    assert torch.autograd.gradcheck(lambda t: fn(anchors, candidates, 5, t, ref_a, ref_c, nlw), (inv_tau,))


@pytest.mark.parametrize('inv_tau_kind', ['scalar', 'per_row'])
@pytest.mark.parametrize('aggregation', ['untiled', 'tiled'])
def test_the_temperature_gradient_alone_costs_no_pairwise_pass(aggregation, inv_tau_kind):
    """A learned τ takes its own gradient inside every forward call: that must not run the aggregation's backward
    (b×B work, or b×T per tile) a second time."""
    fn = log_mean_exp_rows if aggregation == 'untiled' else tiled_rows(4)
    anchors, candidates, inv_tau, ref_a, ref_c, upstream = _inputs(12, inv_tau_kind, True)
    out = fn(anchors, candidates, 5, inv_tau, ref_a, ref_c)
    with _LargestTensor() as probe:
        grad, = torch.autograd.grad(out, inv_tau, upstream, retain_graph=True)
    assert probe.largest <= B_ANCHORS
    expected, = torch.autograd.grad(_log_g_by_definition(anchors, candidates, 5, inv_tau, ref_a, ref_c), inv_tau,
                                    upstream)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


def test_rejects_bad_arguments():
    anchors, candidates, inv_tau, *_ = _inputs(1, 'scalar', False)
    with pytest.raises(ValueError, match='tile_size'):
        tiled_log_mean_exp_rows(anchors, candidates, 0, inv_tau, tile_size=0)
    with pytest.raises(ValueError, match='tile_size'):
        make_tiled_aggregate(2.5)
    with pytest.raises(ValueError, match='outside'):
        tiled_log_mean_exp_rows(anchors, candidates, B_CANDIDATES - B_ANCHORS + 1, inv_tau, tile_size=4)
    with pytest.raises(ValueError, match='inv_tau'):
        tiled_log_mean_exp_rows(anchors, candidates, 0, torch.ones(B_ANCHORS + 1), tile_size=4)
    with pytest.raises(ValueError, match='reference'):
        tiled_log_mean_exp_rows(anchors, candidates, 0, inv_tau, ref_anchors=anchors.detach(), tile_size=4)


def test_default_tile_size_is_sane():
    assert isinstance(DEFAULT_TILE_SIZE, int) and DEFAULT_TILE_SIZE >= 1
    assert make_tiled_aggregate().keywords['tile_size'] == DEFAULT_TILE_SIZE


# ---- the DRO loss with the tiled aggregation plugged in -------------------------------------------------------

NUM_SAMPLES, BATCH, FEAT, REF_FEAT = 40, 12, 16, 8


def _unit(x):
    return x / x.norm(dim=1, keepdim=True)


def _batch(step, with_ref):
    g = torch.Generator().manual_seed(1000 + step)
    index = torch.randperm(NUM_SAMPLES, generator=g)[:BATCH]   # batches overlap across steps
    image = _unit(torch.randn(BATCH, FEAT, generator=g))
    text = _unit(image + 0.8 * torch.randn(BATCH, FEAT, generator=g))
    refs = {}
    if with_ref:
        ref_image = _unit(torch.randn(BATCH, REF_FEAT, generator=g))
        refs = dict(ref_image_features=ref_image,
                    ref_text_features=_unit(ref_image + torch.randn(BATCH, REF_FEAT, generator=g)))
    return index, image, text, refs


# float32 features, computed in float32: float32 tolerances; at τ = 0.01 the logits reach ±400
F32 = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('name, options', [
    ('drrho', dict(gamma=0.5, temperature=0.01)),            # fixed τ = 0.01, reference shift, u with γ = 0.5
    ('drrho', dict(gamma=0.5, learn_temperature=True, temperature=0.07,
                   temperature_optimizer='model')),          # τ = 1/logit_scale, ρ term
    ('drrho', dict(temperature='auto', temperature_optimizer='loss', gamma=0.5,
                   lr_tau=0.05)),                            # τ 'auto', learned by the loss's Adam, ρ from the batch
    ('sogclr', dict(gamma=0.5)),                             # no reference
    ('drrho', dict(gamma=0.5, distill_weight=0.5)),          # KD, T anchors at a time in the tiled run
])
@pytest.mark.parametrize('tile_size', [1, 5, 64])
def test_dro_loss_with_tiled_aggregation(name, options, tile_size):
    losses = {}
    for kind in ('untiled', 'tiled'):
        loss = create_loss(name, num_samples=NUM_SAMPLES, tile_size=tile_size if kind == 'tiled' else 0, **options)
        loss.set_total_steps(1)
        losses[kind] = loss
    assert losses['tiled'].aggregate is not dense_aggregate and losses['tiled'].distill_rows == tile_size
    assert losses['untiled'].aggregate is dense_aggregate
    with_ref = losses['untiled'].reference_shift

    for step in range(4):
        if step == 1:   # epoch 0 takes the mini-batch estimate as is; from epoch 1 on, γ = 0.5
            for loss in losses.values():
                loss.set_epoch(1)
                assert loss.state.gamma == 0.5
        index, image, text, refs = _batch(step, with_ref)
        results = {}
        for kind, loss in losses.items():
            feats = [image.clone().requires_grad_(), text.clone().requires_grad_()]
            logit_scale = torch.tensor(1 / 0.07, requires_grad=True)
            value = loss(*feats, logit_scale=logit_scale, index=index, **refs)
            wrt = feats + ([logit_scale] if options.get('learn_temperature') else [])
            results[kind] = (value, torch.autograd.grad(value, wrt), loss.metrics())
        (v_ref, g_ref, m_ref), (v_tiled, g_tiled, m_tiled) = results['untiled'], results['tiled']
        torch.testing.assert_close(v_tiled, v_ref, **F32)
        for got, want in zip(g_tiled, g_ref):
            torch.testing.assert_close(got, want, **F32)
        assert m_tiled.keys() == m_ref.keys()
        for key in m_ref:
            assert m_tiled[key] == pytest.approx(m_ref[key], rel=2e-5, abs=2e-5), key

    state_ref, state_tiled = losses['untiled'].state, losses['tiled'].state
    assert state_ref.gamma == 0.5
    for table in ('log_u_image', 'log_u_text'):
        ref_u, tiled_u = getattr(state_ref, table), getattr(state_tiled, table)
        assert (~torch.isnan(ref_u)).sum() > BATCH   # several steps' samples are in the state
        torch.testing.assert_close(tiled_u, ref_u, equal_nan=True, **F32)



def test_tiling_is_chosen_from_the_pairs_a_rank_holds():
    from drrho_openclip.openclip.model import auto_tile_size
    assert auto_tile_size(16384, 16384) == DEFAULT_TILE_SIZE   # one process: 2^28 pairs, gigabytes untiled
    assert auto_tile_size(2048, 16384) == 0                    # 8 ranks share that batch: 128 MiB per matrix
    assert auto_tile_size(4096, 4096) == 0
    assert auto_tile_size(8192, 65536) == DEFAULT_TILE_SIZE


def test_on_a_gpu_tiling_is_chosen_from_its_memory(monkeypatch):
    """On a GPU the untiled core is kept (it is the faster one) while its matrices take at most a quarter of the
    device's memory."""
    from types import SimpleNamespace
    from drrho_openclip.openclip.model import auto_tile_size
    gpu, gib = torch.device('cuda', 0), 1 << 30
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda device: SimpleNamespace(total_memory=80 * gib))
    assert auto_tile_size(32768, 32768, gpu) == 0                   # 14 GiB of 80: untiled, where the CPU tiles
    assert auto_tile_size(49152, 49152, gpu) == DEFAULT_TILE_SIZE   # 31.5 GiB: more than a quarter
    assert auto_tile_size(8192, 65536, gpu) == 0                    # 8 ranks share that batch: 7 GiB per rank
    # with KD's b×B matrices (34 bytes per pair in all): 34 GiB, more than a quarter (it took 14 per pair)
    assert auto_tile_size(32768, 32768, gpu, distills=True) == DEFAULT_TILE_SIZE
    assert auto_tile_size(16384, 16384, gpu, distills=True) == 0
    assert auto_tile_size(12288, 12288, distills=True) == DEFAULT_TILE_SIZE  # the CPU's 3.5 GiB, at 34 per pair
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda device: SimpleNamespace(total_memory=24 * gib))
    assert auto_tile_size(32768, 32768, gpu) == DEFAULT_TILE_SIZE
