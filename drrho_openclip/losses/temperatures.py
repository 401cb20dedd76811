"""Every temperature source of the DRO core: a fixed τ, a global τ learned by the loss's own Adam (started from a
given value or chosen from the first batch), the model's learnable global τ (1/logit_scale), one τ per sample
(iSogCLR / FastCLIP-v2) and a temperature network (TempNet).

A source is called as `source(logit_scale=..., index=..., image_features=..., text_features=..., reference=...)`
(`reference`: the core's (ref_image, ref_text, all_ref_image, all_ref_text) or None) and returns
(τ of the image anchors, τ of the text anchors), each 0-dim or one per anchor; the core casts them to its
elementwise dtype on the features' device. The last two give one τ per anchor and direction, and both are learned
from the τ-gradient of the core's per-anchor objective,

    G_i = ∂(τ_i F_i + ρ τ_i)/∂τ_i = log(ε + u_i) − Σ_{j≠i} w_ij ℓ̂_ij / τ_i / (B−1) + ρ,
    w_ij = exp(ℓ̂_ij/τ_i) / (ε + u_i),

which the core's surrogate carries (`core.sogclr_estimate`): the table by its own Adam step, TempNet by autograd.

The KL-DRO reading that chooses τ and ρ: an anchor's weights p_ij ∝ exp(ℓ̂_ij/τ) over its B − 1 negatives have an
effective number n_eff = exp(entropy) = (B − 1)·exp(−KL(p ‖ uniform)), and G above (ε aside) is ρ − KL: a learned
τ settles where the anchors' KL is ρ. One number, the target effective negatives per anchor k, therefore sets both
the τ to start from (`temperature_for_effective_negatives`) and ρ = log((B − 1)/k) (`rho_for_batch`).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import KeepsStatePrecision, keyed_uniform
from .collectives import all_reduce, check_device, run_log
from .precision import at_least_float32
from .state import SampleSharding


class FixedTemperature(KeepsStatePrecision, nn.Module):
    """A constant τ (the paper's main DRRho-CLIP setting is 0.01: `drrho-paper`); ignores the model's logit_scale."""

    def __init__(self, tau: float):
        super().__init__()
        if tau <= 0:
            raise ValueError(f"temperature must be > 0, got {tau}")
        # a buffer, so that loss.to(device) puts it beside the features (no host-to-device copy per call); not in
        # the state_dict: it is the configuration's, not the run's
        self.register_buffer('value', torch.tensor(tau, dtype=torch.float64), persistent=False)

    def forward(self, **_):
        return self.value, self.value


class LogitScaleTemperature(nn.Module):
    """The model's learnable global τ = 1 / logit_scale (OpenCLIP's parameter, optimised with the model)."""

    def forward(self, logit_scale=None, **_):
        if logit_scale is None:
            raise ValueError("a learnable temperature needs the model's logit_scale")
        tau = 1.0 / at_least_float32(logit_scale)
        return tau, tau


# At most this many anchors per direction (the first of the global batch, the same on every rank) choose what is
# chosen from the first batch (an 'auto' τ, an 'auto' teacher scale): their median is as good as all B anchors', and
# the [2r, B] similarities stay small at a batch of 32k (128 MiB)
CHOICE_ANCHORS = 512


def first_anchor_similarities(ref_image: torch.Tensor, ref_text: torch.Tensor, max_anchors: int = None):
    """([2r, B] float64 similarities of the first r = min(B, max_anchors) image anchors to every text, then of the
    first r text anchors to every image; r)."""
    ref_image, ref_text = ref_image.double(), ref_text.double()
    anchors = ref_image.shape[0] if max_anchors is None else min(ref_image.shape[0], max_anchors)
    return torch.cat([ref_image[:anchors] @ ref_text.T, ref_text[:anchors] @ ref_image.T]), anchors


def reference_margins(ref_image: torch.Tensor, ref_text: torch.Tensor, max_anchors: int = None) -> torch.Tensor:
    """[2r, B − 1] margins m_ij = s^ref_ii − s^ref_ij of the first r = min(B, max_anchors) anchors of a batch over
    their B − 1 negatives (image anchors, then text anchors), in float64. At the start of training the learner's
    similarities carry nothing, so the RHO-shifted loss is ℓ̂_ij ≈ m_ij and an anchor's DRO weights are
    softmax_j(m_ij/τ)."""
    sim, anchors = first_anchor_similarities(ref_image, ref_text, max_anchors)
    batch = sim.shape[1]
    # anchor i's negatives are the columns j ≠ i: slot t holds column t, or t + 1 from the positive on (a gather, not
    # a boolean mask, so that no device has to synchronise on the number of selected entries)
    slots = torch.arange(batch - 1, device=sim.device)[None, :]
    columns = slots + (slots >= torch.arange(anchors, device=sim.device)[:, None]).repeat(2, 1)
    positives = torch.cat([sim[:anchors].diagonal(), sim[anchors:].diagonal()])
    return positives[:, None] - sim.gather(1, columns)


def effective_negatives(margins: torch.Tensor, tau) -> torch.Tensor:
    """Per anchor (row), exp(entropy) of the weights softmax_j(m_ij/τ): between 1 and the row's length."""
    log_p = torch.log_softmax(margins / tau, dim=1)
    return torch.exp(-(log_p.exp() * log_p).sum(dim=1))


def log_bisection(past, low: float, high: float, device, iterations: int = 40):
    """Bisection in log x over [low, high] for the point where the monotone test `past(x)` (a 0-dim bool tensor:
    x is at or beyond the point) turns true, on `device` without a host synchronisation (the tests stay tensors).
    Returns the final bracket (log low, log high) as 0-dim float64 tensors."""
    low_log = torch.tensor(math.log(low), dtype=torch.float64, device=device)
    high_log = torch.tensor(math.log(high), dtype=torch.float64, device=device)
    for _ in range(iterations):
        middle = (low_log + high_log) / 2
        beyond = past(middle.exp())
        low_log, high_log = torch.where(beyond, low_log, middle), torch.where(beyond, middle, high_log)
    return low_log, high_log


def temperature_for_effective_negatives(margins: torch.Tensor, target: float, tau_min: float, tau_max: float,
                                        iterations: int = 40) -> torch.Tensor:
    """The τ in [tau_min, tau_max] at which the median anchor (row of `margins`) has `target` effective negatives,
    as a 0-dim float64 tensor: a bisection in log τ (n_eff grows with τ), on the margins' device without a host
    synchronisation. tau_max if even it spreads the median anchor over fewer, tau_min if that spreads it over more."""
    _, high = log_bisection(lambda tau: effective_negatives(margins, tau).median() >= target, tau_min, tau_max,
                            margins.device, iterations)
    return high.exp()


def check_target_negatives(target_negatives: float) -> float:
    """The k of ρ from the batch and of an 'auto' τ, refused where no anchor could rest on it."""
    if not target_negatives >= 1:
        raise ValueError(f"target_negatives must be ≥ 1 (an anchor has at least one negative), got "
                         f"{target_negatives}")
    return target_negatives


def rho_for_batch(batch_size: int, target_negatives: float) -> float:
    """ρ = log((B − 1)/k): a learned τ settles where the anchors' KL(p ‖ uniform) is ρ, i.e. where they spread their
    weight over k = (B − 1)·e^(−ρ) effective negatives (0 when the batch has no more than k negatives)."""
    return max(0.0, math.log((batch_size - 1) / target_negatives))


def adam_moments(m, v, grad, beta1: float, beta2: float):
    """Adam's first and second moments after `grad`. A NaN moment (no step yet) starts at grad and grad², which
    leaves them unbiased without Adam's step-count correction."""
    m = torch.where(torch.isnan(m), grad, beta1 * m + (1 - beta1) * grad)
    v = torch.where(torch.isnan(v), grad ** 2, beta2 * v + (1 - beta2) * grad ** 2)
    return m, v


class LearnedTemperature(KeepsStatePrecision, nn.Module):
    """A global τ learned by the loss's own Adam on log τ, with its own learning rate: the official code gives the
    model's logit_scale (= −log τ) a parameter group of its own (--lr_tau), where Adam takes these same steps; here
    the model's learning rate and schedule, which leave τ near its start for hundreds of steps, play no part.

    τ starts at `tau_init`, or, with `tau_init=None` ('auto'), at the first training call's
    `temperature_for_effective_negatives` of the global batch's reference margins for `target_negatives`: every
    rank computes it from the same gathered features, so every rank starts from the same τ. Once per optimiser step
    the core calls `step(objective)` with the batch's per-anchor objective: the SogCLR estimate with each sample's u
    (the paper's), or with `steps_on_batch` its mini-batch form, u = g (see the core).
    G = ∂ mean(objective)/∂ log τ by autograd on the leaf `forward` handed out, averaged over ranks (one scalar
    all-reduce), then

        m ← β1 m + (1−β1) G,   v ← β2 v + (1−β2) G²,   log τ ← clip(log τ − lr · m / (√v + eps), log τ_min, log τ_max)

    so log τ moves by about lr per step: at most lr while G keeps its size, more while |G| grows, as √v lags (on
    average 1.25–2 × lr over runs of 64 to 192 steps, where G grows like 1/τ as τ falls). With `lr=None` ('auto')
    the lr is 1/(the run's optimiser steps), from `set_total_steps`: the SogCLR estimate's u lags g while the model
    improves, which keeps pushing τ down by about lr per step, so a fixed lr lets a long run end at tau_min
    (0.07 → 0.001 in 720 steps at lr 0.01), while 1/steps keeps the whole run's change of log τ at about 1–2, however
    long the run. m and v start at the first G and G² (NaN marks "no step yet"), as the per-sample τ's do; log τ is
    NaN until an 'auto' τ is chosen. All three are buffers: checkpoints, resume and `loss.to(device)` carry them.
    """

    def __init__(self, tau_init, tau_min: float, tau_max: float, lr, target_negatives: float = 8,
                 world_size: int = 1, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 steps_on_batch: bool = False):
        super().__init__()
        bounded = tau_init is None or lr != 0  # a given τ never stepped is never clamped: its bounds go unread
        if bounded and (not 0 < tau_min <= tau_max or (tau_init is not None and not tau_min <= tau_init <= tau_max)):
            raise ValueError(f"need 0 < tau_min ≤ temperature ≤ tau_max, got {tau_min}, {tau_init}, {tau_max}")
        if lr is not None and lr < 0:
            raise ValueError(f"the temperature's learning rate lr_tau must be ≥ 0, got {lr}")
        self.tau_min, self.tau_max, self.lr = tau_min, tau_max, lr
        self.target_negatives = check_target_negatives(target_negatives)
        self.auto_lr = lr is None  # set from the run's length by set_total_steps
        self.world_size = world_size
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.steps_on_batch = steps_on_batch
        log_tau = float('nan') if tau_init is None else math.log(tau_init)
        self.register_buffer('log_tau', torch.tensor(log_tau, dtype=torch.float64))
        self.register_buffer('exp_avg', torch.tensor(float('nan'), dtype=torch.float64))
        self.register_buffer('exp_avg_sq', torch.tensor(float('nan'), dtype=torch.float64))
        self._chosen = tau_init is not None  # a host-side copy of "log τ is set": no device read per call
        self._leaf = None  # the log τ handed out by the last forward, whose gradient step() reads

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._chosen = not torch.isnan(self.log_tau).item()

    def set_total_steps(self, total_steps: int) -> Optional[float]:
        """The run's number of optimiser steps: an lr of None ('auto') becomes 1/total_steps, so that log τ moves by
        about 1–2 over the whole run, however long (a given lr is kept). Returns the lr it set, None if it kept one."""
        if total_steps < 1:
            raise ValueError(f"a training run has at least one optimiser step, got {total_steps}")
        if not self.auto_lr:
            return None
        self.lr = 1.0 / total_steps
        return self.lr

    def _choose(self, reference) -> torch.Tensor:
        """The 'auto' τ of this batch's reference margins."""
        if reference is None:
            raise ValueError("temperature 'auto' is chosen from the reference margins of the first batch, and "
                             "this batch carries no reference features")
        with torch.no_grad():
            margins = reference_margins(reference[2], reference[3], CHOICE_ANCHORS)
            return temperature_for_effective_negatives(margins, self.target_negatives, self.tau_min, self.tau_max)

    def forward(self, image_features=None, reference=None, **_):
        check_device(self.log_tau, image_features.device, 'the learned temperature')
        if not self.training:  # evaluation learns nothing: an 'auto' τ not chosen yet is this batch's, not kept
            tau = self.log_tau.exp() if self._chosen else self._choose(reference)
            return tau, tau
        if self.lr is None:
            raise RuntimeError("lr_tau 'auto' is 1/(the run's number of optimiser steps), which this loss has not "
                               "been told: call loss.set_total_steps(n) before training, or give lr_tau a number")
        if not self._chosen:
            tau = self._choose(reference)
            self.log_tau.copy_(tau.log())
            self._chosen = True
            # once per run: the τ it starts from is otherwise seen only in the first logged step's metrics
            start = tau.item()
            if start <= self.tau_min * 1.001:  # at any τ the anchors spread over more: margins (near) zero
                run_log.warning(f"drrho-openclip: temperature 'auto' starts at its lower bound τ = {start:.4g}: the "
                                f"first batch's reference margins are too small to give an anchor as few as "
                                f"{self.target_negatives:g} effective negatives at any τ (a reference that scores "
                                f"every pair alike?); give --temperature a number")
            elif start >= self.tau_max / 1.001:  # at any τ fewer: B − 1 ≤ k
                run_log.warning(f"drrho-openclip: temperature 'auto' starts at its upper bound τ = {start:.4g}: even "
                                f"there the first batch's median anchor has fewer than {self.target_negatives:g} "
                                f"effective negatives (a global batch of B has B − 1 negatives); give --temperature a "
                                f"number, or a smaller --target-negatives")
            else:
                run_log.info(f"drrho-openclip: temperature 'auto' starts at τ = {start:.4g}: the reference shift "
                             f"alone gives the first batch's median anchor {self.target_negatives:g} effective "
                             f"negatives")
        if self.lr == 0:
            tau = self.log_tau.exp()
        else:
            self._leaf = self.log_tau.clone().requires_grad_()
            tau = self._leaf.exp()
        return tau, tau

    def step(self, objective: torch.Tensor):
        """One Adam step on log τ; `objective` holds the per-anchor terms of the last call (this rank's anchors)."""
        if self.lr == 0:
            return
        if not objective.requires_grad:
            raise RuntimeError("a learned temperature learns from the loss's gradient: call the loss with gradients "
                               "enabled, or put it in eval mode (loss.eval()) to score a batch without learning")
        grad, = torch.autograd.grad(objective.mean(), self._leaf, retain_graph=True)
        self._leaf = None
        # the mean over ranks of their anchors' means: the gradient of the global batch's mean objective
        grad = all_reduce(grad.detach().clone(), self.world_size, objective.device) / self.world_size
        with torch.no_grad():
            m, v = adam_moments(self.exp_avg, self.exp_avg_sq, grad.to(self.log_tau), self.beta1, self.beta2)
            log_tau = (self.log_tau - self.lr * m / (v.sqrt() + self.eps)).clamp(math.log(self.tau_min),
                                                                                 math.log(self.tau_max))
            # a batch with a non-finite value (an fp16 overflow, a broken sample) skips the step, as GradScaler
            # skips the model's: stepped, τ and its moments would stay NaN for the rest of the run
            finite = torch.isfinite(grad)
            for state, new in ((self.exp_avg, m), (self.exp_avg_sq, v), (self.log_tau, log_tau)):
                state.copy_(torch.where(finite, new, state))


class PerSampleTemperature(KeepsStatePrecision, nn.Module):
    """iSogCLR's learnable τ_i for every sample, for image anchors and text anchors separately.

    The tables are buffers (saved by loss.state_dict()), laid out like u (`sharding`: replicated on every rank by
    default, or each rank's block), and learned outside the model's optimiser: once per optimiser step the core
    calls `step(objective)`, which takes G_i by autograd on the leaf rows that `forward` handed out, and applies a
    per-sample Adam step

        m_i ← β1 m_i + (1−β1) G_i,   v_i ← β2 v_i + (1−β2) G_i²,
        τ_i ← clip(τ_i − lr · m_i / (√v_i + eps), τ_min, τ_max).

    m and v start at a sample's first G and G² (NaN marks an unvisited sample), which leaves them unbiased without
    Adam's step-count correction (the official code's substitute, (epoch+1), assumes one visit per epoch).
    """

    per_sample_tables = tuple(f'{name}_{side}' for side in ('image', 'text') for name in ('tau', 'exp_avg',
                                                                                           'exp_avg_sq'))

    def __init__(self, sharding: SampleSharding, tau_init: float, tau_min: float, tau_max: float, lr: float,
                 beta1: float, beta2: float, eps: float):
        super().__init__()
        if lr < 0:
            raise ValueError(f"the per-sample τ's learning rate lr_tau must be ≥ 0, got {lr}")
        if lr != 0 and not 0 < tau_min <= tau_init <= tau_max:  # τ's never stepped are never clamped
            raise ValueError(f"need 0 < tau_min ≤ temperature ≤ tau_max, got {tau_min}, {tau_init}, {tau_max}")
        if lr != 0 and (eps <= 0 or not (0 <= beta1 < 1 and 0 <= beta2 < 1)):
            raise ValueError(f"the per-sample τ's Adam needs tau_eps > 0 and tau_beta1, tau_beta2 in [0, 1), got "
                             f"{eps}, {beta1}, {beta2}")
        self.sharding = sharding
        self.tau_min, self.tau_max, self.lr = tau_min, tau_max, lr
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        for side in ('image', 'text'):
            self.register_buffer(f'tau_{side}', self.sharding.table(tau_init))
            self.register_buffer(f'exp_avg_{side}', self.sharding.table(float('nan')))
            self.register_buffer(f'exp_avg_sq_{side}', self.sharding.table(float('nan')))
        self._rows = None  # (index, τ_image rows, τ_text rows, the rows of m and v) handed out by the last forward

    def _tables(self):
        return [getattr(self, name) for name in self.per_sample_tables]

    def forward(self, index=None, image_features=None, **_):
        if index is None:
            raise ValueError("per-sample temperatures need the batch's sample `index`")
        # τ, m and v of the batch's rows in one read (one exchange when sharded); m and v are used in step()
        tau_image, m_image, v_image, tau_text, m_text, v_text = self.sharding.read(self._tables(), index,
                                                                                   image_features.device)
        if not self.training:  # evaluation: the samples' τ as they are, no step to take
            return tau_image, tau_text
        # leaves: the loss's gradient wrt them is G, read in step()
        self._rows = (index, tau_image.clone().requires_grad_(), tau_text.clone().requires_grad_(),
                      (m_image, v_image), (m_text, v_text))
        return self._rows[1], self._rows[2]

    def _adam(self, moments, tau, grad):
        old = [tau.to(grad), *(x.to(grad) for x in moments)]
        m, v = adam_moments(old[1], old[2], grad, self.beta1, self.beta2)
        new = [(old[0] - self.lr * m / (v.sqrt() + self.eps)).clamp(self.tau_min, self.tau_max), m, v]
        # a sample whose G is not finite (a broken sample, an fp16 overflow) keeps its τ_i, m_i and v_i: stepped,
        # they would stay NaN, and so would its loss at every later visit
        finite = torch.isfinite(grad)
        return [torch.where(finite, n, o) for n, o in zip(new, old)]

    def step(self, objective: torch.Tensor):
        """One Adam step on the rows of the last forward; `objective` holds the per-anchor terms of that call."""
        if not objective.requires_grad:
            raise RuntimeError("per-sample temperatures learn from the loss's gradient: call the loss with "
                               "gradients enabled, or put it in eval mode (loss.eval()) to score a batch without "
                               "learning")
        index, tau_image, tau_text, moments_image, moments_text = self._rows
        grads = torch.autograd.grad(objective.sum(), (tau_image, tau_text), retain_graph=True)
        with torch.no_grad():
            new = self._adam(moments_image, tau_image, grads[0]) + self._adam(moments_text, tau_text, grads[1])
            self.sharding.write(self._tables(), index, new)
        self._rows = None


def sample_keyed_dropout(x: torch.Tensor, index: torch.Tensor, epoch: int, p: float) -> torch.Tensor:
    """Dropout whose mask is a hash of (sample index, epoch, unit): a sample gets the same mask whichever rank,
    step or restart draws it, so a resumed run, or one with another world size, trains exactly alike."""
    if p == 0:
        return x
    units = torch.arange(x.shape[1], device=x.device)
    uniform = keyed_uniform(index.to(x.device, torch.int64)[:, None] * 1_000_003 + epoch * 7_919
                            + units[None, :] * 104_729)
    return x * (uniform >= p).to(x.dtype) / (1 - p)


class TempNet(nn.Module):
    """TempNet for CLIP embeddings (Qiu et al., 2024; tempnet.md §2.2): τ(e) ∈ [τ_min, τ_max] of an embedding,
    built after the optimal τ of Lemma 5.1 (attention pooling minus mean pooling of the logits):

        x = dropout(sigmoid(W e + b)),   ŝ = P̄ x (unit-norm prototypes),   ω = softmax(ŝ / exp(κ)),
        z = Σ_j a_j (ω_j − 1/M) sigmoid(ŝ_j) + c,   τ = τ_min + (τ_max − τ_min) sigmoid(z).
    """

    def __init__(self, embed_dim: int, *, tau_min: float, tau_max: float, width: int = 256, prototypes: int = 256,
                 dropout: float = 0.5):
        super().__init__()
        if not 0 < tau_min < tau_max:
            raise ValueError(f"need 0 < tau_min < tau_max, got {tau_min}, {tau_max}")
        if width < 1 or prototypes < 1:
            raise ValueError(f"tempnet_width and tempnet_prototypes must be at least 1, got {width} and {prototypes}")
        self.tau_min, self.tau_max = tau_min, tau_max
        self.transform = nn.Linear(embed_dim, width)
        self.dropout = dropout
        self.prototypes = nn.Parameter(torch.randn(prototypes, width))
        self.log_pool_temperature = nn.Parameter(torch.tensor(math.log(0.01)))  # κ
        self.pool = nn.Linear(prototypes, 1)  # a and c, initialised to 1 and 0
        nn.init.ones_(self.pool.weight)
        nn.init.zeros_(self.pool.bias)

    def forward(self, embeddings: torch.Tensor, index: torch.Tensor = None, epoch: int = 0) -> torch.Tensor:
        # in the network's own dtype (a pure-bf16 model makes it bf16); the loss casts τ back to its compute dtype
        x = torch.sigmoid(self.transform(embeddings.to(self.transform.weight.dtype)))
        if self.training and self.dropout:
            if index is None:
                raise ValueError("TempNet's dropout is keyed by the batch's sample `index`, which is missing")
            x = sample_keyed_dropout(x, index, epoch, self.dropout)
        logits = x @ F.normalize(self.prototypes, dim=1).T
        attention = torch.softmax(logits / self.log_pool_temperature.exp(), dim=1)
        z = self.pool((attention - 1 / logits.shape[1]) * torch.sigmoid(logits)).squeeze(1)
        return self.tau_min + (self.tau_max - self.tau_min) * torch.sigmoid(z)


class TempNetTemperature(nn.Module):
    """Two TempNets, for image anchors and text anchors, fed the detached features: the encoders learn from τ's
    value only, the TempNets from the DRO objective's τ-gradient (the paper's stop-gradient)."""

    def __init__(self, embed_dim: int, **tempnet_options):
        super().__init__()
        self.image = TempNet(embed_dim, **tempnet_options)
        self.text = TempNet(embed_dim, **tempnet_options)
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def forward(self, image_features=None, text_features=None, index=None, **_):
        # the text network's masks differ from the image network's: another epoch key
        return (self.image(image_features.detach(), index, 2 * self.epoch),
                self.text(text_features.detach(), index, 2 * self.epoch + 1))


# the names of a loss's modules attached to a model start with this (a model's state_dict keys too)
ATTACHED_PREFIX = 'loss_'


def attach_to_model(model: nn.Module, loss: nn.Module) -> list:
    """Make the loss's learnable submodules (TempNet's) submodules of `model`, named `loss_<name>`, so that
    OpenCLIP's optimiser, DDP and checkpoints (model.state_dict()) include them. Call it before the optimiser is
    built, before DDP wraps the model and before a checkpoint is loaded. Returns the names it attached."""
    names = attached_names(loss)
    for name in names:
        model.add_module(name, getattr(loss, name.removeprefix(ATTACHED_PREFIX)))
    return names


def attached_names(loss: nn.Module) -> list:
    """The names under which `attach_to_model` attaches the loss's learnable submodules to the model."""
    return [ATTACHED_PREFIX + name for name, module in loss.named_children()
            if any(p.requires_grad for p in module.parameters())]
