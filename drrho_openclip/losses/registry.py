"""Loss registry: names → factories, in the style of timm's model registry (`list_losses`, `create_loss`).

A loss's options are of two kinds. The user's are its `defaults` (command-line flags in the OpenCLIP plugin; an
option whose values are not all of its default's type names its parser in `OPTION_TYPES`). The training run's are
named in its `run_options`: facts of the run (dataset size, rank, world size, the model's embedding size, OpenCLIP's
--local-loss / --gather-with-grad / --seed) that the run supplies to the losses that read them, and only to those.

Some options act only in some settings (a fixed τ has no ρ): a loss's `inactive(options)` names those its other
options leave without effect, and `create_loss` refuses them when they are given a value other than the default.
"""
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, List, Tuple

# Every option a training run may supply, with the value a loss gets when the caller does not (a single process)
RUN_OPTION_DEFAULTS = dict(
    num_samples=0,             # size of the per-sample index space (losses with per-sample state)
    rank=0,
    world_size=1,
    embed_dim=0,               # the model's embedding size (a loss with a network on the features)
    local_loss=True,           # OpenCLIP's flags, for the losses with CLIP's loss (clip, jest)
    gather_with_grad=True,
    seed=0,                    # OpenCLIP's --seed, for the losses that draw at random (jest)
)
DISTRIBUTED = ('rank', 'world_size')  # what every loss is given

AUTO = 'auto'  # a value chosen from the training batch (a temperature, a ρ)


def float_or_auto(text):
    """A number, or 'auto': how a command line gives `temperature` and `rho`."""
    return AUTO if text == AUTO else float(text)


# The parsers of the options that take more than their default's type
OPTION_TYPES = dict(temperature=float_or_auto, rho=float_or_auto, reference_logit_scale=float_or_auto,
                    lr_tau=float_or_auto)
# What learns a learned global τ: the loss's own Adam on log τ, or the model's logit_scale
TEMPERATURE_OPTIMIZERS = ('loss', 'model')
# What a global τ learned by the loss's own Adam steps on: the SogCLR estimate with u, or this batch's objective
TAU_OBJECTIVES = ('estimator', 'batch')

OPTION_HELP = dict(
    temperature="τ: fixed, its initial value when learned, or 'auto': chosen from the first batch's reference margins "
                "(its median anchor spreads its weight over --target-negatives negatives), then learned (held with "
                "--lr-tau 0); it starts "
                "far below 0.07 and lost to the 0.07 start wherever measured at drrho's default --reference-weight",
    learn_temperature="learn the global τ from --temperature (DRO losses: with the KL-constrained DRO objective and "
                      "ρ; balanced: as the model's logit_scale, by OpenCLIP's optimiser)",
    temperature_optimizer="what learns a learned global τ: 'loss' (the loss's own Adam on log τ with --lr-tau, "
                          "bounded by --tau-min/--tau-max) or 'model' (the model's logit_scale, by OpenCLIP's "
                          "optimiser at the model's learning rate)",
    tau_objective="what the loss's Adam on log τ steps on: 'estimator' (the paper's SogCLR estimate with each sample's "
                  "u; while the model improves u > g and τ keeps falling, which measured best at batch 64) or 'batch' "
                  "(this batch's own objective, u = g: τ settles where ρ keeps --target-negatives effective negatives)",
    rho="ρ of the KL-constrained DRO (the + ρτ term per direction), with a learned τ; 'auto': log((B − 1)/k) for "
        "the global batch B and k = --target-negatives, where a learned τ spreads each anchor's weight over k "
        "negatives",
    target_negatives="k, the effective negatives per anchor (exp of the entropy of its DRO weights) that an 'auto' "
                     "τ starts from and an 'auto' ρ keeps",
    epsilon="ε in τ·log(ε + g)",
    positive_in_denominator="ε = 1/(B − 1) for the global batch B, in place of --epsilon: the positive pair's own "
                            "term joins each anchor's normaliser, so that with --gamma 1 the DRO is CLIP's softmax "
                            "cross-entropy over the (shifted) logits",
    gamma="final inner learning rate γ of the per-sample estimators u (1 = no per-sample u)",
    gamma_decay_epochs="epochs of the cosine decay of γ from 1 to --gamma",
    distill_weight="λ of the distillation from the reference model: KD's share, (1−λ)·contrastive + λ·KD in CLIP's "
                   "units for every loss",
    reference_logit_scale="the reference model's logit scale t (KD teacher, JEST scores); 'auto': the t at which the "
                          "reference's own predictions on the first batch are calibrated (minimum of its CLIP loss "
                          "there, in [1, 100]), which a CLIP reference's learned scale approximates on its own data",
    tau_min="lower bound of the learned τ",
    tau_max="upper bound of the learned τ",
    lr_tau="learning rate of the learned τ's own Adam (global τ: on log τ, which moves by about lr_tau per step; "
           "'auto': 1/(the run's optimiser steps), so that log τ moves by about 1–2 over the run; 0: never steps; "
           "per-sample τ: on τ)",
    tau_beta1="β1 of the per-sample τ's Adam",
    tau_beta2="β2 of the per-sample τ's Adam",
    tau_eps="eps of the per-sample τ's Adam",
    tempnet_width="hidden width of the temperature network",
    tempnet_prototypes="number of prototypes of the temperature network",
    reference_weight="α, the weight of the reference model's pairwise loss in the shift ℓ − α·ℓ_ref (1: the paper's "
                     "RHO loss; 0: no shift, the same DRO without the reference)",
    reference_shift="also shift the pairwise loss by the reference model (the RHO loss; not in the method's paper)",
    column_step="add one column half-step of each direction's shifted logits to the DRO, each anchor's u as its row's "
                "normaliser, as the balanced CLIP loss follows CLIP's rows (new here, not in the method's paper; "
                "drrho's default, measured above the DRO without it or level in most settings tried: "
                "docs/defaults.md; --no-column-step: the DRO alone, as the paper's)",
    adnce_mu="µ, centre of ADNCE's Gaussian weight on negative similarities",
    adnce_sigma="σ, width of ADNCE's Gaussian weight on negative similarities",
    balance_steps="k, the number of Sinkhorn half-steps (1 = CLIP)",
    selection_ratio="fraction of the super-batch JEST keeps",
    num_chunks="number of chunks JEST draws its selection in",
    tile_size="columns per tile of the tiled DRO core, whose memory is linear in the batch size (0: untiled, as "
              "create_loss is without it)",
    state_layout="where the per-sample tables (u, per-sample τ and its Adam moments) live: 'replicated' (all N rows on "
                 "every rank) or 'sharded' (each rank holds N/W rows and saves them in per-rank files next to the "
                 "checkpoint); 'auto': sharded from 4M samples with several ranks",
)


@dataclass(frozen=True)
class LossSpec:
    name: str
    factory: Callable
    help: str
    # the user's options: the paper's values, unless those were measured to lose at small batch
    defaults: Dict = field(default_factory=dict)
    reference: str = 'none'                         # 'none', 'optional' or 'required' reference features
    run_options: Tuple[str, ...] = DISTRIBUTED      # the options of RUN_OPTION_DEFAULTS the training run supplies
    inactive: Callable = None                       # options -> {option: why it has no effect with these options}
    reads_reference: Callable = None                # options -> whether the loss reads the batch's reference features

    @property
    def stateful(self) -> bool:
        """Keeps per-sample state, sized by the dataset (`num_samples`), so needs each sample's index."""
        return 'num_samples' in self.run_options


_LOSSES: Dict[str, LossSpec] = {}

# Whether a loss reads reference features, by its kind of reference, unless its registration says otherwise: an
# 'optional' one where it distills or shifts by the reference
_READS_REFERENCE = {
    'none': lambda o: False,
    'optional': lambda o: getattr(o, 'distill_weight', 0) > 0 or getattr(o, 'reference_shift', False),
    'required': lambda o: True,
}


def register_loss(name: str, help: str, defaults=None, reference='none', run_options=DISTRIBUTED, inactive=None,
                  reads_reference=None):
    """Decorator registering `factory(options) -> nn.Module` under `name`."""
    def wrap(factory):
        if name in _LOSSES:
            raise ValueError(f"loss '{name}' is already registered")
        unknown = sorted(set(run_options) - set(RUN_OPTION_DEFAULTS))
        if unknown:
            raise ValueError(f"loss '{name}': {', '.join(unknown)} are no run options "
                             f"({', '.join(RUN_OPTION_DEFAULTS)})")
        if reference not in _READS_REFERENCE:
            raise ValueError(f"loss '{name}': reference must be one of {', '.join(_READS_REFERENCE)}, got {reference!r}")
        both = sorted(set(run_options) & set(defaults or {}))
        if both:
            raise ValueError(f"loss '{name}': {', '.join(both)} are run options, not the user's")
        _LOSSES[name] = LossSpec(name, factory, help, dict(defaults or {}), reference, tuple(run_options), inactive,
                                 reads_reference or _READS_REFERENCE[reference])
        return factory
    return wrap


def option_names(name: str) -> List[str]:
    """The user-settable options of a loss."""
    return sorted(get_loss_spec(name).defaults)


def list_losses() -> List[str]:
    return sorted(_LOSSES)


def get_loss_spec(name: str) -> LossSpec:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss '{name}'; known losses: {', '.join(list_losses())}") from None


def loss_options(name: str, **overrides) -> SimpleNamespace:
    """The options a loss is built with: its run options' single-process values, its defaults, then
    `overrides` (an override of None keeps the default). An override the loss does not have is an error, a run
    option it does not read included."""
    spec = get_loss_spec(name)
    options = {**{k: RUN_OPTION_DEFAULTS[k] for k in spec.run_options}, **spec.defaults}
    given = {k: v for k, v in overrides.items() if v is not None}
    unread = sorted(k for k in given if k in RUN_OPTION_DEFAULTS and k not in options)
    if unread:
        readers = ', '.join(n for n in list_losses() if set(unread) & set(get_loss_spec(n).run_options))
        raise ValueError(f"loss '{name}' does not read {', '.join(unread)} (a run option of the losses "
                         f"{readers}); do not pass it to this loss")
    foreign = sorted(k for k in given if k not in options)
    if foreign:
        raise ValueError(f"loss '{name}' has no option {', '.join(foreign)} (its own options: "
                         f"{', '.join(option_names(name)) or 'none'}); drop it or pick a loss that has it")
    options.update(given)
    return SimpleNamespace(**options)


def inactive_options(name: str, options: SimpleNamespace) -> Dict[str, str]:
    """{option: why it has no effect} for the options of a loss that these `options` (`loss_options`) leave unread."""
    spec = get_loss_spec(name)
    return dict(spec.inactive(options)) if spec.inactive else {}


def reads_reference_features(name: str, options: SimpleNamespace) -> bool:
    """Whether the loss `name` built with `options` (`loss_options`) reads the batch's reference features."""
    return get_loss_spec(name).reads_reference(options)


def create_loss(name: str, **overrides):
    """Build the loss registered as `name`, e.g. `create_loss('drrho', num_samples=len(dataset))`. An option given
    a value other than its default where the other options leave it without effect is an error."""
    spec = get_loss_spec(name)
    options = loss_options(name, **overrides)
    unread = {k: why for k, why in inactive_options(name, options).items()
              if overrides.get(k) is not None and overrides[k] != spec.defaults[k]}
    if unread:
        raise ValueError(f"loss '{name}': " + '; '.join(f"{k} has no effect here ({why})" for k, why in unread.items())
                         + ": drop it")
    return spec.factory(options)
