"""Loss registry: names → factories, in the style of timm's model registry (`list_losses`, `create_loss`)."""
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List

# What the training run supplies to every factory (the user's options are each loss's own `defaults`).
COMMON_OPTIONS = dict(
    num_samples=0,             # size of the per-sample index space
    rank=0,
    world_size=1,
    local_loss=True,
    gather_with_grad=True,
)


# Options the training loop supplies; the others are the user's (command-line flags in the OpenCLIP plugin).
RUN_OPTIONS = (*COMMON_OPTIONS, 'embed_dim')

OPTION_HELP = dict(
    temperature="τ, fixed, or its initial value when learned",
    learn_temperature="learn a global τ (the model's logit_scale) with the KL-constrained DRO objective and ρ",
    rho="ρ of the KL-constrained DRO (the + ρτ term per direction), with a learned τ",
    epsilon="ε in τ·log(ε + g)",
    gamma="final inner learning rate γ of the per-sample estimators u (1 = no per-sample state)",
    gamma_decay_epochs="epochs of the cosine decay of γ from 1 to --gamma (default: --epochs)",
    distill_weight="λ of the distillation from the reference model: (1−λ)·contrastive + λ·KD",
    reference_logit_scale="the reference model's logit scale (KD teacher, JEST scores)",
    tau_min="lower bound of the learned per-sample τ",
    tau_max="upper bound of the learned per-sample τ",
    lr_tau="learning rate of the per-sample τ (its own Adam)",
    tau_beta1="β1 of the per-sample τ's Adam",
    tau_beta2="β2 of the per-sample τ's Adam",
    tau_eps="eps of the per-sample τ's Adam",
    tempnet_width="hidden width of the temperature network",
    tempnet_prototypes="number of prototypes of the temperature network",
    reference_shift="also shift the pairwise loss by the reference model (the RHO loss; not in the method's paper)",
    adnce_mu="µ, centre of ADNCE's Gaussian weight on negative similarities",
    adnce_sigma="σ, width of ADNCE's Gaussian weight on negative similarities",
    balance_steps="k, the number of Sinkhorn half-steps (1 = CLIP)",
    selection_ratio="fraction of the super-batch JEST keeps",
    num_chunks="number of chunks JEST draws its selection in",
    tile_size="columns per tile of the tiled DRO core, whose memory is linear in the batch size (0: untiled; "
              "default: 1024-column tiles once a rank's local x global batch reaches 2^28 pairs, e.g. one process "
              "at 16384, where the untiled matrices take gigabytes)",
    state_layout="where the per-sample tables (u, per-sample τ and its Adam moments) live: 'replicated' (all N rows on "
                 "every rank) or 'sharded' (each rank holds N/W rows and saves them in per-rank files next to the "
                 "checkpoint); 'auto': sharded from 4M samples with several ranks",
)


@dataclass(frozen=True)
class LossSpec:
    name: str
    factory: Callable
    help: str
    defaults: Dict = field(default_factory=dict)   # the loss's options, at the paper's values
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


def option_names(name: str) -> List[str]:
    """The user-settable options of a loss."""
    spec = get_loss_spec(name)
    return sorted(k for k in {**COMMON_OPTIONS, **spec.defaults} if k not in RUN_OPTIONS)


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
        own = sorted(k for k in spec.defaults if k not in RUN_OPTIONS) or ['none']
        raise ValueError(f"loss '{name}' has no option {', '.join(foreign)} (its own options: {', '.join(own)}); "
                         f"drop it or pick a loss that has it")
    options.update({k: v for k, v in overrides.items() if v is not None})
    return SimpleNamespace(**options)


def create_loss(name: str, **overrides):
    """Build the loss registered as `name`, e.g. `create_loss('drrho', num_samples=len(dataset))`."""
    return get_loss_spec(name).factory(loss_options(name, **overrides))
