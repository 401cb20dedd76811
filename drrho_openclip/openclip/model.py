"""The loss of the run: built when the model exists, on the model's device, with its learnable modules attached to
the model; and the model's logit_scale set to the loss's temperature."""
import logging
import math
from types import SimpleNamespace

import torch

from ..losses import (AUTO, DEFAULT_TILE_SIZE, LogitScaleTemperature, attach_to_model, compiles_for,
                      create_loss as build, gamma_at_epoch, get_loss_spec, inactive_options, rho_for_batch)
from ..losses.collectives import run_log
from .checkpoints import check_checkpoint_folder_shared, check_resumed_loss
from .flags import loss_run_options, trains
from .reference import OnlineReference
from .run import Run

# The untiled core holds about three b×B matrices per rank at its peak (b local, B global batch; d in float32, the
# softmax recomputed in backward, the gradient): measured 14 bytes per pair with float32 features on the CPU (223 MiB
# at 4096²) and 7.5 with bf16 on an H200 (120 MiB; `benchmarks/overheads.py`). The tiled core never holds more than
# b×T, but costs time (d recomputed in backward, smaller kernels: at one process and B = 16384 on the CPU, 1.24–1.34×
# the untiled time), so it is chosen only where the untiled matrices would crowd the device: on a GPU once they would
# take more than a quarter of its memory (an 80 GB GPU from one process at B ≈ 39k, an H200 at ≈ 52k; the model,
# its activations and the optimiser need the rest), elsewhere from 2^28 pairs (3.5 GiB; one process at 16384).
UNTILED_BYTES_PER_PAIR = 14
# KD's untiled term adds the learner's and the teacher's b×B logits and probabilities: 34 bytes per pair in all at its
# peak, float32 features on the CPU at 4096² (the same measurement)
UNTILED_KD_BYTES_PER_PAIR = 20
AUTO_TILE_FROM_PAIRS = 1 << 28


def auto_tile_size_help() -> str:
    """`auto_tile_size` in words, with its numbers, for --tile-size's help."""
    kd_per_pair = UNTILED_BYTES_PER_PAIR + UNTILED_KD_BYTES_PER_PAIR
    gpu_pairs = 80 * 2 ** 30 / 4  # a quarter of an 80 GB GPU, in bytes

    def batch(pairs):  # one process (local = global batch), in thousands below the limit
        return f"{math.isqrt(int(pairs)) // 1000}k"
    return (f"A training run's default: untiled while its matrices, about {UNTILED_BYTES_PER_PAIR} bytes per local x "
            f"global pair and {kd_per_pair} with --distill-weight, take at most a quarter of the GPU's memory, e.g. "
            f"one process up to a batch of about {batch(gpu_pairs / UNTILED_BYTES_PER_PAIR)} on an 80 GB GPU "
            f"({batch(gpu_pairs / kd_per_pair)} with KD), or off a GPU below {UNTILED_BYTES_PER_PAIR}·"
            f"2^{AUTO_TILE_FROM_PAIRS.bit_length() - 1} bytes, one process below a batch of "
            f"{math.isqrt(AUTO_TILE_FROM_PAIRS)} "
            f"({batch(AUTO_TILE_FROM_PAIRS * UNTILED_BYTES_PER_PAIR / kd_per_pair)} with KD); "
            f"{DEFAULT_TILE_SIZE}-column tiles beyond")


def auto_tile_size(local_batch: int, global_batch: int, device: torch.device = torch.device('cpu'),
                   distills: bool = False) -> int:
    """The tile size the run uses unless `--tile-size` is given: 0 (untiled) while the untiled matrices fit (with
    KD's, where the loss `distills`)."""
    pairs = local_batch * global_batch
    per_pair = UNTILED_BYTES_PER_PAIR + (UNTILED_KD_BYTES_PER_PAIR if distills else 0)
    if device.type == 'cuda':
        fits = pairs * per_pair <= torch.cuda.get_device_properties(device).total_memory / 4
    else:
        fits = pairs * per_pair < AUTO_TILE_FROM_PAIRS * UNTILED_BYTES_PER_PAIR
    return 0 if fits else DEFAULT_TILE_SIZE


def _uses_logit_scale(loss) -> bool:
    """Whether the loss reads the model's learnable logit_scale (CLIP-style losses, a learnable global τ)."""
    temperature = getattr(loss, 'temperature', None)
    return temperature is None or isinstance(temperature, LogitScaleTemperature)


def configure_model(run: Run, model, args):
    """Build the loss before the optimizer, DDP and resume see the model: a loss with learnable modules (TempNet)
    attaches them to the model. Everything the loss holds (per-sample tables, attached modules) and the online
    reference model go to the model's device, where OpenCLIP has already put the model. A τ the loss does not learn
    through logit_scale freezes the model's logit_scale, at log 1/(the starting τ) where one is given and the run
    trains (an 'auto' τ, chosen at the first batch, leaves OpenCLIP's initial value, an evaluation the loaded one):
    DDP must not wait for a gradient it never gets. OpenCLIP's logged scale then stays there (clamped to at most
    100); the τ in force is the loss's own metric (train/tau_image_mean). A checkpoint to resume whose loss state is
    not this loss's stops the run here."""
    # with --accum-freq the loop calls the loss on the whole window: accum_freq batches on every rank
    local_batch = args.batch_size * args.accum_freq
    run.provenance['global_batch'] = local_batch * args.world_size  # world_size: set once the processes start
    if run.plain_clip:
        check_resumed_loss(None, run, args)
        return
    device = model.logit_scale.device
    options = dict(run.options)
    if options.get('tile_size', 0) is None:
        options['tile_size'] = auto_tile_size(local_batch, local_batch * args.world_size, device,
                                              distills=options.get('distill_weight', 0) > 0)
    supplied = get_loss_spec(run.loss_name).run_options
    embed_dim = 0
    if 'embed_dim' in supplied:
        import open_clip
        embed_dim = open_clip.get_model_config(args.model)['embed_dim']
    loss = build(run.loss_name, **options, **loss_run_options(args, supplied, run.sample_index_size, args.rank,
                                                              args.world_size, embed_dim))
    check_resumed_loss(loss, run, args)
    sharding = getattr(loss, 'sharding', None)
    if 'state_layout' in options and sharding is not None:
        options['state_layout'] = sharding.layout  # 'auto' resolved from the dataset size and the world size
        if sharding.sharded:
            logging.info(f"drrho-openclip: per-sample state sharded over {args.world_size} ranks, "
                         f"{sharding.size} of {sharding.num_samples} rows on rank {args.rank}")
            if trains(args):  # an evaluation writes no checkpoint
                check_checkpoint_folder_shared(args, device)
    attached = attach_to_model(model, loss)
    if attached:
        run_log.info(f"drrho-openclip: attached {', '.join(attached)} to the model (optimised and checkpointed "
                     f"with it)")
    loss.to(device)  # the attached modules are the loss's own: they move with it
    if getattr(loss, 'compiles_passes', False) and compiles_for(device):  # else a silent pause
        run_log.info("drrho-openclip: the loss's passes over the pairwise matrix are compiled by TorchInductor during "
                     "the first training step (once per run, some seconds; TORCH_COMPILE_DISABLE=1 runs them eagerly)")
    state = getattr(loss, 'state', None)
    last_epoch = args.epochs - 1
    if state is not None and last_epoch < state.gamma_decay_epochs:
        # the papers' schedules are for their runs' length: a shorter run never reaches --gamma, which is not obvious
        reach = (f"--gamma-decay-epochs {last_epoch} reaches --gamma in its last epoch" if last_epoch else
                 "γ is 1 in a run's first epoch: u is each batch's own estimate")
        run_log.info(f"drrho-openclip: γ falls from 1 to --gamma {state.gamma_min:g} over --gamma-decay-epochs "
                     f"{state.gamma_decay_epochs}; this run's last epoch has γ = "
                     f"{gamma_at_epoch(last_epoch, state.gamma_min, state.gamma_decay_epochs):.3g} ({reach})")
    global_batch = run.provenance['global_batch']
    if options.get('rho') == AUTO and 'rho' not in inactive_options(run.loss_name, SimpleNamespace(**options)) \
            and rho_for_batch(global_batch, options['target_negatives']) == 0:
        # the README's k effective negatives per anchor cannot be had from B − 1
        run_log.info(f"drrho-openclip: --rho auto is 0 at this run's global batch {global_batch}: its "
                     f"{global_batch - 1} negatives per anchor are no more than --target-negatives "
                     f"{options['target_negatives']:g}, so τ rises until every negative weighs alike")
    if args.ref_model is not None:
        loss.reference_encoder = OnlineReference(model, args, device)
    temperature = options.get('temperature')
    # an 'auto' τ is chosen at the first batch, by the loss; an evaluation (no training data) keeps the scale the
    # model was loaded with, which its validation loss reads
    if temperature not in (None, AUTO) and trains(args):
        with torch.no_grad():
            model.logit_scale.fill_(math.log(1.0 / temperature))
    if not _uses_logit_scale(loss):
        model.logit_scale.requires_grad_(False)
    if getattr(model, 'logit_bias', None) is not None:
        # a SigLIP-style model's bias: one number added to every logit cancels in each softmax of these losses, so
        # none of them has a use for it, and DDP must not wait for its gradient
        model.logit_bias.requires_grad_(False)
        run_log.info(f"drrho-openclip: the model's logit_bias is frozen (--loss {run.loss_name} has no bias term)")
    run.options, run.loss = options, loss


def create_loss(run: Run, args):
    """The loss configure_model built, or None for plain `--loss clip`."""
    if run.plain_clip:
        return None
    settings = ', '.join(f"{o}={v}" for o, v in sorted(run.options.items()))
    run_log.info(f"drrho-openclip: --loss {run.loss_name} ({type(run.loss).__name__}): {settings}")
    for warning in run.warnings:
        run_log.warning(warning)
    return run.loss
