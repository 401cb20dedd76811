"""The plugin's flags: one argument group in OpenCLIP's parser (every loss option from the registry, with the losses
that read it and their defaults), and their checks against the chosen loss, which start the run."""
import argparse
import glob
import os
import re
import shutil
import textwrap
from functools import lru_cache
from typing import Optional, Tuple

from ..data import (caption_mismatch, image_mismatch, input_kind, local_path, missing_local_file, moved_folders,
                    read_csv, relative_to_common_folder, sha256_of, shard_name_collision, shard_urls)
from ..features import FeatureStore, FeatureStoreError, shard_name
from ..losses import (OPTION_HELP, OPTION_TYPES, STATE_LAYOUTS, TAU_OBJECTIVES, TEMPERATURE_OPTIMIZERS,
                      LogitScaleTemperature, create_loss, get_loss_spec, inactive_options, list_losses, loss_options,
                      option_names, per_sample_tables, reads_reference_features)
from .reference import built_model, pretrained_problem
from .run import Run

# Options whose default the run chooses (tile_size: from the batch sizes; state_layout 'auto': from the dataset size
# and the world size), so the help names no per-loss value
CHOSEN_BY_THE_RUN = ('tile_size', 'state_layout')
# OpenCLIP's flags that only its own ClipLoss (and losses built on it) reads: {option: flag}
OPENCLIP_LOSS_FLAGS = {'local_loss': '--local-loss', 'gather_with_grad': '--gather-with-grad'}
# The τ a learned logit_scale can hold: OpenCLIP's training loop clamps it to [0, ln 100] after every step
LOGIT_SCALE_TAU_RANGE = (0.01, 1.0)
# The options that take one of a few words
OPTION_CHOICES = {'state_layout': STATE_LAYOUTS, 'temperature_optimizer': TEMPERATURE_OPTIMIZERS,
                  'tau_objective': TAU_OBJECTIVES}


def flag(option: str) -> str:
    return '--' + option.replace('_', '-')


def in_flag_spelling(message: str) -> str:
    """A loss's error message with its option names as the user typed them (state_layout → --state-layout). Only
    names with an underscore: a one-word option (gamma, temperature) is also an ordinary word of the prose."""
    names = sorted((o for o in user_options() if '_' in o), key=len, reverse=True)
    return re.sub(r'\b(' + '|'.join(names) + r')\b', lambda m: flag(m.group(1)), message) if names else message


def user_options() -> dict:
    """{option: [losses that read it]} over every registered loss."""
    options = {}
    for name in list_losses():
        for option in option_names(name):
            options.setdefault(option, []).append(name)
    return options


def _given_options(args) -> dict:
    """The loss options the command line gives (the flags default to None: not given, the loss's own default)."""
    return {o: getattr(args, o) for o in user_options() if getattr(args, o) is not None}


def loss_run_options(args, supplied, num_samples: int, rank: int, world_size: int, embed_dim: int) -> dict:
    """The values of the run options (RUN_OPTION_DEFAULTS) a loss takes from the run (`supplied`, its spec's
    run_options): the sizes given, OpenCLIP's own flags read from `args`."""
    values = dict(num_samples=num_samples, rank=rank, world_size=world_size, embed_dim=embed_dim,
                  local_loss=args.local_loss, gather_with_grad=args.gather_with_grad, seed=args.seed)
    return {option: values[option] for option in supplied}


def reads_reference(argv) -> bool:
    """Whether a run with these plugin flags (`argv`, e.g. ['--loss', 'drrho', '--reference-weight=0']) reads
    reference features, which the run refuses otherwise: for scripts that decide whether to pass --ref-features."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    args, _ = parser.parse_known_args([str(a) for a in argv])
    given = _given_options(args)
    return reads_reference_features(args.loss, loss_options(args.loss, **given))


# ---- --help ---------------------------------------------------------------------------------------------------


def _shown(value) -> str:
    if isinstance(value, bool):
        return 'on' if value else 'off'
    return str(value)


def _readers(option: str, losses: list) -> str:
    """'Losses: a, b (default 0.8); c (default 0.2).', losses grouped by their default."""
    if option in CHOSEN_BY_THE_RUN:
        return f"Losses: {', '.join(losses)}."
    by_default = {}
    for name in losses:
        by_default.setdefault(_shown(get_loss_spec(name).defaults[option]), []).append(name)
    return 'Losses: ' + '; '.join(f"{', '.join(names)} (default {value})" for value, names in by_default.items()) + '.'


def _reference_readers() -> str:
    required = [n for n in list_losses() if get_loss_spec(n).reference == 'required']
    optional = [n for n in list_losses() if get_loss_spec(n).reference == 'optional']
    with_distillation = [n for n in optional if 'distill_weight' in option_names(n)]
    with_shift = [n for n in optional if 'reference_shift' in option_names(n)]
    unshifted = [n for n in required if 'reference_weight' in option_names(n)]
    return (f"Losses: {', '.join(required)} (required; {', '.join(unshifted)} at --reference-weight 0 only with "
            f"--distill-weight > 0); {', '.join(with_distillation)} with --distill-weight > 0; "
            f"{', '.join(with_shift)} with --reference-shift.")


def summary(text: str) -> str:
    """A loss's help up to its first ';' outside parentheses: what the loss is, without its variants."""
    depth = 0
    for at, char in enumerate(text):
        depth += {'(': 1, ')': -1}.get(char, 0)
        if char == ';' and depth == 0:
            return text[:at]
    return text


def _description(width: int) -> str:
    """The group's text: what the plugin adds, then each loss on a line of its own (the first clause of its help)."""
    intro = textwrap.fill("Reference-model steering (DRRho-CLIP) and a family of DRO contrastive losses. --loss picks "
                          "one; each flag below names the losses that read it, with their defaults, and a flag the "
                          "chosen loss does not read stops the run at start-up.", width)
    column = max(map(len, list_losses())) + 2
    lines = [textwrap.fill(in_flag_spelling(summary(get_loss_spec(name).help)), width,
                           initial_indent=f"  {name:<{column}}",
                           subsequent_indent=' ' * (column + 2)) for name in list_losses()]
    return intro + '\n\nLosses:\n' + '\n'.join(lines)


def add_args(parser):
    """`--loss`, the reference-feature and sample-index flags, and one flag per loss option (registry-driven)."""
    # keeps the line per loss of the group's description; OpenCLIP's parser has no description or epilog of its own
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    width = shutil.get_terminal_size().columns - 4  # argparse's width, less the group's indent
    group = parser.add_argument_group('drrho-openclip', _description(width))
    group.add_argument('--loss', default='clip', choices=list_losses(), metavar='NAME',
                       help='the contrastive loss, one of the losses above (default: %(default)s)')
    readers = _reference_readers()
    group.add_argument('--ref-features', metavar='DIR', default=None,
                       help=f'precomputed reference features (a store written by drrho-openclip-features). {readers}')
    group.add_argument('--ref-model', metavar='NAME', default=None,
                       help=f'compute the reference features online with this OpenCLIP model (no gradient; it reads '
                            f'the learner\'s batches). {readers}')
    group.add_argument('--ref-pretrained', metavar='TAG_OR_FILE', default=None,
                       help='pretrained tag or checkpoint file of --ref-model')
    stateful = [n for n in list_losses() if get_loss_spec(n).stateful]
    group.add_argument('--sample-index', metavar='DIR', default=None,
                       help=f"WebDataset input, for a loss that keeps per-sample state without --ref-features: the "
                            f"store whose keys index the samples (`drrho-openclip-features --keys-only`; a feature "
                            f"store does too). Losses: {', '.join(stateful)}.")
    from .model import auto_tile_size_help  # which imports this module
    run_default = {'tile_size': f" {auto_tile_size_help()}."}
    for option, losses in sorted(user_options().items()):
        text = f"{OPTION_HELP[option]}.{run_default.get(option, '')} {_readers(option, losses)}"
        kind = OPTION_TYPES.get(option, type(get_loss_spec(losses[0]).defaults[option]))
        if kind is bool:  # --x / --no-x; default None: tells 'not given' from the loss's own default
            group.add_argument(flag(option), action=argparse.BooleanOptionalAction, default=None, help=text)
        elif option in OPTION_CHOICES:
            group.add_argument(flag(option), choices=OPTION_CHOICES[option], default=None, help=text)
        else:
            group.add_argument(flag(option), type=kind, default=None, metavar=option.upper(), help=text)


# ---- the checks, at start-up ----------------------------------------------------------------------------------


def _open_store(parser, option: str, root) -> FeatureStore:
    try:
        return FeatureStore.open(root)
    except FeatureStoreError as e:
        parser.error(f"{flag(option)}: {e}")


def check_args(args, parser) -> Run:
    """Check the plugin's flags against the chosen loss (a flag the loss does not read is an error), record the
    values in force on `args` (so params.txt shows them), and open the stores: the run the hooks share."""
    spec = get_loss_spec(args.loss)
    own = option_names(args.loss)
    given = _given_options(args)
    foreign = [flag(o) for o in given if o not in own]
    if foreign:
        parser.error(f"{', '.join(foreign)}: no such option for --loss {args.loss} (its options: "
                     f"{', '.join(map(flag, own)) or 'none'})")
    options = loss_options(args.loss, **given)
    _check_what_openclip_refuses_with_status_0(args, parser)
    _check_resume(args, parser)
    plain_clip = args.loss == 'clip' and not options.distill_weight
    if not plain_clip:
        _check_openclip_modes(args, parser)
    unread = inactive_options(args.loss, options)
    for option in given:
        if option in unread:
            parser.error(f"{flag(option)} has no effect for --loss {args.loss} with these flags "
                         f"({in_flag_spelling(unread[option])})")
    supplied = spec.run_options
    warnings = []
    ignored = [f for option, f in OPENCLIP_LOSS_FLAGS.items() if getattr(args, option) and option not in supplied]
    if ignored:
        warnings.append(f"drrho-openclip: --loss {args.loss} does not read {' and '.join(ignored)}: its anchors are "
                        f"always the local samples and its candidates the global batch, gathered with gradient")
    try:  # the loss's own checks, on a stand-in of the run's sizes
        loss = create_loss(args.loss, **given, **loss_run_options(args, supplied, num_samples=1, rank=0,
                                                                   world_size=1, embed_dim=1))
    except ValueError as e:
        parser.error(f"--loss {args.loss}: {in_flag_spelling(str(e))}")
    reads_reference = reads_reference_features(args.loss, options)
    uses_reference = args.ref_features is not None or args.ref_model is not None
    if reads_reference and not uses_reference and trains(args):  # evaluating: the loss is not called
        parser.error(f"--loss {args.loss} needs reference features: pass --ref-features DIR (precomputed with "
                     f"drrho-openclip-features) or --ref-model NAME --ref-pretrained TAG")
    if uses_reference and not reads_reference:
        parser.error(f"--loss {args.loss} with these options does not read reference features; drop "
                     f"--ref-features/--ref-model" + (" or set --reference-shift" if 'reference_shift' in own else "")
                     + (" or shift by them with --reference-weight > 0" if 'reference_weight' in own else "")
                     + (" or distill from them with --distill-weight λ" if 'distill_weight' in own else ""))
    if args.ref_features is not None and args.ref_model is not None:
        parser.error("give either --ref-features or --ref-model, not both")
    if args.ref_pretrained is not None and args.ref_model is None:
        parser.error("--ref-pretrained needs --ref-model")
    problem = args.ref_model and pretrained_problem(args.ref_model, args.ref_pretrained)
    if problem:
        parser.error(f"--ref-pretrained: {problem}")
    keeps_state = bool(per_sample_tables(loss))
    if hasattr(loss, 'chunk_sizes'):  # JEST: what it keeps of a rank's super-batch must fill every chunk
        try:  # under accumulation OpenCLIP hands the loss the whole window
            loss.chunk_sizes(args.batch_size * args.accum_freq)
        except ValueError as e:
            parser.error(f"--loss {args.loss}: {in_flag_spelling(str(e))}"
                         + (" (the super-batch is --batch-size × --accum-freq)" if args.accum_freq > 1 else ""))
    if getattr(args, 'torchscript', False) and any(p.requires_grad for p in loss.parameters()):
        parser.error(f"--torchscript: --loss {args.loss} attaches its learnable modules (TempNet's) to the model, "
                     f"which a scripted model cannot take; drop --torchscript")
    if isinstance(getattr(loss, 'temperature', None), LogitScaleTemperature) and not (
            LOGIT_SCALE_TAU_RANGE[0] <= options.temperature <= LOGIT_SCALE_TAU_RANGE[1]):
        parser.error(f"--temperature {options.temperature}: --loss {args.loss} learns τ here as the model's "
                     f"logit_scale, which OpenCLIP clamps to τ in [{LOGIT_SCALE_TAU_RANGE[0]}, "
                     f"{LOGIT_SCALE_TAU_RANGE[1]}] after every step; start τ in that range")
    for option in own:
        setattr(args, option, getattr(options, option))
    in_force = {option: getattr(options, option) for option in own}
    if 'tile_size' in own and 'tile_size' not in given:
        in_force['tile_size'] = args.tile_size = None  # chosen from the global batch once the world size is known

    if trains(args) and args.train_data_upsampling_factors and '${' in (args.train_data or ''):
        parser.error("--train-data-upsampling-factors: with it OpenCLIP reads the URLs of --train-data as written, "
                     "without webdataset's ${VAR} substitution, and would look for files named '${...}' forever: "
                     "write the paths out")
    try:  # OpenCLIP's own refusal comes after the model is built, as a traceback
        kind = input_kind(args.train_data, args.dataset_type) if trains(args) else None
    except ValueError as e:
        parser.error(str(e))
    csv = kind == 'csv'
    if csv and missing_local_file([(None, args.train_data)]):
        parser.error(f"--train-data: no such file '{args.train_data}'")
    reference_store = None
    if args.ref_features is not None:
        reference_store = _open_store(parser, 'ref_features', args.ref_features)
        if reference_store.keys_only:
            parser.error(f"--ref-features: '{reference_store.root}' is a keys-only store: it holds no reference "
                         f"features (it can be a --sample-index)")
    sample_index = _check_sample_index(args, parser, keeps_state, reads_reference)
    for option, store in (('ref_features', reference_store), ('sample_index', sample_index)):
        if store is not None:
            warning = _check_store_covers_training_data(parser, option, store, args)
            if warning:
                warnings.append(warning)
    index_store = sample_index or reference_store
    provenance = dict(loss=args.loss, options=dict(in_force), reference=_reference_in_use(args, reference_store),
                      samples=_sample_index_fingerprint(args, index_store) if keeps_state else None,
                      epochs=args.epochs)
    return Run(loss_name=args.loss, plain_clip=plain_clip, options=in_force,
               reference_store=reference_store, index_store=index_store,
               sample_index_size=_sample_index_size(args, index_store) if spec.stateful else 0, warnings=warnings,
               provenance=provenance, resume_latest=args.resume == 'latest')


def _check_what_openclip_refuses_with_status_0(args, parser):
    """What OpenCLIP's main refuses by printing a line and returning, which ends the process with status 0 (a job
    chain or script counts the run as done) and, for an existing run, on rank 0 only (the other ranks wait for it)."""
    said = "(OpenCLIP itself prints an error and exits with status 0)"
    if args.resume == 'latest' and args.remote_sync is not None:
        if args.save_most_recent:
            parser.error(f"--resume latest with --remote-sync cannot take --save-most-recent in OpenCLIP: drop "
                         f"--save-most-recent {said}")
        if args.remote_sync_protocol != 's3':
            parser.error(f"--resume latest with --remote-sync lists the remote's checkpoints with aws s3, which "
                         f"--remote-sync-protocol {args.remote_sync_protocol} is not: give --resume a checkpoint "
                         f"{said}")
    if args.logs and args.name and args.resume != 'latest':
        # out.log, or out-<rank> per node with --log-local: either way a run of that name, whose checkpoints this one
        # would write over (OpenCLIP looks for its own mode's file only)
        folder = os.path.join(args.logs, args.name)
        logs = sorted(glob.glob(os.path.join(glob.escape(folder), 'out.log'))
                      + glob.glob(os.path.join(glob.escape(folder), 'out-[0-9]*')))
        if logs:
            parser.error(f"--name {args.name}: '{logs[0]}' exists, a run of that name: give another --name, or "
                         f"--resume latest to continue it {said}")


def _check_resume(args, parser):
    """--resume latest without the --name of the run to continue, and a local --resume that is no file, found before
    the model is built (OpenCLIP's load raises after, with a traceback); a URL is OpenCLIP's to fetch."""
    if args.resume == 'latest' and not args.name:
        parser.error("--resume latest continues the run that --name names, and none is given: OpenCLIP names each run "
                     "by its start time, so every job would start a new run (with status 0); give --name")
    if args.resume in (None, 'latest') or '://' in args.resume:
        return
    args.resume = os.path.expanduser(args.resume)  # as OpenCLIP's fsspec reads it, and for the checks that follow
    if os.path.isdir(args.resume):
        parser.error(f"--resume {args.resume} is a folder: give a checkpoint file (e.g. "
                     f"{os.path.join(args.resume, 'epoch_1.pt')}), or --resume latest with the run's --name")
    if not os.path.isfile(args.resume):
        parser.error(f"--resume {args.resume}: no such file")


def _check_openclip_modes(args, parser):
    """OpenCLIP's training modes that a plugin loss cannot stand in for: it replaces OpenCLIP's loss, so their own
    loss would not run and the model's extra outputs would reach a loss that does not read them."""
    loss = f"--loss {args.loss}" + (" with --distill-weight" if args.loss == 'clip' else '')
    if getattr(args, 'siglip', False):
        parser.error(f"--siglip: {loss} replaces OpenCLIP's loss, so the sigmoid loss would not run; drop --siglip")
    if getattr(args, 'distill_model', None):
        parser.error(f"--distill-model: {loss} replaces OpenCLIP's loss, so its distillation from that model would "
                     f"not run; distill from a reference model's features with --distill-weight λ and "
                     f"--ref-features or --ref-model (the losses of `--help` that read it)")
    if 'coca' in (args.model or '').lower():  # the test OpenCLIP's create_loss makes
        parser.error(f"--model {args.model}: a CoCa model trains with a captioning loss as well, which {loss} "
                     f"does not compute; drrho-openclip's losses are for contrastive models")
    if getattr(args, 'horovod', False):
        parser.error(f"--horovod: {loss} communicates through torch.distributed, which Horovod does not set up; "
                     f"launch with torchrun (see launch/)")


def _check_sample_index(args, parser, keeps_state: bool, reads_reference: bool):
    """The --sample-index store, opened, if one is given (and needed). The dense sample index of a loss with
    per-sample state: CSV rows and the synthetic dataset's are their own; WebDataset samples are indexed by the keys
    of a store, --ref-features' or --sample-index's."""
    if not trains(args):
        return None  # evaluating: nothing is indexed (a training command reused for evaluation may still name one)
    kind = input_kind(args.train_data, args.dataset_type)
    webdataset = args.train_data is not None and kind == 'webdataset'
    if args.sample_index is None:
        if keeps_state and webdataset and args.ref_features is None:
            parser.error(f"--loss {args.loss} keeps per-sample state, and WebDataset samples have no index of their "
                         f"own: write one with `drrho-openclip-features --keys-only --train-data '{args.train_data}' "
                         f"--output DIR` and pass --sample-index DIR"
                         + (" (or precompute the reference features: --ref-features indexes them too)"
                            if reads_reference else ""))
        return None
    if not keeps_state:
        parser.error(f"--sample-index: --loss {args.loss} with these options keeps no per-sample state, so it needs no "
                     f"sample index" + (" (--gamma 1)" if args.gamma == 1 else ""))
    if args.ref_features is not None:
        parser.error("--sample-index: the --ref-features store already indexes the samples; drop --sample-index")
    if not webdataset:
        parser.error(f"--sample-index is for WebDataset input: the rows of --dataset-type {kind} input are its sample "
                     f"index already")
    return _open_store(parser, 'sample_index', args.sample_index)


def _check_store_covers_training_data(parser, option: str, store: FeatureStore, args) -> Optional[str]:
    """A store written for other data stops the run here, before OpenCLIP creates its log folder: every
    WebDataset shard of --train-data must be one of the store's, and a CSV must be the store's whole index, row by
    row (its image paths are the keys). Keys within a tar shard are looked up as its samples arrive. Returns a
    warning where shards differ in size from those the store was written from."""
    kind = input_kind(args.train_data, args.dataset_type)
    try:
        if kind == 'synthetic':
            raise FeatureStoreError("--dataset-type synthetic has no samples a store can describe")
        if args.train_data is None:
            return
        if kind == 'csv':
            images, captions = _training_csv(args)
            moved = check_csv_keys(store, args.train_data, images)
            if store.num_samples != len(images):  # the row number is the dense index: no other shard may come first
                raise FeatureStoreError(f"'{store.root}' holds {store.num_samples} samples, the CSV has {len(images)}")
            shard = store.shard(shard_name(args.train_data))
            mismatch = caption_mismatch(shard, captions, args) or image_mismatch(shard, args, images)
            if mismatch:
                raise FeatureStoreError(mismatch)
            return moved
        else:
            urls = shard_urls(args.train_data)

            def stored_name(url):
                """The name the store holds a shard under (those of stores written before end at the first dot);
                a shard it lacks is a mistyped path where the file is missing too (stat only then: shards are many)."""
                try:
                    return store.shard(shard_name(url)).name
                except FeatureStoreError:
                    if missing_local_file([(None, url)]):
                        parser.error(f"--train-data: no such file '{url}'")
                    raise
            collision = shard_name_collision(urls, stored_name)
            if collision:
                parser.error(f"{flag(option)}: '{collision[0]}' and '{collision[1]}' in --train-data have one file "
                             f"name, and a store keys shards by file name, so both would read the first one's "
                             f"features and per-sample state: give the shards distinct file names (links will do) "
                             f"and write the store for those")
            return _shard_size_warning(option, store, urls, args.train_data)
    except FeatureStoreError as e:
        parser.error(f"{flag(option)} was not written for --train-data: {e}")
    return None


SIZE_CHECKED_SHARDS = 64  # a stat each, on every rank: enough to tell another dataset's shards of the same names


def _shard_size_warning(option: str, store: FeatureStore, urls, train_data: str) -> Optional[str]:
    """Another dataset's tar shards of the same file names (and img2dataset's same numbered keys) pass the name and
    key lookups and read this store's features of other samples. Up to SIZE_CHECKED_SHARDS local shards, evenly
    spaced and the first of each '::' source, are compared with the sizes of the files the store was written from:
    a warning, not an error, since shards filtered after the store was written differ too and are read rightly."""
    checked = set(urls[::-(-len(urls) // SIZE_CHECKED_SHARDS)])
    checked |= {shard_urls(source)[0] for source in train_data.split('::')}
    differ = []  # (url, its size, the size of the file the store was written from)
    for url in sorted(checked):
        written_from, local = store.shard(shard_name(url)).source_bytes, local_path(url)
        if written_from is not None and local is not None and os.path.isfile(local):
            size = os.path.getsize(local)
            if size != written_from:
                differ.append((url, size, written_from))
    if not differ:
        return None
    url, size, written_from = differ[0]
    larger = [url for url, size, written_from in differ if size > written_from]
    return (f"drrho-openclip: {len(differ)} of the {len(checked)} --train-data shards checked differ in size from "
            f"those {flag(option)} was written from, e.g. '{url}': {size} bytes here, {written_from} there. "
            f"Shards filtered since are read rightly; another dataset's shards of the same names (and keys) would "
            f"read the features of other samples: then write the store for this data"
            + (f". '{larger[0]}' is larger: downloaded again after precompute found it cut short? Its samples "
               f"after the cut have no features, and training stops at the first it reads: write the store again "
               f"(--overwrite)" if larger else ""))


def _training_csv(args) -> Tuple[list, str]:
    """(the image paths of the training CSV, one per row, `sha256_of` its captions): the columns OpenCLIP's
    CsvDataset reads, read once while the file stays as it is (the checks and the sample index need both)."""
    local = local_path(args.train_data)
    stat = os.stat(local) if local is not None else None  # pandas reads a remote CSV (fsspec) as it is
    return _read_csv_columns(args.train_data, args.csv_separator, args.csv_img_key, args.csv_caption_key,
                             stat and (stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=1)
def _read_csv_columns(path, separator, image_key, caption_key, _version):
    # every column, as OpenCLIP's CsvDataset reads it: a row it cannot split, or no row, stops here, naming the file
    rows = read_csv(argparse.Namespace(train_data=path, csv_separator=separator, csv_img_key=image_key,
                                       csv_caption_key=caption_key))
    return rows[image_key].tolist(), sha256_of(rows[caption_key])


def check_csv_keys(store, csv_path, images) -> Optional[str]:
    """The store's keys of the CSV's shard are its image paths, row by row; or the same paths below another folder
    (the dataset moved), which returns a warning saying so."""
    name = store.stored_name(shard_name(csv_path))
    if name not in {shard.name for shard in store.shards}:
        raise FeatureStoreError(f"'{store.root}' has no shard '{name}', the file name of '{csv_path}' (a CSV's "
                                f"shard is named after its file; it has {', '.join(s.name for s in store.shards[:3])}"
                                f"{', ...' if len(store.shards) > 3 else ''}): train with the CSV it was written for, "
                                f"or write the store for this one")
    count = store.shard(name).count
    images = [str(image) for image in images]
    if count != len(images):
        raise FeatureStoreError(f"'{store.root}' has {count} reference features for '{csv_path}', "
                                f"which has {len(images)} rows")
    if store.first_other_key(name, images) is None:
        return None
    keys = store.keys(name).tolist()  # other paths: a moved dataset, or another CSV
    moved = moved_folders(keys, images)
    if moved:
        return (f"drrho-openclip: the images of '{csv_path}' are below '{moved[1]}', where '{store.root}' was written "
                f"for them below '{moved[0]}': the same files in the same order, read as a moved dataset")
    row = next(row for row, (key, image) in enumerate(zip(keys, images)) if key != image)
    raise FeatureStoreError(f"'{store.root}' was computed for another CSV: row {row} (from 0, the header not "
                            f"counted) is '{keys[row]}' there and '{images[row]}' in '{csv_path}'")


def trains(args) -> bool:
    """Whether the run has training data; without, OpenCLIP only evaluates (--val-data, --imagenet-val) and returns
    before it builds the loss or reads a checkpoint's loss state."""
    return args.train_data is not None or args.dataset_type == 'synthetic'


def _reference_in_use(args, reference_store) -> Optional[str]:
    """The reference model the run reads, in words (None: none)."""
    if reference_store is not None:
        weights = f" ({reference_store.pretrained})" if reference_store.pretrained else ''
        return f"--ref-features of {reference_store.model}{weights}, dim {reference_store.dim}"
    if args.ref_model is not None:  # as built: a run of an earlier version built GELU where the tag needs QuickGELU
        built = built_model(args.ref_model, args.ref_pretrained)
        return f"--ref-model {built} --ref-pretrained {args.ref_pretrained}"
    return None


def _sample_index_fingerprint(args, index_store) -> Optional[str]:
    """A fingerprint of which sample each row of the per-sample state is: a CSV's image paths row by row (its row is
    the index), or the store's shards, their sizes and keys (a WebDataset sample's row is its shard's offset plus its
    place in the shard, in file order). None where nothing is indexed (evaluation; the synthetic dataset, whose
    samples are their index)."""
    if not trains(args):
        return None
    if input_kind(args.train_data, args.dataset_type) == 'csv':  # below their common folder: a dataset may move
        return sha256_of(relative_to_common_folder(_training_csv(args)[0]))
    if index_store is not None:  # with the keys in order where the store recorded them: a shard rewritten in
        # another order (a store written again for a downloaded copy) has the same name and size
        return sha256_of(f"{shard.name}/{shard.count}" + (f"/{shard.keys_sha256}" if shard.keys_sha256 else '')
                         for shard in index_store.shards)
    return None


def csv_fingerprint_as_written(args) -> Optional[str]:
    """A CSV's fingerprint as checkpoints before 2026-11-29 recorded it: of its image paths as written, which moving
    the dataset changes (None for other input)."""
    if not trains(args) or input_kind(args.train_data, args.dataset_type) != 'csv':
        return None
    return sha256_of(_training_csv(args)[0])


def _sample_index_size(args, index_store) -> int:
    """Size of the dense sample index: the store's (--ref-features or --sample-index), a CSV's rows, or the
    synthetic dataset's size."""
    if index_store is not None:
        return index_store.num_samples
    if not trains(args):
        return 1  # a stand-in: no state is trained or read, but the loss attaches its modules the model's weights hold
    kind = input_kind(args.train_data, args.dataset_type)
    if kind == 'synthetic':
        return args.train_num_samples
    if kind == 'csv':
        return len(_training_csv(args)[0])
    return 0  # WebDataset without a store: the loss keeps no per-sample state (the checks make sure)
