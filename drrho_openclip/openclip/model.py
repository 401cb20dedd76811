"""The loss of the run: built when the model exists, on the model's device, with its learnable modules attached to
the model; and the model's logit_scale set to the loss's temperature."""
import logging
import math

import torch

from ..losses import AUTO, DEFAULT_TILE_SIZE, LogitScaleTemperature, attach_to_model, create_loss as build, get_loss_spec
from .reference import OnlineReference
from .run import Run

# The untiled core holds a few b×B matrices per rank (b local, B global batch); the tiled one never more than b×T.
# From `benchmarks/tiled_memory.py` (one process, 1 thread, 2-core CPU): at B = 16384 (2^28 pairs, 1 GiB per float32
# matrix) untiled needs 5.0 GiB and 28 s, tiled 0.32 GiB and 46 s; at 4096, 0.31 vs 0.14 GiB and 1.1 vs 2.6 s. Tiling
# costs time, so it is chosen only where the untiled matrices reach gigabytes.
AUTO_TILE_FROM_PAIRS = 1 << 28


def auto_tile_size(local_batch: int, global_batch: int) -> int:
    return DEFAULT_TILE_SIZE if local_batch * global_batch >= AUTO_TILE_FROM_PAIRS else 0


def _uses_logit_scale(loss) -> bool:
    """Whether the loss reads the model's learnable logit_scale (CLIP-style losses, a learnable global τ)."""
    temperature = getattr(loss, 'temperature', None)
    return temperature is None or isinstance(temperature, LogitScaleTemperature)


def configure_model(run: Run, model, args):
    """Build the loss before the optimizer, DDP and resume see the model: a loss with learnable modules (TempNet)
    attaches them to the model. Everything the loss holds (per-sample tables, attached modules) and the online
    reference model go to the model's device, where OpenCLIP has already put the model. A τ the loss does not learn
    through logit_scale freezes the model's logit_scale (at log 1/τ, so logs show the τ in force): DDP must not wait
    for a gradient it never gets."""
    if run.plain_clip:
        return
    device = model.logit_scale.device
    options = dict(run.options)
    if options.get('tile_size', 0) is None:
        options['tile_size'] = auto_tile_size(args.batch_size, args.batch_size * args.world_size)
    supplied = get_loss_spec(run.loss_name).run_options
    from_run = dict(num_samples=run.sample_index_size, rank=args.rank, world_size=args.world_size,
                    local_loss=args.local_loss, gather_with_grad=args.gather_with_grad)
    if 'embed_dim' in supplied:
        import open_clip
        from_run['embed_dim'] = open_clip.get_model_config(args.model)['embed_dim']
    loss = build(run.loss_name, **options, **{o: from_run[o] for o in supplied})
    sharding = getattr(loss, 'sharding', None)
    if 'state_layout' in options and sharding is not None:
        options['state_layout'] = sharding.layout  # 'auto' resolved from the dataset size and the world size
        if sharding.sharded:
            logging.info(f"drrho-openclip: per-sample state sharded over {args.world_size} ranks, "
                         f"{sharding.size} of {sharding.num_samples} rows on rank {args.rank}")
    attached = attach_to_model(model, loss)
    if attached:
        logging.info(f"drrho-openclip: attached {', '.join(attached)} to the model (optimised and checkpointed "
                     f"with it)")
    loss.to(device)  # the attached modules are the loss's own: they move with it
    if args.ref_model is not None:
        loss.reference_encoder = OnlineReference(args.model, args.ref_model, args.ref_pretrained, device)
    temperature = options.get('temperature')
    if temperature not in (None, AUTO):  # an 'auto' τ is chosen at the first batch, by the loss
        with torch.no_grad():
            model.logit_scale.fill_(math.log(1.0 / temperature))
    if not _uses_logit_scale(loss):
        model.logit_scale.requires_grad_(False)
    run.options, run.loss = options, loss


def create_loss(run: Run, args):
    """The loss configure_model built, or None for plain `--loss clip`."""
    if run.plain_clip:
        return None
    settings = ', '.join(f"{o}={v}" for o, v in sorted(run.options.items()))
    logging.info(f"drrho-openclip: --loss {run.loss_name} ({type(run.loss).__name__}): {settings}")
    return run.loss
