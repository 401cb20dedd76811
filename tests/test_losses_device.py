"""Where the losses compute and in which dtype: `loss.to(device)` moves all of a loss's state and a call runs there
(the sample index may arrive on the host), the collectives refuse a tensor off the features' device, 16-bit
features keep the pairwise products in 16 bits, and the aggregations' backward ignores the caller's autocast."""
import functools
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from drrho_openclip.losses import create_loss, get_loss_spec, list_losses
from drrho_openclip.losses.collectives import all_reduce, gather_batch
from drrho_openclip.losses.dense import dense_aggregate
from drrho_openclip.losses.tiled import make_tiled_aggregate

META = torch.device('meta')  # a device other than the CPU that needs no accelerator: shapes and devices only

# the per-sample and constant state of every kind: u, per-sample τ and its Adam moments, TempNet, a fixed τ buffer
MOVABLE = {
    'drrho': dict(gamma=0.5),
    'drrho-tiled-sharded': dict(gamma=0.5, tile_size=3, state_layout='sharded'),
    'drrho-no-column': dict(gamma=0.5, column_step=False),
    'isogclr': dict(),
    'tempnet': dict(embed_dim=8),
    'adnce': dict(adnce_sigma=0.5),
    'fastclip+kd': dict(distill_weight=0.3),
    # code that ends in a collective, where a tensor made on the host fails on another device: the balanced loss's
    # column weights all-reduced in backward, JEST's chunks gathered to condition the next (two chunks: the first is
    # gathered), the teacher scale of KD and of JEST calibrated on the gathered batch (their default, 'auto')
    'balanced': dict(balance_steps=2, reference_shift=True),
    'clip': dict(),
    'clip+kd': dict(distill_weight=0.4),
    'jest': dict(selection_ratio=0.5, num_chunks=2),
    'jest-topk': dict(selection_ratio=0.5, num_chunks=2),
}
STATELESS = {'balanced', 'clip'}  # no tensors to move: only their call is checked


def loss_name(case):
    """The registered loss of a case: its name up to a '+' (an option) or, if that is not a loss, the first '-'."""
    name = case.split('+')[0]
    return name if name in list_losses() else name.split('-')[0]


def build(case, **extra):
    name = loss_name(case)
    samples = dict(num_samples=16) if get_loss_spec(name).stateful else {}  # only the per-sample losses take it
    loss = create_loss(name, **samples, **MOVABLE[case], **extra)
    if hasattr(loss, 'set_total_steps'):
        loss.set_total_steps(100)  # as a training run does (a learned τ's lr_tau 'auto')
    return loss


def batch(device, n=6, d=8, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    image, text, ref_image, ref_text = (F.normalize(torch.randn(n, d, generator=g), dim=1).to(device)
                                        for _ in range(4))
    return image.requires_grad_(requires_grad), text.requires_grad_(requires_grad), ref_image, ref_text


@pytest.mark.parametrize('case', sorted(MOVABLE))
def test_to_moves_every_table_and_a_call_runs_there(case):
    loss = build(case).to(META)
    tensors = dict(loss.named_buffers()) | dict(loss.named_parameters())
    assert (tensors or case in STATELESS) and all(t.device == META for t in tensors.values()), \
        {k: t.device for k, t in tensors.items()}
    image, text, ref_image, ref_text = batch(META)
    logit_scale = torch.tensor(20.0, device=META, requires_grad=True)
    index = torch.arange(6)  # on the host, as a loader may hand it over: moved once, before any use
    out = loss(image, text, logit_scale, index=index, ref_image_features=ref_image, ref_text_features=ref_text,
               output_dict=True)
    sum(out.values()).backward()
    assert image.grad.device == META and text.grad.device == META
    assert all(t.device == META for t in dict(loss.named_buffers()).values())


class _HostValuesWritten(TorchDispatchMode):
    """Writes of a tensor made on the host into one on the device: on an accelerator, torch copies such a value with
    a blocking copy (a stream synchronisation; `available[pick] = False` is one)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        value = {torch.ops.aten.index_put_: 2, torch.ops.aten.index_put: 2, torch.ops.aten.copy_: 1}.get(
            func.overloadpacket)
        if value is not None and isinstance(args[value], torch.Tensor) and args[value].device.type == 'cpu' \
                and args[0].device != args[value].device:
            self.writes.append(str(func))
        return func(*args, **(kwargs or {}))


# the losses whose forward runs on a CUDA device that FakeTensorMode makes up (the others query the CUDA runtime)
FORWARD_ON_FAKE_CUDA = ['balanced', 'clip', 'clip+kd', 'jest', 'jest-topk']

# A custom autograd.Function on the made-up device, as the losses' products are: a CUDA build of torch 2.6 calls the
# CUDA runtime there and aborts the process where there is no GPU (2.14 does not)
_FAKE_CUDA_PROBE = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

class Product(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a @ b.T

with FakeTensorMode(allow_non_fake_inputs=True):
    features = torch.randn(4, 3, device='cuda', requires_grad=True)
    Product.apply(features, features)
"""


@functools.lru_cache(maxsize=None)
def fake_cuda_runs_autograd_functions() -> bool:
    return subprocess.run([sys.executable, '-c', _FAKE_CUDA_PROBE], capture_output=True).returncode == 0


@pytest.mark.parametrize('case', FORWARD_ON_FAKE_CUDA)
def test_a_step_writes_no_host_value_into_the_device(case, monkeypatch):
    """A forward after the first (which makes the 'auto' choices once) on a made-up CUDA device: torch makes a
    Python scalar written into a CUDA tensor on the host (on the meta device it would not show). JEST wrote each
    chunk's picks so, a stream synchronisation per chunk and step."""
    if not fake_cuda_runs_autograd_functions():
        pytest.skip(f"torch {torch.__version__} aborts in a custom autograd.Function on FakeTensorMode's CUDA device "
                    f"without a GPU: this check runs on the pinned torch, or with a GPU")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from drrho_openclip.losses import passes
    monkeypatch.setattr(passes, 'compiles_for', lambda device: False)  # no Triton to compile for here
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = torch.device('cuda')
        loss = build(case).to(cuda)
        # made there: a CUDA build of torch (2.6) copies a host tensor to the made-up device with a real copy, which
        # fails without a GPU
        image, text, ref_image, ref_text = (F.normalize(torch.randn(6, 8, device=cuda), dim=1) for _ in range(4))
        image.requires_grad_(), text.requires_grad_()
        logit_scale = torch.tensor(20.0, device=cuda, requires_grad=True)
        index = torch.arange(6, device=cuda)
        for step in range(2):
            with _HostValuesWritten() as seen:
                loss(image, text, logit_scale, index=index, ref_image_features=ref_image,
                     ref_text_features=ref_text, output_dict=True)
    assert seen.writes == []


def test_a_loss_left_on_the_host_says_so():
    # not moved: its tables are on the CPU, the features elsewhere (a fixed τ: the table is the first thing read)
    loss = build('drrho', temperature=0.01, learn_temperature=False)
    image, text, ref_image, ref_text = batch(META)
    with pytest.raises(RuntimeError, match=r"per-sample table is on cpu.*loss\.to\('meta'\)"):
        loss(image, text, index=torch.arange(6), ref_image_features=ref_image, ref_text_features=ref_text)
    # τ 'auto' (the loss's own Adam): the learned temperature's buffers are the first to be read
    learned = build('drrho', temperature='auto', temperature_optimizer='loss')
    with pytest.raises(RuntimeError, match=r"learned temperature is on cpu.*loss\.to\('meta'\)"):
        learned(image, text, index=torch.arange(6), ref_image_features=ref_image, ref_text_features=ref_text)


def test_reference_features_off_the_features_device_are_refused():
    loss = build('drrho').to(META)
    image, text, _, _ = batch(META)
    _, _, ref_image, ref_text = batch('cpu')
    with pytest.raises(RuntimeError, match="is on cpu, but the loss computes and communicates on meta"):
        loss(image, text, index=torch.arange(6), ref_image_features=ref_image, ref_text_features=ref_text)


def test_collectives_refuse_a_tensor_off_the_features_device():
    host = torch.zeros(3)
    for with_grad in (False, True):
        with pytest.raises(RuntimeError, match='is on cpu, but the loss computes and communicates on meta'):
            gather_batch(host, 1, with_grad=with_grad, device=META)
    with pytest.raises(RuntimeError, match='is on cpu'):
        all_reduce(host, 1, device=META)
    assert gather_batch(host, 1, with_grad=False, device=torch.device('cpu')) is host


# ---------------------------------------------------------------------------------------------------------------
# 16-bit features: the products in 16 bits (float32 accumulation), the elementwise work in float32
#
# The features are drawn from a grid that bf16 holds exactly, with exact bf16 dot products too (multiples of 1/4 in
# [-1, 1], d = 8: every partial sum is a multiple of 1/16 below 8 in magnitude, 7 significant bits). So whether the
# device's 16-bit product keeps a float32 result (CUDA) or rounds it to bf16 (the CPU), the similarities are the
# float32 path's; what remains is the aggregation's own bf16 roundings: the b×B gradient weights and the
# gradients themselves, 2^-8 relative each, so gradients are compared at 2^-6 of their scale.

AGGREGATIONS = {'dense': dense_aggregate, 'tiled': make_tiled_aggregate(5)}


def grid(g, n, d=8):
    return torch.randint(-4, 5, (n, d), generator=g).float() / 4


def aggregation_inputs(dtype, b=12):
    g = torch.Generator().manual_seed(3)
    image, text, ref_image, ref_text = (grid(g, b).to(dtype) for _ in range(4))
    inv_tau = torch.full((b,), 5.0)  # similarities up to ±8: logits spanning ±80
    return image.requires_grad_(), text.requires_grad_(), (ref_image, ref_text, ref_image, ref_text), inv_tau


def run_aggregation(aggregate, dtype, upcast=False):
    image, text, reference, inv_tau = aggregation_inputs(dtype)
    leaves = (image, text)
    if upcast:  # the same bf16 values, computed in float32
        image, text = image.float(), text.float()
        reference = tuple(r.float() for r in reference)
    log_g = aggregate(image, text, image, text, 0, inv_tau, inv_tau.flip(0), reference)
    upstream = torch.linspace(-1, 2, log_g[0].numel())
    grads = torch.autograd.grad(log_g[0] @ upstream + log_g[1] @ upstream.flip(0), leaves)
    return [*log_g, *grads]


class _ProductDtypes(TorchDispatchMode):
    """The input dtypes of every matrix product dispatched."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('aggregation', sorted(AGGREGATIONS))
def test_bf16_features_multiply_in_bf16_and_match_the_float32_path(aggregation):
    aggregate = AGGREGATIONS[aggregation]
    with _ProductDtypes() as products:
        got = run_aggregation(aggregate, torch.bfloat16)
    assert products.seen and all(set(dtypes) == {torch.bfloat16} for dtypes in products.seen), products.seen
    want = run_aggregation(aggregate, torch.bfloat16, upcast=True)
    log_g_image, log_g_text, grad_image, grad_text = got
    assert log_g_image.dtype == torch.float32 and grad_image.dtype == torch.bfloat16
    for a, b in ((log_g_image, want[0]), (log_g_text, want[1])):  # float32 elementwise work on equal similarities
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
    for a, b in ((grad_image, want[2]), (grad_text, want[3])):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2 ** -6 * b.abs().max().item())


@pytest.mark.parametrize('aggregation', sorted(AGGREGATIONS))
def test_float32_features_multiply_in_float32(aggregation):
    with _ProductDtypes() as products:
        run_aggregation(AGGREGATIONS[aggregation], torch.float32)
    assert products.seen and all(set(dtypes) == {torch.float32} for dtypes in products.seen), products.seen


@pytest.mark.parametrize('column_step', [False, True])
@pytest.mark.parametrize('tile_size', [0, 4])
def test_bf16_loss_is_close_to_the_float32_loss(tile_size, column_step):
    """The whole DRO loss on bf16 features (reference shift, u state, KD) against the same values in float32."""
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        loss = create_loss('drrho', num_samples=16, temperature=0.2, temperature_optimizer='loss', gamma=0.5,
                           tile_size=tile_size, distill_weight=0.25, reference_logit_scale=5.0, column_step=column_step)
        loss.set_total_steps(2)
        g = torch.Generator().manual_seed(4)
        image, text, ref_image, ref_text = (grid(g, 10).to(torch.bfloat16).to(dtype) for _ in range(4))
        image.requires_grad_(), text.requires_grad_()
        for step in range(2):  # the second call reads the u of the first
            loss.set_epoch(step)
            out = loss(image, text, index=torch.arange(10), ref_image_features=ref_image, ref_text_features=ref_text,
                       output_dict=True)
        total = sum(out.values())
        results.append([total, *torch.autograd.grad(total, [image, text]), loss.state.log_u_image[:10]])
    (total, *rest), (want_total, *want_rest) = results
    torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-5)
    for got, want in zip(rest, want_rest):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())


@pytest.mark.parametrize('steps', [1, 2])
def test_balanced_multiplies_16_bit_features_in_16_bit_once(steps):
    """The balanced loss like the DRO core: bf16 features multiply in bf16 (float32 accumulation, balancing in
    float32), close to the float32 path on the same values; one process computes each pairwise matrix once (the text
    rows' similarities are the image rows' transposed): two products forward (the pairs, the reference), two back."""
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        loss = create_loss('balanced', balance_steps=steps, reference_shift=True)
        g = torch.Generator().manual_seed(5)
        image, text, ref_image, ref_text = (grid(g, 10).to(torch.bfloat16).to(dtype) for _ in range(4))
        image.requires_grad_(), text.requires_grad_()
        with _ProductDtypes() as products:
            total = loss(image, text, torch.tensor(5.0), ref_image_features=ref_image, ref_text_features=ref_text)
            grads = torch.autograd.grad(total, [image, text])
        assert len(products.seen) == 4 and all(set(d) == {dtype} for d in products.seen), products.seen
        results.append([total, *grads])
    (total, *grads), (want_total, *want_grads) = results
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())


@pytest.mark.parametrize('name, options', [
    ('drrho', dict(num_samples=16, temperature=0.2, gamma=0.5, distill_weight=0.25, reference_logit_scale=5.0)),
    ('drrho', dict(num_samples=16, temperature=0.2, gamma=0.5, tile_size=4)),
    ('drrho', dict(num_samples=16, temperature=0.2, gamma=0.5, column_step=True)),
    ('balanced', dict(reference_shift=True))])
def test_float32_features_under_16_bit_autocast_multiply_in_16_bit(name, options):
    """On CUDA, autocast runs F.normalize in float32, so OpenCLIP's --precision amp_bf16 hands the loss float32
    features: their products ran in float32 (and were gathered in it), where ClipLoss's run in bf16. Under a bf16
    autocast they now multiply as the same features cast to bf16 do, outside it."""
    results = []
    for autocast in (True, False):
        loss = create_loss(name, **options)
        if hasattr(loss, 'set_total_steps'):
            loss.set_total_steps(2)
        g = torch.Generator().manual_seed(6)
        image, text, ref_image, ref_text = (grid(g, 10) for _ in range(4))
        if not autocast:
            image, text, ref_image, ref_text = (x.bfloat16() for x in (image, text, ref_image, ref_text))
        image.requires_grad_(), text.requires_grad_()
        extra = dict(index=torch.arange(10)) if name == 'drrho' else {}
        with _ProductDtypes() as products, torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            total = loss(image, text, torch.tensor(5.0), ref_image_features=ref_image, ref_text_features=ref_text,
                         **extra)
        grads = torch.autograd.grad(total, [image, text])
        assert (torch.bfloat16, torch.bfloat16) in products.seen
        results.append([products.seen, total, *grads])
    (seen, total, *grads), (want_seen, want_total, *want_grads) = results
    assert seen == want_seen  # KD's products are float32 in both
    assert grads[0].dtype == torch.float32  # the gradient of float32 features is float32
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_float64_features_under_16_bit_autocast_stay_float64():
    """As autocast leaves float64 tensors alone: a float64 check run inside an autocast region computed in bf16."""
    g = torch.Generator().manual_seed(6)
    image, text, ref_image, ref_text = (grid(g, 10).double() for _ in range(4))
    values = []
    for autocast in (True, False):
        loss = create_loss('drrho', num_samples=16, temperature=0.2, temperature_optimizer='loss', gamma=0.5).double()
        loss.set_total_steps(2)
        with _ProductDtypes() as products, torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            values.append(loss(image, text, None, index=torch.arange(10), ref_image_features=ref_image,
                               ref_text_features=ref_text))
        assert products.seen and all(dtypes == (torch.float64, torch.float64) for dtypes in products.seen)
    assert values[0].dtype == torch.float64 and torch.equal(values[0], values[1])


def test_jest_scores_its_selection_in_float32_under_autocast():
    """JEST's chunk scores (log-sum-exps of logits at scale up to 100) ran in autocast's bf16 products, off the
    float32 its selection is written in: bf16 rounds such logits by up to half a nat."""
    loss = create_loss('jest-topk', selection_ratio=0.5, num_chunks=3, reference_logit_scale=100.0)
    g = torch.Generator().manual_seed(7)
    image, text, ref_image, ref_text = (F.normalize(torch.randn(12, 8, generator=g), dim=1) for _ in range(4))
    with _ProductDtypes() as products, torch.autocast('cpu', dtype=torch.bfloat16):
        loss.select(image, text, torch.tensor(50.0), ref_image, ref_text)
    assert products.seen and all(set(d) == {torch.float32} for d in products.seen), products.seen


# ---------------------------------------------------------------------------------------------------------------
# backward inside the caller's autocast region (OpenCLIP calls backward outside it; other loops need not)


@pytest.mark.parametrize('tile_size', [0, 4])
@pytest.mark.parametrize('name, options', [('drrho', dict(gamma=0.5)), ('isogclr', dict()),
                                           ('drrho', dict(gamma=0.5, learn_temperature=True)),
                                           ('drrho', dict(gamma=0.5, column_step=True))])
def test_backward_inside_autocast_equals_backward_outside(name, options, tile_size):
    results = []
    for inside in (False, True):
        loss = create_loss(name, num_samples=16, tile_size=tile_size, **options)
        loss.set_total_steps(1)
        image, text, ref_image, ref_text = batch('cpu', n=10)
        logit_scale = torch.tensor(30.0, requires_grad=True)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            total = loss(image, text, logit_scale, index=torch.arange(10), ref_image_features=ref_image,
                         ref_text_features=ref_text)
            if inside:
                grads = torch.autograd.grad(total, [image, text, logit_scale], allow_unused=True)
        if not inside:
            grads = torch.autograd.grad(total, [image, text, logit_scale], allow_unused=True)
        results.append([total, *(g for g in grads if g is not None)])
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('aggregation', ['untiled', 'tiled'])
@pytest.mark.parametrize('whole_batch', [True, False], ids=['one-process', 'rank-block'])
def test_compiled_passes_equal_the_eager_ones(monkeypatch, whole_batch, aggregation):
    """On CUDA both aggregations run their passes over d compiled by TorchInductor (`passes.fused`). Compiled here
    for the CPU (same graphs, no graph break allowed), they give the eager values and gradients: both directions,
    the reference shift, per-anchor learned τ and ADNCE's log-weights (untiled: evaluated inside the compiled passes,
    computed before them and kept when eager); tiled, with a last tile narrower than the others and the positives
    spread over several tiles."""
    from drrho_openclip.losses import dense, passes
    from drrho_openclip.losses.adnce import adnce_log_weight
    from drrho_openclip.losses.tiled import make_tiled_aggregate
    aggregate = dense.dense_aggregate if aggregation == 'untiled' else make_tiled_aggregate(4)

    def run(fused, compiles):
        monkeypatch.setattr(passes, 'fused', fused)
        monkeypatch.setattr(passes, 'compiles_for', lambda device: compiles)
        image, text, ref_image, ref_text = batch('cpu', n=10, d=8)
        inv_tau = (10 + torch.arange(10.0)).requires_grad_()
        anchors = slice(None) if whole_batch else slice(5, None)
        reference = (ref_image[anchors], ref_text[anchors], ref_image, ref_text)
        out = aggregate(image[anchors], text[anchors], image, text, 0 if whole_batch else 5,
                        inv_tau[anchors], inv_tau[anchors].flip(0), reference, adnce_log_weight(0.1, 0.3))
        upstream = torch.linspace(-1, 2, out[0].numel())
        total = (out[0] * upstream).sum() + (out[1] * upstream.flip(0)).sum()
        return [t.detach() for t in (*out, *torch.autograd.grad(total, (image, text, inv_tau)))]

    eager = run(lambda fn, block: fn, compiles=False)
    compiled = run(lambda fn, block: torch.compile(fn, fullgraph=True), compiles=True)  # fullgraph: no graph break
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('source', ['core-pairs', 'own-product', 'row-blocks'])
def test_compiled_column_step_equals_the_eager_one(monkeypatch, source):
    """The column step's passes (`passes.fused`, compiled on CUDA), compiled here for the CPU, give the eager values
    and gradients: over the dense core's own matrix (one process: both directions, its gradient through the core's
    backward), over one product of its own for both directions, and over rows in blocks (the last one narrower);
    eagerly each pass writes over its own product, and backward computes the gradient of d and of the positives
    from one evaluation, compiled in two functions."""
    from drrho_openclip.losses import passes
    from drrho_openclip.losses.columns import column_step
    from drrho_openclip.losses.dense import dense_aggregate

    def run(fused, compiles):
        monkeypatch.setattr(passes, 'fused', fused)
        monkeypatch.setattr(passes, 'compiles_for', lambda device: compiles)
        image, text, ref_image, ref_text = batch('cpu', n=10, d=8)
        shift = (ref_image, ref_text, ref_image, ref_text)
        pairs = None
        if source == 'core-pairs':
            pairs = dense_aggregate(image, text, image, text, 0, 10.0, 5.0, shift, keep_pairs=True)[2]
        log_u = torch.linspace(-1.0, 1.0, 10)
        out = column_step(image, text, image, text, shift, torch.tensor(0.1), torch.tensor(0.2), log_u, log_u.flip(0),
                          math.log(1e-3), 1, rows=4 if source == 'row-blocks' else 0, pairs=pairs)
        total = (out * torch.linspace(-1.0, 2.0, 10)).sum()
        return [out.detach(), *torch.autograd.grad(total, (image, text))]

    eager = run(lambda fn, block: fn, compiles=False)
    compiled = run(lambda fn, block: torch.compile(fn, fullgraph=True), compiles=True)  # fullgraph: no graph break
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('steps', [1, 2, 3, 4])
@pytest.mark.parametrize('whole_batch', [True, False], ids=['one-process', 'rank-block'])
def test_compiled_balancing_equals_the_eager_one(monkeypatch, whole_batch, steps):
    """The balanced loss's passes over its b×N matrix, compiled on CUDA like the DRO core's: compiled here for the CPU
    (no graph break allowed), the values, first normalisers and gradients in d and 1/τ equal the eager ones; one
    process's two branches on one matrix and its transpose, and a block of rows whose positives sit at an offset."""
    from drrho_openclip.losses import balanced, passes

    def run(fused):
        monkeypatch.setattr(passes, 'fused', fused)
        d = torch.randn(10, 10, generator=torch.Generator().manual_seed(steps)).requires_grad_()
        inv_tau = torch.tensor(3.0, requires_grad=True)
        rows, offset = (d, 0) if whole_batch else (d[5:], 5)
        out = balanced.balance_at_positives(rows, inv_tau, steps, offset=offset, transposed=whole_batch)
        values = out[0::2]
        total = sum((value * torch.linspace(-1, 2, value.numel()) ** (n + 1)).sum() for n, value in enumerate(values))
        return [t.detach() for t in (*out, *torch.autograd.grad(total, (d, inv_tau)))]

    eager = run(lambda fn, block: fn)
    torch._dynamo.reset()  # a run compiles each pass once per direction and role: count this case's alone
    compiled = run(lambda fn, block: torch.compile(fn, fullgraph=True))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_passes_compile_only_where_triton_can(monkeypatch):
    """The aggregations compile their passes on CUDA GPUs that Triton supports and run them eagerly elsewhere, with
    a warning on a GPU too old for Triton rather than a failed compilation at the first training step, and eagerly
    everywhere when `TORCH_COMPILE_DISABLE=1` turns compilation off."""
    import importlib.util
    from drrho_openclip.losses import passes
    gpu = torch.device('cuda', 0)

    def on(capability, triton_installed):
        passes.compiles_for.cache_clear()
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device: capability)
        monkeypatch.setattr(importlib.util, 'find_spec', lambda name: object() if triton_installed else None)
        return passes.compiles_for(gpu)

    try:
        assert not passes.compiles_for(torch.device('cpu'))
        assert on((9, 0), True) and on((7, 0), True)
        with pytest.warns(UserWarning, match='compute capability 7.0 or more, this GPU has 6.0'):
            assert not on((6, 0), True)
        with pytest.warns(UserWarning, match='Triton is not installed'):
            assert not on((8, 0), False)
        monkeypatch.setenv('TORCH_COMPILE_DISABLE', '1')  # compilation turned off: the eager choices throughout
        assert not on((9, 0), True)
    finally:
        passes.compiles_for.cache_clear()
