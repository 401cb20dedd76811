"""Loss registry: names → factories, in the style of timm's model registry (`list_losses`, `create_loss`)."""
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List

# Options every factory may read, with their values when neither the loss nor the caller sets them.
COMMON_OPTIONS = dict(
    temperature=0.07,          # τ, fixed or initial
    learn_temperature=False,   # τ learned through the model's logit_scale
    rho=0.0,                   # ρ of the KL-constrained DRO (learnable τ only)
    epsilon=1e-14,             # ε in log(ε + g)
    gamma=0.8,                 # SogCLR's final inner learning rate γ_min (1 = no per-sample state)
    gamma_decay_epochs=1,      # epochs of the cosine decay of γ from 1 to γ_min
    num_samples=0,             # size of the per-sample index space
    rank=0,
    world_size=1,
    local_loss=True,
    gather_with_grad=True,
)


@dataclass(frozen=True)
class LossSpec:
    name: str
    factory: Callable
    help: str
    defaults: Dict = field(default_factory=dict)   # the paper's values, overriding COMMON_OPTIONS
    reference: str = 'none'                         # 'none', 'optional' or 'required' reference features
    stateful: bool = False                          # keeps per-sample state (needs the sample index)


_LOSSES: Dict[str, LossSpec] = {}


def register_loss(name: str, help: str, defaults=None, reference='none', stateful=False):
    """Decorator registering `factory(options) -> nn.Module` under `name`."""
    def wrap(factory):
        if name in _LOSSES:
            raise ValueError(f"loss '{name}' is already registered")
        _LOSSES[name] = LossSpec(name, factory, help, dict(defaults or {}), reference, stateful)
        return factory
    return wrap


def list_losses() -> List[str]:
    return sorted(_LOSSES)


def get_loss_spec(name: str) -> LossSpec:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss '{name}'; known losses: {', '.join(list_losses())}") from None


def loss_options(name: str, **overrides) -> SimpleNamespace:
    """The options a loss is built with: common values, then the loss's paper defaults, then `overrides`
    (an override of None keeps the default; one that is neither common nor the loss's own is an error)."""
    spec = get_loss_spec(name)
    options = {**COMMON_OPTIONS, **spec.defaults}
    foreign = sorted(k for k, v in overrides.items() if v is not None and k not in options)
    if foreign:
        own = sorted(spec.defaults) or ['none beyond the common ones']
        raise ValueError(f"loss '{name}' has no option {', '.join(foreign)} (its own options: {', '.join(own)}); "
                         f"drop it or pick a loss that has it")
    options.update({k: v for k, v in overrides.items() if v is not None})
    return SimpleNamespace(**options)


def create_loss(name: str, **overrides):
    """Build the loss registered as `name`, e.g. `create_loss('drrho', num_samples=len(dataset))`."""
    return get_loss_spec(name).factory(loss_options(name, **overrides))
