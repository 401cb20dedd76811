"""The named losses: each is a thin composition of the DRO core."""
from .core import DROContrastiveLoss, FixedTemperature, LogitScaleTemperature, MovingAverageState
from .registry import register_loss


def _temperature(o):
    return LogitScaleTemperature() if o.learn_temperature else FixedTemperature(o.temperature)


def _state(o):
    # γ = 1 means u is always the mini-batch estimate: no table at all
    if o.gamma >= 1.0:
        return None
    return MovingAverageState(o.num_samples, o.gamma, o.gamma_decay_epochs, o.world_size)


def _dro(o, use_reference):
    return DROContrastiveLoss(
        _temperature(o), o.epsilon, rho=o.rho if o.learn_temperature else 0.0, state=_state(o),
        use_reference=use_reference, rank=o.rank, world_size=o.world_size)


@register_loss('clip', help="OpenCLIP's mini-batch contrastive loss (its own ClipLoss, unchanged)")
def clip(o):
    from open_clip.loss import ClipLoss
    return ClipLoss(local_loss=o.local_loss, gather_with_grad=o.gather_with_grad, cache_labels=True,
                    rank=o.rank, world_size=o.world_size)


@register_loss(
    'drrho', reference='required', stateful=True,
    help="DRRho-CLIP: KL-DRO over the RHO-shifted pairwise loss, SogCLR estimator (Wei et al., 2025)",
    defaults=dict(temperature=0.01, epsilon=1e-4, rho=8.5))
def drrho(o):
    return _dro(o, use_reference=True)


@register_loss(
    'sogclr', stateful=True,
    help="SogCLR / FastCLIP-v1: global contrastive loss, fixed τ, per-sample u with γ",
    defaults=dict(temperature=0.07))
def sogclr(o):
    return _dro(o, use_reference=False)
