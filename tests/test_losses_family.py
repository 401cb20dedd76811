"""The registered family: defaults and help, option checks, checkpoints, gradient accumulation, fp32 stability."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import without_dropout
from drrho_openclip.losses import (DROContrastiveLoss, FixedTemperature, attach_to_model, create_loss, get_loss_spec,
                                   list_losses, option_names)


def unit(g, n, d, dtype=torch.float32):
    return F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=1)


def make_batch(seed, n, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    image, text = unit(g, n, d, dtype), unit(g, n, d, dtype)
    ref_image = F.normalize(image + 0.7 * unit(g, n, d, dtype), dim=1)
    ref_text = F.normalize(text + 0.7 * unit(g, n, d, dtype), dim=1)
    return image, text, ref_image, ref_text


# every loss with the options a small test needs (and KD variants)
CASES = {
    'clip': dict(),
    'clip+kd': dict(distill_weight=0.5),
    'drrho': dict(gamma=0.5),
    'drrho+kd': dict(gamma=0.5, distill_weight=0.25),
    'drrho+auto': dict(temperature='auto', temperature_optimizer='loss'),  # a τ chosen from the first batch
    'sogclr': dict(gamma=0.5),
    'fastclip': dict(),
    'fastclip+kd': dict(distill_weight=0.25),
    'isogclr': dict(),
    'tempnet': dict(embed_dim=8),
    'adnce': dict(),
    'balanced': dict(),
    'jest': dict(),
    'jest-topk': dict(),
}


def build(case, num_samples=64, **overrides):
    """The loss of `case` with `overrides`, those among them that the loss has (tests share option sets)."""
    name = case.split('+')[0]
    own = option_names(name) + list(get_loss_spec(name).run_options)
    options = {**CASES[case], **{k: v for k, v in overrides.items() if k in own}}
    if get_loss_spec(name).stateful:
        options.setdefault('num_samples', num_samples)
    loss = create_loss(name, **options)
    if hasattr(loss, 'set_total_steps'):
        loss.set_total_steps(100)  # as a training run does before its first step (a learned τ's lr_tau 'auto')
    return loss


def call(loss, image, text, logit_scale, index, ref_image, ref_text, **kw):
    return loss(image, text, logit_scale, index=index, ref_image_features=ref_image, ref_text_features=ref_text,
                output_dict=True, **kw)


def set_epoch(loss, epoch):
    if hasattr(loss, 'set_epoch'):  # the losses with per-sample state
        loss.set_epoch(epoch)


def test_every_loss_has_help_and_paper_defaults():
    assert set(list_losses()) >= {'clip', 'drrho', 'sogclr', 'fastclip', 'isogclr', 'tempnet', 'adnce', 'balanced',
                                  'jest', 'jest-topk'}
    for name in list_losses():
        spec = get_loss_spec(name)
        assert spec.help and '\n' not in spec.help
        assert spec.reference in ('none', 'optional', 'required')
    # ρ from the batch: the paper's 8.5 (rho=8.5) exceeds log(B − 1) below B = 4900, where τ would collapse
    assert get_loss_spec('fastclip').defaults['rho'] == 'auto'
    assert create_loss('fastclip', num_samples=4, rho=8.5).rho == 8.5
    # the teacher's scale is calibrated on the first batch unless given (distill.ReferenceLogitScale)
    assert get_loss_spec('jest').defaults == dict(selection_ratio=0.2, num_chunks=2, reference_logit_scale='auto')
    assert get_loss_spec('balanced').defaults['balance_steps'] == 2
    assert get_loss_spec('drrho').defaults['reference_logit_scale'] == 'auto'


def test_drrho_paper_is_drrho_with_the_papers_flags():
    paper = get_loss_spec('drrho-paper').defaults
    assert paper == {**get_loss_spec('drrho').defaults, 'temperature': 0.01, 'learn_temperature': False,
                     'reference_weight': 1.0, 'column_step': False, 'gamma': 0.8, 'positive_in_denominator': False,
                     'temperature_optimizer': 'loss'}  # the last: should its τ be learned, by its own Adam (App. C.3)
    # the same loss as `--loss drrho --no-learn-temperature --temperature 0.01 --reference-weight 1
    # --no-column-step --gamma 0.8 --no-positive-in-denominator`, state included
    losses = [create_loss('drrho-paper', num_samples=16, gamma=0.5),
              create_loss('drrho', num_samples=16, gamma=0.5, learn_temperature=False, temperature=0.01,
                          reference_weight=1.0, column_step=False, positive_in_denominator=False)]
    for step in range(3):  # the second visit of a sample reads the u its first wrote
        image, text, ref_image, ref_text = make_batch(step, 8)
        index = torch.arange(8) + 8 * (step % 2)
        results = []
        for loss in losses:
            leaves = image.clone().requires_grad_(), text.clone().requires_grad_()
            value = loss(*leaves, None, index=index, ref_image_features=ref_image, ref_text_features=ref_text)
            value.backward()
            results.append([value.detach(), *(leaf.grad for leaf in leaves)])
        for ours, theirs in zip(*results):
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize('name, options, message', [
    ('sogclr', dict(distill_weight=0.5), 'no option distill_weight'),
    ('clip', dict(selection_ratio=0.5), 'no option selection_ratio'),
    ('fastclip', dict(learn_temperature=False), 'use the loss sogclr'),
    ('isogclr', dict(num_samples=10, learn_temperature=True), 'has no option learn_temperature'),
    ('isogclr', dict(), 'dataset size'),
    ('isogclr', dict(num_samples=10, tau_min=0.1), 'tau_min'),
    ('tempnet', dict(num_samples=10), 'embed_dim'),
    ('tempnet', dict(num_samples=10, embed_dim=4, tau_min=0.1, tau_max=0.1), 'tau_min < tau_max'),
    ('drrho', dict(num_samples=10, distill_weight=1.5), 'in [0, 1]'),
    ('clip', dict(distill_weight=-0.1), 'in [0, 1] (0: no distillation)'),
    ('clip', dict(distill_weight=float('nan')), 'in [0, 1]'),
    ('clip', dict(distill_weight=0.5, reference_logit_scale=float('inf')), 'a finite number > 0'),
    ('jest', dict(reference_logit_scale=float('inf')), 'a finite number > 0'),
    ('jest-topk', dict(num_chunks=1), 'it would be jest'),
    ('adnce', dict(adnce_sigma=0.0), 'σ (adnce_sigma) must be > 0'),
    ('balanced', dict(balance_steps=0), 'balance_steps ≥ 1'),
    ('jest', dict(selection_ratio=0.0), 'selection_ratio must be in'),
    ('jest', dict(num_chunks=0), 'num_chunks must be 1 to 64, got 0'),
    ('jest', dict(num_chunks=65), 'num_chunks must be 1 to 64, got 65'),
    ('isogclr', dict(num_samples=10, temperature='auto'), "temperature 'auto' is chosen from the reference model's"),
    ('balanced', dict(temperature='auto'), "temperature 'auto' is chosen from the reference model's"),
    ('balanced', dict(temperature='auto', learn_temperature=False), "temperature 'auto' is chosen"),
    ('isogclr', dict(num_samples=10, target_negatives=0.0), 'target_negatives must be ≥ 1'),
    ('tempnet', dict(num_samples=10, embed_dim=4, tempnet_prototypes=0), 'tempnet_prototypes must be at least 1'),
    ('tempnet', dict(num_samples=10, embed_dim=4, tempnet_width=0), 'tempnet_width and tempnet_prototypes must be'),
    ('drrho', dict(num_samples=10, gamma=0.5, gamma_decay_epochs=-3), 'gamma_decay_epochs must be ≥ 1'),
    ('tempnet', dict(num_samples=10, embed_dim=4, target_negatives=-2.0), 'target_negatives must be ≥ 1'),
    ('drrho', dict(num_samples=10, temperature_optimizer='model', target_negatives=0.5), 'target_negatives must be'),
])
def test_bad_options_raise(name, options, message):
    with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)').replace('[', r'\[')):
        create_loss(name, **options)


def test_the_core_built_directly_checks_target_negatives_when_rho_comes_from_the_batch():
    """Built without the registry, the core refuses a k < 1 too: log((B − 1)/k) would ask for more effective
    negatives than an anchor has."""
    with pytest.raises(ValueError, match='target_negatives must be ≥ 1'):
        DROContrastiveLoss(FixedTemperature(0.07), epsilon=1e-8, rho=None, target_negatives=0.5)
    DROContrastiveLoss(FixedTemperature(0.07), epsilon=1e-8, rho=2.0, target_negatives=0.5)  # ρ given: k unread


def test_bad_calls_raise():
    image, text, _, _ = make_batch(0, 8)
    with pytest.raises(ValueError, match='no reference features'):
        create_loss('fastclip', distill_weight=0.3, gamma=1.0)(image, text, torch.tensor(10.0))
    with pytest.raises(ValueError, match='reference'):
        create_loss('clip', distill_weight=0.3)(image, text, torch.tensor(10.0))
    with pytest.raises(ValueError, match='reference'):
        create_loss('jest')(image, text, torch.tensor(10.0))
    with pytest.raises(ValueError, match='raise --batch-size'):
        create_loss('jest', num_chunks=3)(image, text, torch.tensor(10.0), ref_image_features=image,
                                          ref_text_features=text)
    with pytest.raises(ValueError, match='sample `index`'):
        create_loss('isogclr', num_samples=8)(image, text)
    with pytest.raises(IndexError, match=r'outside the per-sample state of size 4: index 7 \(the dataset is larger'):
        create_loss('isogclr', num_samples=4)(image, text, index=torch.arange(8))
    with pytest.raises(IndexError, match=r'outside the per-sample state of size 10: index -1 \(sample indices start'):
        create_loss('isogclr', num_samples=10)(image, text, index=torch.arange(8) - 1)
    for name in ('drrho', 'sogclr', 'adnce', 'isogclr'):
        with pytest.raises(ValueError, match='a global batch of 1: the DRO losses need at least 2 samples'):
            create_loss(name, num_samples=8)(image[:1], text[:1], torch.tensor(10.0), index=torch.arange(1),
                                             ref_image_features=image[:1], ref_text_features=text[:1])


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: loss.state_dict() holds every per-sample table (and TempNet's parameters)


def tables(loss):
    return {k: v.clone() for k, v in loss.state_dict().items()}


@pytest.mark.parametrize('case', ['drrho', 'sogclr', 'isogclr', 'tempnet', 'fastclip'])
def test_state_dict_round_trip(case):
    num_samples, n = 24, 8
    loss = build(case, num_samples=num_samples, gamma=0.5, gamma_decay_epochs=1)
    without_dropout(loss)  # so that two copies compute the same
    logit_scale = torch.tensor(20.0)
    for step in range(3):
        loss.set_epoch(step)
        image, text, ref_image, ref_text = make_batch(step, n)
        index = torch.randperm(num_samples, generator=torch.Generator().manual_seed(step))[:n]
        call(loss, image, text, logit_scale, index, ref_image, ref_text)
    saved = tables(loss)
    assert any(torch.isnan(v).any() for k, v in saved.items() if k.startswith('state.')), "unvisited rows stay NaN"
    if case == 'isogclr':
        assert {'temperature.tau_image', 'temperature.exp_avg_sq_text'} <= set(saved)
    if case == 'tempnet':
        assert 'temperature.image.prototypes' in saved

    resumed = without_dropout(build(case, num_samples=num_samples, gamma=0.5, gamma_decay_epochs=1))
    resumed.load_state_dict(saved)
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, saved[key], equal_nan=True, rtol=0, atol=0)
    image, text, ref_image, ref_text = make_batch(9, n)
    index = torch.arange(n) + 3
    for copy_ in (loss, resumed):
        copy_.set_epoch(3)
    a = call(loss, image, text, logit_scale, index, ref_image, ref_text)
    b = call(resumed, image, text, logit_scale, index, ref_image, ref_text)
    assert torch.equal(a['contrastive_loss'], b['contrastive_loss'])
    for key, value in loss.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, equal_nan=True, rtol=0, atol=0)


def test_resume_without_state_or_other_size_fails():
    loss = build('isogclr', num_samples=16, gamma=0.5)
    with pytest.raises(RuntimeError, match='per-sample state'):
        loss.load_state_dict({k: v for k, v in loss.state_dict().items() if not k.startswith('state.')})
    with pytest.raises(RuntimeError):
        loss.load_state_dict(build('isogclr', num_samples=20, gamma=0.5).state_dict())


def test_tempnet_attaches_to_the_model():
    model = torch.nn.Module()
    model.logit_scale = torch.nn.Parameter(torch.tensor(2.0))
    loss = build('tempnet')
    assert attach_to_model(model, loss) == ['loss_temperature']
    assert model.loss_temperature is loss.temperature
    names = {n for n, _ in model.named_parameters()}
    assert 'loss_temperature.image.transform.weight' in names and 'loss_temperature.text.pool.bias' in names
    assert 'loss_temperature.image.prototypes' in model.state_dict()
    assert attach_to_model(torch.nn.Module(), build('drrho')) == []  # no learnable modules: nothing attached


# ---------------------------------------------------------------------------------------------------------------
# gradient accumulation: OpenCLIP calls the loss once per chunk on the whole window, the chunk's features live


ACCUM_CASES = ['clip', 'clip+kd', 'drrho', 'drrho+kd', 'fastclip', 'isogclr', 'tempnet', 'adnce', 'balanced', 'jest']


def test_a_window_whose_samples_change_between_calls_is_refused():
    """A later call of an accumulation window reads the u its first call wrote: other samples there are a loop's
    mistake (exact on the CPU; on an accelerator a device-side assertion, which does not wait for the device)."""
    loss = build('drrho', num_samples=16)
    image, text, ref_image, ref_text = make_batch(2, 6)
    index = torch.arange(6)
    call(loss, image, text, torch.tensor(20.0), index, ref_image, ref_text, accum_step=0)
    call(loss, image, text, torch.tensor(20.0), index.clone(), ref_image, ref_text, accum_step=1)  # same samples
    for other in (index.flip(0), torch.arange(5)):
        with pytest.raises(RuntimeError, match='the samples of a gradient-accumulation window changed'):
            call(loss, image[:len(other)], text[:len(other)], torch.tensor(20.0), other, ref_image[:len(other)],
                 ref_text[:len(other)], accum_step=1)


@pytest.mark.parametrize('case', ACCUM_CASES)
def test_accumulation_equals_one_call(case):
    """accum_freq = 2: state and per-sample τ move once per window, the chunks' feature gradients add up to the
    one-call gradient, and τ's own gradient (logit_scale, TempNet) arrives once, not accum_freq times."""
    num_samples, n = 32, 12
    options = dict(num_samples=num_samples, gamma=0.5, gamma_decay_epochs=1)
    one, accum = without_dropout(build(case, **options)), without_dropout(build(case, **options))
    accum.load_state_dict(one.state_dict())  # same TempNet weights
    image, text, ref_image, ref_text = make_batch(1, n, dtype=torch.float64)
    index = torch.randperm(num_samples, generator=torch.Generator().manual_seed(1))[:n]
    for loss in (one, accum):
        set_epoch(loss, 0)  # first visits, then revisits at γ < 1
        call(loss, image.flip(0), text.flip(0), torch.tensor(20.0), index.flip(0), ref_image.flip(0),
             ref_text.flip(0))
        set_epoch(loss, 1)

    def leaves():
        return image.clone().requires_grad_(), text.clone().requires_grad_(), torch.tensor(
            20.0, dtype=torch.float64, requires_grad=True)

    params = [p for p in one.parameters()]
    i1, t1, s1 = leaves()
    total = sum(call(one, i1, t1, s1, index, ref_image, ref_text).values())
    want = torch.autograd.grad(total, [i1, t1, s1] + params, allow_unused=True)

    i2, t2, s2 = leaves()
    accum_params = [p for p in accum.parameters()]
    got = [torch.zeros_like(x) for x in (i2, t2, s2)] + [torch.zeros_like(p) for p in accum_params]
    chunks = [slice(0, n // 2), slice(n // 2, n)]
    for j, live in enumerate(chunks):
        # the window as OpenCLIP rebuilds it: cached (detached) features, chunk j recomputed with gradient
        img = torch.cat([i2[c] if c == live else i2[c].detach() for c in chunks])
        txt = torch.cat([t2[c] if c == live else t2[c].detach() for c in chunks])
        out = sum(call(accum, img, txt, s2, index, ref_image, ref_text, accum_step=j).values())
        assert torch.allclose(out, total, rtol=1e-6), "every call of the window has the window's loss value"
        step = torch.autograd.grad(out, [i2, t2, s2] + accum_params, allow_unused=True)
        got = [a + b if b is not None else a for a, b in zip(got, step)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-6, atol=1e-9)
    for key, value in one.state_dict().items():
        torch.testing.assert_close(accum.state_dict()[key], value, equal_nan=True, rtol=1e-6, atol=1e-9)


def test_an_index_tensor_rewritten_through_numpy_is_read_afresh_at_every_call():
    """One index tensor reused from step to step, its values rewritten through numpy (no torch version counted): each
    call reads the rows it holds now. The per-call cache kept the first step's int64 copy, so the second step read
    and wrote rows 0–15 again and rows 16–31 were never visited."""
    import numpy as np
    values = np.zeros(16, np.int32)
    index = torch.from_numpy(values)
    loss = create_loss('sogclr', num_samples=32, gamma=0.5)
    image, text, _, _ = make_batch(1, 16)
    for step in range(2):
        values[:] = np.arange(16) + 16 * step
        loss(image, text, None, index=index)
    assert torch.isfinite(loss.state.log_u_image).all() and torch.isfinite(loss.state.log_u_text).all()


@pytest.mark.parametrize('case', ['drrho', 'isogclr', 'tempnet', 'jest'])
def test_a_window_continued_before_it_was_opened_says_so(case):
    """accum_step > 0 replays the window its accum_step=0 call opened: called first, it said
    "cannot unpack non-iterable NoneType object" (or a target-size error, JEST's)."""
    loss = build(case, num_samples=32, gamma=0.5)
    image, text, ref_image, ref_text = make_batch(1, 12)
    with pytest.raises(RuntimeError, match=r"accum_step > 0 continues an accumulation window: call the loss on the "
                                           r"window's first chunk with accum_step=0 first"):
        call(loss, image, text, torch.tensor(20.0), torch.arange(12), ref_image, ref_text, accum_step=1)


# ---------------------------------------------------------------------------------------------------------------
# eval mode: a held-out batch scored between training steps leaves the run as it was


@pytest.mark.parametrize('case', list(CASES))
def test_eval_mode_scores_a_batch_without_touching_the_run(case):
    """`loss.eval()` under no_grad, before the first training step and between two: no state changes (u, τ and its
    moments, a τ or teacher scale to be chosen from the first batch, JEST's selection count, the last training call's
    metrics), and the run continues exactly as a copy that never evaluated. Before, the DRO losses wrote the held-out
    samples' u into the tables, and a learned τ raised under no_grad."""
    num_samples, n = 32, 8
    trained = build(case, num_samples=num_samples, gamma=0.5, gamma_decay_epochs=1)
    evaluated = copy.deepcopy(trained)
    held_out = make_batch(99, n)
    logit_scale = torch.tensor(20.0)
    for step in range(3):
        if step in (0, 2):
            before, metrics = tables(evaluated), repr(evaluated.metrics())
            evaluated.eval()
            with torch.no_grad():
                score = call(evaluated, *held_out[:2], logit_scale, torch.arange(16, 16 + n), *held_out[2:])
                with pytest.raises(ValueError, match="accum_step is for training"):
                    call(evaluated, *held_out[:2], logit_scale, torch.arange(16, 16 + n), *held_out[2:], accum_step=0)
            evaluated.train()
            assert all(torch.isfinite(v) for v in score.values())
            assert repr(evaluated.metrics()) == metrics
            after = tables(evaluated)
            assert after.keys() == before.keys()
            for key, value in before.items():
                assert torch.equal(after[key].nan_to_num(-7.0), value.nan_to_num(-7.0)), key
        image, text, ref_image, ref_text = make_batch(step, n)
        index = torch.arange(n) + n * (step % 2)  # revisits from step 2 on
        outs = []
        for loss in (trained, evaluated):
            set_epoch(loss, step)
            outs.append(call(loss, image, text, logit_scale, index, ref_image, ref_text))
        for key, value in outs[0].items():
            assert torch.equal(outs[1][key], value), key
    for key, value in tables(trained).items():
        assert torch.equal(tables(evaluated)[key].nan_to_num(-7.0), value.nan_to_num(-7.0)), key


def test_jest_scores_the_whole_batch_with_clips_loss_in_eval_mode():
    """Selection is how JEST trains, like dropout: evaluation draws nothing and needs no reference."""
    image, text, _, _ = make_batch(3, 10)
    jest = build('jest').eval()
    want = create_loss('clip')(image, text, torch.tensor(20.0))
    assert torch.equal(jest(image, text, torch.tensor(20.0)), want)


def test_clip_keeps_openclips_positional_output_dict():
    """OpenCLIP's ClipLoss takes output_dict as its fourth positional argument; the extras are keywords only."""
    image, text, _, _ = make_batch(3, 10)
    assert set(create_loss('clip')(image, text, torch.tensor(20.0), True)) == {'contrastive_loss'}


@pytest.mark.parametrize('name', ['drrho', 'sogclr', 'isogclr', 'tempnet'])
def test_a_loss_without_gradients_in_training_mode_points_to_eval_mode(name):
    """Refused before it writes anything: the learned τ's refusal came after u was written (and an 'auto' τ chosen),
    and a loss with u alone wrote it without a word."""
    image, text, ref_image, ref_text = make_batch(3, 10)
    loss = build(name, num_samples=10, gamma=0.5)
    before = tables(loss)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"or put it in eval mode \(loss.eval\(\)\)"):
        call(loss, image, text, None, torch.arange(10), ref_image, ref_text)
    for key, value in tables(loss).items():
        assert torch.equal(value.nan_to_num(-7.0), before[key].nan_to_num(-7.0)), key


# ---------------------------------------------------------------------------------------------------------------
# float32 and bf16 autocast at τ = 0.01 and a batch of 4096: no inf or nan in the loss, its gradients or its state


# drrho+kd computes what fastclip+kd does at logit scale 100, drrho+auto what drrho does from another τ; two steps
# where a state's update has its own code
STABILITY_STEPS = {**{case: 1 for case in CASES if case not in ('drrho+kd', 'drrho+auto')}, 'drrho': 2, 'isogclr': 2}


@pytest.mark.parametrize('autocast', [False, True], ids=['fp32', 'bf16-autocast'])
@pytest.mark.parametrize('case', list(STABILITY_STEPS))
def test_stable_in_float32_at_tau_001(case, autocast):
    n = 4096
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    image, text = unit(g, n, 32), unit(g, n, 32)
    # aligned pairs, as late in training: the positives far above the negatives, ℓ/τ spanning hundreds
    text = F.normalize(image + 0.3 * text, dim=1)
    ref_image = F.normalize(image + 0.5 * unit(g, n, 32), dim=1)
    ref_text = F.normalize(text + 0.5 * unit(g, n, 32), dim=1)
    if autocast:  # what a bf16-autocast model hands the loss
        image, text, ref_image, ref_text = (x.bfloat16() for x in (image, text, ref_image, ref_text))
    image.requires_grad_(), text.requires_grad_()
    logit_scale = torch.tensor(100.0, requires_grad=True)
    options = dict(temperature=0.01)
    if case.startswith('isogclr'):
        options.update(tau_min=0.01)
    if case.startswith('tempnet'):
        options = dict(embed_dim=32)  # its own τ ∈ [0.005, 0.05]
    loss = build(case, num_samples=2 * n, **options)
    for epoch in range(STABILITY_STEPS[case]):  # a second step updates the state at γ < 1
        set_epoch(loss, epoch)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            out = call(loss, image, text, logit_scale, torch.arange(n), ref_image, ref_text)
            total = sum(out.values())
        grads = torch.autograd.grad(total, [image, text, logit_scale], allow_unused=True)
        assert torch.isfinite(total), out
        assert all(torch.isfinite(gr).all() for gr in grads if gr is not None)
        assert grads[0].abs().max() > 0
    for key, value in loss.state_dict().items():
        visited = value[:n] if value.dim() == 1 and value.numel() == 2 * n else value
        assert torch.isfinite(visited).all(), key
    metrics = loss.metrics() if hasattr(loss, 'metrics') else {}
    assert all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize('case', ['adnce', 'isogclr', 'tempnet'])
def test_tiled_aggregate_gives_the_same_loss(case):
    """ADNCE's row-normalised weights stream through the tiled aggregation, per-sample τ's autograd step runs
    through its backward: both give what the untiled core gives."""
    from drrho_openclip.losses.tiled import make_tiled_aggregate
    n = 10
    untiled = build(case, num_samples=n, **(dict(adnce_sigma=0.3) if case == 'adnce' else {}))
    tiled = copy.deepcopy(untiled)
    tiled.aggregate = make_tiled_aggregate(3)
    image, text, ref_image, ref_text = make_batch(4, n, dtype=torch.float64)
    results = []
    for loss in (without_dropout(untiled), without_dropout(tiled)):
        i, t = image.clone().requires_grad_(), text.clone().requires_grad_()
        out = call(loss, i, t, torch.tensor(20.0), torch.arange(n), ref_image, ref_text)['contrastive_loss']
        results.append([out, *torch.autograd.grad(out, [i, t])] + [v for v in loss.state_dict().values()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize('name', list_losses())
def test_whether_a_loss_reads_reference_features_is_what_it_does(name):
    """The registry's answer (which the run's flags check and the benchmarks ask) against the built loss: one that
    reads them refuses a batch without, one that does not trains the same whatever reference it is given."""
    from drrho_openclip.losses import loss_options, reads_reference_features
    own = option_names(name)
    variants = [{}]
    for option, values in (('distill_weight', (0.5,)), ('reference_weight', (0.0,)), ('reference_shift', (True,))):
        if option in own:
            variants += [{**v, option: value} for v in list(variants) for value in values]
    image, text, ref_image, ref_text = make_batch(4, 10)
    spec = get_loss_spec(name)
    run = {k: v for k, v in dict(num_samples=10, embed_dim=image.shape[1]).items() if k in spec.run_options}
    checked = []
    for variant in variants:
        try:
            reads = reads_reference_features(name, loss_options(name, **variant))
            losses = []
            for _ in range(2):
                torch.manual_seed(0)  # the same TempNet initialisation in both
                losses.append(create_loss(name, **variant, **run))
        except ValueError:  # a combination the loss refuses (an option these options leave unread)
            continue
        for loss in losses:
            if hasattr(loss, 'set_total_steps'):
                loss.set_total_steps(100)
        checked.append(reads)
        if reads:
            with pytest.raises(ValueError, match='the batch carries no reference features'):
                call(losses[0], image, text, torch.tensor(20.0), torch.arange(10), None, None)
        else:
            outs = [call(loss, image, text, torch.tensor(20.0), torch.arange(10), *reference)
                    for loss, reference in zip(losses, [(None, None), (ref_image, ref_text)])]
            assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0]), variant
    # both answers where the options decide it: KD, drrho's reference_weight 0, an optional reference shift
    assert set(checked) == ({True} if spec.reference == 'required' and name.startswith('jest') else
                            {False} if spec.reference == 'none' else {True, False}), checked


@pytest.mark.parametrize('tile_size', [0, 4])
def test_a_malformed_batch_is_named_before_anything_is_written(tile_size):
    """An index that is not one integer per row (a boolean mask wrote every sample's u into row 1, a float one was
    cut to integers), or features of different row counts (the dense aggregation failed inside a matrix product)."""
    image, text, ref_image, ref_text = make_batch(4, 8)
    loss = create_loss('drrho', num_samples=16, gamma=0.5, tile_size=tile_size)
    loss.set_total_steps(10)
    before = tables(loss)
    for index, said in ((torch.ones(8, dtype=torch.bool), 'torch.bool of shape (8,)'),
                        (torch.arange(8) + 0.5, 'torch.float32 of shape (8,)'),
                        (torch.arange(8)[None], 'torch.int64 of shape (1, 8)'),
                        (torch.arange(7), 'torch.int64 of shape (7,)'), ([0, 1], 'list')):
        with pytest.raises(ValueError, match=re.escape(f"one entry per row of the batch (8), got {said}")):
            call(loss, image, text, None, index, ref_image, ref_text)
    with pytest.raises(ValueError, match=re.escape("got 8 image_features, 8 text_features, 7 ref_image_features, "
                                                   "8 ref_text_features")):
        call(loss, image, text, None, torch.arange(8), ref_image[:7], ref_text)
    with pytest.raises(ValueError, match=re.escape("got 8 image_features, 6 text_features")):
        call(loss, image, text[:6], None, torch.arange(8), ref_image, ref_text)
    for key, value in tables(loss).items():
        assert torch.equal(value.nan_to_num(-7.0), before[key].nan_to_num(-7.0)), key
