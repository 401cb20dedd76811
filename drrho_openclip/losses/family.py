"""The named losses: each is a thin composition of the DRO core, or a small module of its own where the method
is not a DRO over negatives (balancing, batch selection)."""
from .adnce import adnce_log_weight
from .balanced import BalancedClipLoss
from .clip import ClipLoss
from .core import DROContrastiveLoss
from .jest import JESTLoss
from .mobileclip import MobileClipLoss
from .registry import DISTRIBUTED, register_loss
from .state import MovingAverageState, SampleSharding, resolve_state_layout
from .temperatures import FixedTemperature, LogitScaleTemperature, PerSampleTemperature, TempNetTemperature
from .tiled import make_tiled_aggregate

# The run options (registry.py) of the losses with per-sample state, and of those with CLIP's loss
STATEFUL = ('num_samples', *DISTRIBUTED)
CLIP = (*DISTRIBUTED, 'local_loss', 'gather_with_grad')

# The options of a DRO loss with a global τ (the per-loss defaults below override them with the paper's values)
DRO_OPTIONS = dict(
    temperature=0.07,          # τ, fixed or initial
    learn_temperature=False,   # τ learned through the model's logit_scale
    rho=0.0,                   # ρ of the KL-constrained DRO (with a learned τ)
    epsilon=1e-14,             # ε in log(ε + g)
    gamma=0.8,                 # SogCLR's final inner learning rate γ_min (1 = no per-sample state)
    gamma_decay_epochs=1,      # epochs of the cosine decay of γ from 1 to γ_min
    tile_size=0,               # columns per tile of the tiled core (memory linear in the batch); 0: untiled
    state_layout='auto',       # per-sample tables replicated on every rank or sharded (auto: by their size)
)
# Losses with their own temperature source keep the estimator's options only
ESTIMATOR_OPTIONS = {k: DRO_OPTIONS[k] for k in ('rho', 'epsilon', 'gamma', 'gamma_decay_epochs', 'tile_size',
                                                  'state_layout')}

# MobileCLIP-style distillation from the reference model (seed 001 Eq. 12, 16), for clip, fastclip and drrho
DISTILL_OPTIONS = dict(
    distill_weight=0.0,           # λ: (1−λ)·contrastive + λ·KD; the paper's λ is 0 with the weak ViT-B/32 reference
    reference_logit_scale=100.0,  # the teacher's (reference model's) logit scale in KD, and JEST's
)


def _temperature(o):
    return LogitScaleTemperature() if o.learn_temperature else FixedTemperature(o.temperature)


def _keeps_state(o) -> bool:
    if not 0 < o.gamma <= 1:
        raise ValueError(f"gamma (γ) must be in (0, 1], got {o.gamma}")
    return o.gamma < 1  # γ = 1 means u is always the mini-batch estimate: no table at all


def _sharding(o, per_sample_temperature=False):
    """The layout of the loss's per-sample tables, or None when it keeps none (then state_layout must be 'auto')."""
    layout = resolve_state_layout(o.state_layout, o.num_samples, o.world_size)
    if not (_keeps_state(o) or per_sample_temperature):
        if o.state_layout != 'auto':
            raise ValueError(f"state_layout '{o.state_layout}' has nothing to lay out: with gamma = 1 this loss "
                             f"keeps no per-sample state")
        return None
    return SampleSharding(o.num_samples, o.rank, o.world_size, layout)  # raises without the dataset size


def _state(o, sharding):
    if not _keeps_state(o):
        return None
    return MovingAverageState(o.gamma, o.gamma_decay_epochs, sharding)


def _dro(o, use_reference, temperature=None, rho=None, sharding=None, **core_options):
    """The core with the common options; `temperature` and `rho` default to the global τ (ρ only when learned)."""
    if temperature is None:
        temperature = _temperature(o)
        rho = o.rho if o.learn_temperature else 0.0
    if o.tile_size < 0:
        raise ValueError(f"tile_size must be ≥ 0 (0: untiled), got {o.tile_size}")
    if o.tile_size:
        core_options['aggregate'] = make_tiled_aggregate(o.tile_size)
    if sharding is None:
        sharding = _sharding(o)
    return DROContrastiveLoss(
        temperature, getattr(o, 'epsilon', None), rho=rho, state=_state(o, sharding), use_reference=use_reference,
        rank=o.rank, world_size=o.world_size, distill_weight=getattr(o, 'distill_weight', 0.0),
        teacher_logit_scale=getattr(o, 'reference_logit_scale', 100.0), **core_options)


@register_loss('clip', reference='optional', defaults=DISTILL_OPTIONS, run_options=CLIP,
               help="OpenCLIP's mini-batch contrastive loss (its own ClipLoss, unchanged); with distill_weight > 0, "
                    "MobileCLIP: (1−λ) CLIP + λ KD from the reference model")
def clip(o):
    options = dict(local_loss=o.local_loss, gather_with_grad=o.gather_with_grad, rank=o.rank, world_size=o.world_size)
    if o.distill_weight:
        return MobileClipLoss(o.distill_weight, o.reference_logit_scale, **options)
    return ClipLoss(**options)


@register_loss(
    'drrho', reference='required', stateful=True, run_options=STATEFUL,
    help="DRRho-CLIP: KL-DRO over the RHO-shifted pairwise loss, SogCLR estimator (Wei et al., 2025); "
         "with distill_weight > 0, plus KD from the reference model",
    defaults=dict(DRO_OPTIONS, temperature=0.01, epsilon=1e-4, rho=8.5, **DISTILL_OPTIONS))
def drrho(o):
    return _dro(o, use_reference=True)


@register_loss(
    'sogclr', stateful=True, run_options=STATEFUL,
    help="SogCLR / FastCLIP-v1: global contrastive loss, fixed τ, per-sample u with γ",
    defaults=DRO_OPTIONS)
def sogclr(o):
    return _dro(o, use_reference=False)


@register_loss(
    'fastclip', reference='optional', stateful=True, run_options=STATEFUL,
    help="FastCLIP-v3: global contrastive loss with the model's learnable τ and the KL-constraint ρ (Wei et al., "
         "2024); with distill_weight > 0, plus KD from the reference model (the contrastive part is not shifted)",
    # the paper's CC12M / ViT-B/32 setting
    defaults=dict(DRO_OPTIONS, learn_temperature=True, temperature=0.07, rho=8.5, gamma=0.2, gamma_decay_epochs=16,
                  **DISTILL_OPTIONS))
def fastclip(o):
    if not o.learn_temperature:
        raise ValueError("fastclip learns τ (the model's logit_scale); for a fixed τ use the loss sogclr")
    return _dro(o, use_reference=False)


@register_loss(
    'isogclr', stateful=True, run_options=STATEFUL,
    help="FastCLIP-v2 / iSogCLR: a learnable τ per sample and modality (per-sample Adam), ρ, per-sample u",
    # the FastCLIP paper's v2 setting (CC3M); tau_* are the per-sample Adam's
    defaults=dict(ESTIMATOR_OPTIONS, temperature=0.03, rho=7.0, gamma=0.2, gamma_decay_epochs=18, tau_min=0.01,
                  tau_max=1.0, lr_tau=0.0133, tau_beta1=0.9, tau_beta2=0.999, tau_eps=1e-8))
def isogclr(o):
    sharding = _sharding(o, per_sample_temperature=True)
    temperature = PerSampleTemperature(sharding, o.temperature, o.tau_min, o.tau_max, o.lr_tau, o.tau_beta1,
                                       o.tau_beta2, o.tau_eps)
    return _dro(o, use_reference=False, temperature=temperature, rho=o.rho, sharding=sharding)


@register_loss(
    'tempnet', reference='optional', stateful=True, run_options=(*STATEFUL, 'embed_dim'),
    help="TempNet: τ per anchor predicted by a small network on the detached features, learned through the "
         "KL-constrained DRO objective (Qiu et al., 2024); its parameters must be attached to the model",
    # the official CLIP code's values (the paper's are elided in our copy)
    defaults=dict(ESTIMATOR_OPTIONS, rho=7.0, gamma=0.8, gamma_decay_epochs=1, tau_min=0.005, tau_max=0.05,
                  tempnet_width=256, tempnet_prototypes=256, reference_shift=False))
def tempnet(o):
    if o.embed_dim <= 0:
        raise ValueError("tempnet needs the model's embedding size: pass embed_dim (the model's embed_dim)")
    temperature = TempNetTemperature(o.embed_dim, width=o.tempnet_width, prototypes=o.tempnet_prototypes,
                                     tau_min=o.tau_min, tau_max=o.tau_max)
    return _dro(o, use_reference=o.reference_shift, temperature=temperature, rho=o.rho)


@register_loss(
    'adnce', reference='optional', stateful=True, run_options=STATEFUL,
    help="ADNCE: negatives re-weighted by a Gaussian of their similarity (µ, σ), positive kept in the denominator "
         "(Wu et al., 2023)",
    # the paper's SimCSE-BERT setting (τ 0.07, µ 0.4, σ 1); mini-batch like the paper (γ = 1)
    defaults=dict({k: v for k, v in DRO_OPTIONS.items() if k != 'epsilon'}, temperature=0.07, gamma=1.0,
                  adnce_mu=0.4, adnce_sigma=1.0, reference_shift=False))
def adnce(o):
    # ε is replaced by the positive's own term: see DROContrastiveLoss (positive_in_denominator)
    return _dro(o, use_reference=o.reference_shift, negative_log_weight=adnce_log_weight(o.adnce_mu, o.adnce_sigma),
                positive_in_denominator=True)


@register_loss(
    'balanced', reference='optional',
    help="k-step balanced CLIP loss: k alternating Sinkhorn half-steps of the batch coupling (k = 1 is CLIP; "
         "Liu et al., 2024)",
    defaults=dict(learn_temperature=True, temperature=0.07, balance_steps=2, reference_shift=False))
def balanced(o):
    return BalancedClipLoss(_temperature(o), o.balance_steps, use_reference=o.reference_shift, rank=o.rank,
                            world_size=o.world_size)


JEST_OPTIONS = dict(selection_ratio=0.2, num_chunks=2, reference_logit_scale=100.0)


def _jest(o, topk):
    return JESTLoss(o.selection_ratio, o.num_chunks, topk, o.reference_logit_scale, local_loss=o.local_loss,
                    gather_with_grad=o.gather_with_grad, rank=o.rank, world_size=o.world_size)


@register_loss(
    'jest', reference='required', defaults=JEST_OPTIONS, run_options=CLIP,
    help="JEST: CLIP's loss on the most learnable selection_ratio of the super-batch (learner minus reference "
         "loss), drawn in num_chunks conditioned chunks (Evans et al., 2024)")
def jest(o):
    return _jest(o, topk=False)


@register_loss(
    'jest-topk', reference='required', defaults=JEST_OPTIONS, run_options=CLIP,
    help="JEST (top-k): as jest, but chunks after the first take the most learnable candidates instead of drawing")
def jest_topk(o):
    return _jest(o, topk=True)
