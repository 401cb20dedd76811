"""drrho-openclip's single point of contact with OpenCLIP's training code (open_clip_train 3.3.x).

Two parts:

1. The import hook. `patches/open_clip-3.3.0-plugin-api.patch` adds a small plugin API to OpenCLIP (plugins found
   through the `open_clip_train.plugins` entry-point group; plugin flags, loss, data wrapper, per-sample batch
   extras, loss state in checkpoints, CPU DDP). Installed OpenCLIP files are never edited: when Python imports one of
   the patched modules, the hook applies that file's hunks to the source in memory, the way pytest rewrites asserts.
   The patch is the single source of truth, and it applies exactly or the import fails with a clear message.
2. The plugin itself (this module is the entry point): flags, loss creation, the dataloader wrapper attaching each
   sample's index and each batch's reference features, and model/optimizer set-up.
"""
import importlib.abc
import importlib.machinery
import importlib.metadata
import linecache
import logging
import math
import sys
from pathlib import Path

SUPPORTED_OPENCLIP = (3, 3)
PATCH_FILE = 'open_clip-3.3.0-plugin-api.patch'


class PluginActivationError(ImportError):
    pass


# --------------------------------------------------------------------------------------------------------------
# 1. The import hook


def patch_path() -> Path:
    """The patch shipped in the wheel (drrho_openclip/patches/) or, in a source checkout, the repo's patches/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / 'patches' / PATCH_FILE, here.parent / 'patches' / PATCH_FILE):
        if candidate.is_file():
            return candidate
    raise PluginActivationError(f"drrho-openclip: {PATCH_FILE} is missing from the installation; reinstall it")


def patches_by_module() -> dict:
    """{'open_clip_train.train': <whatthepatch diff>, ...} for every file the patch touches."""
    import whatthepatch
    diffs = {}
    for diff in whatthepatch.parse_patch(patch_path().read_text()):
        path = diff.header.new_path
        path = path[2:] if path.startswith('b/') else path
        diffs[path[:-len('.py')].replace('/', '.')] = diff
    return diffs


def check_openclip_version():
    try:
        version = importlib.metadata.version('open_clip_torch')
    except importlib.metadata.PackageNotFoundError:
        raise PluginActivationError("drrho-openclip: open_clip_torch is not installed") from None
    if tuple(int(v) for v in version.split('.')[:2]) != SUPPORTED_OPENCLIP:
        raise PluginActivationError(
            f"drrho-openclip supports open_clip_torch {'.'.join(map(str, SUPPORTED_OPENCLIP))}.x, found {version}: "
            f"install open_clip_torch=={'.'.join(map(str, SUPPORTED_OPENCLIP))}.* or uninstall drrho-openclip")
    return version


def patched_source(module: str, source: str, diff) -> str:
    import whatthepatch
    try:
        lines = whatthepatch.apply_diff(diff, source)
    except whatthepatch.exceptions.HunkApplyException as e:
        raise PluginActivationError(
            f"drrho-openclip: {PATCH_FILE} does not apply to {module} "
            f"(open_clip_torch {importlib.metadata.version('open_clip_torch')}): {e}") from e
    return '\n'.join(lines) + '\n'


class _PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, path, diff):
        super().__init__(fullname, path)
        self.diff = diff

    def exec_module(self, module):
        module.__drrho_patched__ = True
        super().exec_module(module)

    def get_source(self, fullname=None):
        return patched_source(self.name, self.get_data(self.path).decode('utf-8'), self.diff)

    def get_code(self, fullname):
        # Compiled fresh every time: a cached .pyc would be the unpatched file. The code's file name marks it as
        # patched, so tracebacks never quote lines of the file on disk; linecache finds the patched text through
        # get_source (the module's __loader__) whenever its cache is cleared.
        source = self.get_source()
        filename = f"{self.path} (patched by drrho-openclip)"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        return compile(source, filename, 'exec', dont_inherit=True)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.diffs = None

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(('open_clip.factory', 'open_clip_train.')):
            return None
        if self.diffs is None:
            check_openclip_version()
            self.diffs = patches_by_module()
        diff = self.diffs.get(fullname)
        if diff is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            raise PluginActivationError(f"drrho-openclip: cannot find the source of {fullname} to patch")
        spec.loader = _PatchedSourceLoader(fullname, spec.origin, diff)
        return spec


def install_import_hook():
    """Idempotent. Fails if a module to patch was already imported unpatched (the hook came too late)."""
    if any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        return
    finder = _PatchingFinder()
    too_late = [m for m in ('open_clip.factory', 'open_clip_train.params', 'open_clip_train.data',
                            'open_clip_train.train', 'open_clip_train.main')
                if m in sys.modules and not hasattr(sys.modules[m], '__drrho_patched__')]
    sys.meta_path.insert(0, finder)
    if too_late:
        raise PluginActivationError(f"drrho-openclip: {', '.join(too_late)} was imported before the plugin hook; "
                                    f"import drrho_openclip.plugin first (or run `python -m drrho_openclip.train`)")


# --------------------------------------------------------------------------------------------------------------
# 2. The plugin (entry point `open_clip_train.plugins: drrho = drrho_openclip.plugin`)

def _flag(option: str) -> str:
    return '--' + option.replace('_', '-')


def _user_options():
    """{option: (type, [losses that have it])} over every registered loss."""
    from .losses import get_loss_spec, list_losses
    from .losses import option_names
    options = {}
    for name in list_losses():
        for option in option_names(name):
            default = get_loss_spec(name).defaults[option]
            options.setdefault(option, (type(default), []))[1].append(name)
    return options


def add_args(parser):
    """`--loss`, the reference-feature and sample-index flags, and one flag per loss option (registry-driven, paper
    defaults)."""
    from .losses import get_loss_spec, list_losses
    from .losses import OPTION_HELP
    g = parser.add_argument_group('drrho-openclip: reference-model steering and DRO contrastive losses')
    g.add_argument('--loss', default='clip', choices=list_losses(), metavar='NAME',
                   help='; '.join(f"{n}: {get_loss_spec(n).help}" for n in list_losses()) + ' (default: %(default)s)')
    g.add_argument('--ref-features', metavar='DIR', default=None,
                   help='precomputed reference features (a store written by drrho-openclip-features)')
    g.add_argument('--ref-model', metavar='NAME', default=None,
                   help='compute reference features online with this OpenCLIP model (no gradient)')
    g.add_argument('--ref-pretrained', metavar='TAG_OR_FILE', default=None,
                   help='pretrained tag or checkpoint file of --ref-model')
    g.add_argument('--sample-index', metavar='DIR', default=None,
                   help='WebDataset input, for a loss that keeps per-sample state without --ref-features: the store '
                        'whose keys index the samples (`drrho-openclip-features --keys-only`; a feature store does '
                        'too)')
    from .losses import STATE_LAYOUTS
    for option, (kind, losses) in sorted(_user_options().items()):
        if option in ('gamma_decay_epochs', 'tile_size', 'state_layout'):  # set from the run, whatever the loss
            text = f"{OPTION_HELP[option]} [losses: {', '.join(losses)}]"
        else:
            defaults = ', '.join(f"{n} {get_loss_spec(n).defaults[option]}" for n in losses)
            text = f"{OPTION_HELP[option]} [losses and defaults: {defaults}]"
        if kind is bool:  # default None: tells 'not given' from the loss's own default
            g.add_argument(_flag(option), action='store_true', default=None, help=text)
        elif option == 'state_layout':
            g.add_argument(_flag(option), choices=STATE_LAYOUTS, default=None, help=text)
        else:
            g.add_argument(_flag(option), type=kind, default=None, metavar=option.upper(), help=text)


def _needs_reference(spec, options) -> bool:
    if spec.reference == 'optional':
        return getattr(options, 'distill_weight', 0) > 0 or getattr(options, 'reference_shift', False)
    return spec.reference == 'required'


def check_args(args, parser):
    """Validate the plugin flags against the chosen loss (a flag the loss does not read is an error) and record the
    values in force on `args` (so params.txt shows them)."""
    from .losses import create_loss as build, get_loss_spec, loss_options
    from .losses import per_sample_tables
    from .losses import option_names
    spec = get_loss_spec(args.loss)
    own = option_names(args.loss)
    given = {o: getattr(args, o) for o in _user_options() if getattr(args, o) is not None}
    foreign = [_flag(o) for o in given if o not in own]
    if foreign:
        parser.error(f"{', '.join(foreign)}: no such option for --loss {args.loss} (its options: "
                     f"{', '.join(map(_flag, own)) or 'none'})")
    if 'gamma_decay_epochs' in own:
        given.setdefault('gamma_decay_epochs', args.epochs)
    options = loss_options(args.loss, **given)
    if 'rho' in given and 'learn_temperature' in own and not options.learn_temperature:
        parser.error(f"--rho only acts with --learn-temperature for --loss {args.loss} (a fixed τ has no ρ term)")
    uses_reference = args.ref_features is not None or args.ref_model is not None
    if _needs_reference(spec, options) and not uses_reference:
        parser.error(f"--loss {args.loss} needs reference features: pass --ref-features DIR (precomputed with "
                     f"drrho-openclip-features) or --ref-model NAME --ref-pretrained TAG")
    if uses_reference and not _needs_reference(spec, options):
        parser.error(f"--loss {args.loss} with these options does not read reference features; drop "
                     f"--ref-features/--ref-model" + (" or set --reference-shift" if 'reference_shift' in own else ""))
    if args.ref_features is not None and args.ref_model is not None:
        parser.error("give either --ref-features or --ref-model, not both")
    if args.ref_pretrained is not None and args.ref_model is None:
        parser.error("--ref-pretrained needs --ref-model")
    try:  # the loss's own checks, on a stand-in of the run's sizes
        stand_in = build(args.loss, **given, **({'num_samples': 1} if spec.stateful else {}),
                         **({'embed_dim': 1} if 'embed_dim' in spec.defaults else {}))
    except ValueError as e:
        parser.error(f"--loss {args.loss}: {e}")
    for option in own:
        setattr(args, option, getattr(options, option))
    if 'tile_size' in own and 'tile_size' not in given:
        args.tile_size = None  # chosen from the global batch size once the world size is known (configure_model)
    if args.ref_features is not None:
        from .features import FeatureStore, FeatureStoreError
        try:
            store = FeatureStore.open(args.ref_features)
        except FeatureStoreError as e:
            parser.error(f"--ref-features: {e}")
        if store.keys_only:
            parser.error(f"--ref-features: '{store.root}' is a keys-only store: it holds no reference features (it "
                         f"can be a --sample-index)")
    _check_sample_index(args, parser, keeps_state=bool(per_sample_tables(stand_in)),
                        reads_reference=_needs_reference(spec, options))


def _input_kind(args) -> str:
    """'csv', 'synthetic' or 'webdataset': --dataset-type, or for 'auto' what OpenCLIP makes of --train-data."""
    if args.dataset_type != 'auto':
        return args.dataset_type
    return 'csv' if (args.train_data or '').split('::')[0].rsplit('.', 1)[-1].lower() in ('csv', 'tsv') \
        else 'webdataset'


def _check_sample_index(args, parser, keeps_state: bool, reads_reference: bool):
    """The dense sample index of a loss with per-sample state: CSV rows and the synthetic dataset's are their own;
    WebDataset samples are indexed by the keys of a store, --ref-features' or --sample-index's."""
    webdataset = args.train_data is not None and _input_kind(args) == 'webdataset'
    if args.sample_index is None:
        if keeps_state and webdataset and args.ref_features is None:
            parser.error(f"--loss {args.loss} keeps per-sample state, and WebDataset samples have no index of their "
                         f"own: write one with `drrho-openclip-features --keys-only --train-data '{args.train_data}' "
                         f"--output DIR` and pass --sample-index DIR"
                         + (" (or precompute the reference features: --ref-features indexes them too)"
                            if reads_reference else ""))
        return
    if not keeps_state:
        parser.error(f"--sample-index: --loss {args.loss} with these options keeps no per-sample state, so it needs no "
                     f"sample index" + (" (--gamma 1)" if args.gamma == 1 else ""))
    if args.ref_features is not None:
        parser.error("--sample-index: the --ref-features store already indexes the samples; drop --sample-index")
    if not webdataset:
        parser.error(f"--sample-index is for WebDataset input: the rows of --dataset-type {_input_kind(args)} input "
                     f"are its sample index already")
    from .features import FeatureStore, FeatureStoreError
    try:
        FeatureStore.open(args.sample_index)
    except FeatureStoreError as e:
        parser.error(f"--sample-index: {e}")


def _is_plain_clip(args) -> bool:
    return args.loss == 'clip' and not args.distill_weight


def _uses_logit_scale(loss) -> bool:
    """Whether the loss reads the model's learnable logit_scale (CLIP-style losses, a learnable global τ)."""
    from .losses import LogitScaleTemperature
    temperature = getattr(loss, 'temperature', None)
    return temperature is None or isinstance(temperature, LogitScaleTemperature)


def _sample_index_size(args) -> int:
    """Size of the dense sample index: the store's (--ref-features or --sample-index), a CSV's rows, or the
    synthetic dataset's size."""
    store = args.ref_features or args.sample_index
    if store is not None:
        from .features import FeatureStore
        return FeatureStore.open(store).num_samples
    kind = _input_kind(args)
    if kind == 'synthetic':
        return args.train_num_samples
    if kind == 'csv':
        import pandas as pd
        return len(pd.read_csv(args.train_data, sep=args.csv_separator, usecols=[args.csv_img_key]))
    return 0  # WebDataset without a store: the loss keeps no per-sample state (check_args makes sure)


# The untiled core holds a few b×B matrices per rank (b local, B global batch); the tiled one never more than b×T.
# From `benchmarks/tiled_memory.py` (one process, 1 thread, 2-core CPU): at B = 16384 (2^28 pairs, 1 GiB per float32
# matrix) untiled needs 5.0 GiB and 28 s, tiled 0.32 GiB and 46 s; at 4096, 0.31 vs 0.14 GiB and 1.1 vs 2.6 s. Tiling
# costs time, so it is chosen only where the untiled matrices reach gigabytes.
AUTO_TILE_FROM_PAIRS = 1 << 28


def auto_tile_size(local_batch: int, global_batch: int) -> int:
    from .losses import DEFAULT_TILE_SIZE
    return DEFAULT_TILE_SIZE if local_batch * global_batch >= AUTO_TILE_FROM_PAIRS else 0


def configure_model(model, args):
    """Build the plugin's loss now, before the optimizer, DDP and resume see the model: a loss with learnable
    modules (TempNet) attaches them to the model. A τ the loss does not learn through logit_scale freezes the
    model's logit_scale (at log 1/τ, so logs show the τ in force): DDP must not wait for a gradient it never gets."""
    if _is_plain_clip(args):
        return
    import open_clip
    import torch
    from .losses import attach_to_model, create_loss as build, get_loss_spec
    from .losses import option_names
    spec = get_loss_spec(args.loss)
    options = {o: getattr(args, o) for o in option_names(args.loss)}
    if spec.stateful:
        args.sample_index_size = options['num_samples'] = _sample_index_size(args)
    if 'embed_dim' in spec.defaults:
        options['embed_dim'] = open_clip.get_model_config(args.model)['embed_dim']
    if 'tile_size' in options and options['tile_size'] is None:
        args.tile_size = options['tile_size'] = auto_tile_size(args.batch_size, args.batch_size * args.world_size)
    loss = build(args.loss, **options, rank=args.rank, world_size=args.world_size, local_loss=args.local_loss,
                 gather_with_grad=args.gather_with_grad)
    sharding = getattr(loss, 'sharding', None)
    if 'state_layout' in options and sharding is not None:
        args.state_layout = sharding.layout  # 'auto' resolved from the dataset size and the world size
        if sharding.sharded:
            logging.info(f"drrho-openclip: per-sample state sharded over {args.world_size} ranks, "
                         f"{sharding.size} of {sharding.num_samples} rows on rank {args.rank}")
    attached = attach_to_model(model, loss)
    if attached:
        logging.info(f"drrho-openclip: attached {', '.join(attached)} to the model (optimised and checkpointed "
                     f"with it)")
    temperature = getattr(args, 'temperature', None)
    if temperature is not None:
        with torch.no_grad():
            model.logit_scale.fill_(math.log(1.0 / temperature))
    if not _uses_logit_scale(loss):
        model.logit_scale.requires_grad_(False)
    args.plugin_loss = loss


def create_loss(args):
    """The loss built in configure_model, or None for plain `--loss clip`: OpenCLIP then builds its own loss
    exactly as without the plugin."""
    if _is_plain_clip(args):
        return None
    loss = args.plugin_loss
    if args.ref_model is not None:
        loss.reference_encoder = OnlineReference(args)
    settings = ', '.join(f"{o}={getattr(args, o)}" for o in sorted(_user_options()) if hasattr(args, o)
                         and getattr(args, o) is not None)
    logging.info(f"drrho-openclip: --loss {args.loss} ({type(loss).__name__}): {settings}")
    return loss


# --------------------------------------------------------------------------------------------------------------
# Sharded per-sample state in OpenCLIP's checkpoints
#
# With --state-layout sharded every rank writes its block of the per-sample tables next to the checkpoint, as the
# shard set  checkpoints/epoch_N.loss_state/rank-R-of-W.shard  (losses/state_shards.py), before rank 0 writes
# epoch_N.pt (and epoch_latest.pt with --save-most-recent, which refers to the same set): a checkpoint file never
# exists without its complete set. The checkpoint's 'loss_state' holds the loss's other entries and the set's
# manifest under SHARDS_KEY. Nothing there ends in .pt, so `--resume latest` (the newest **/*.pt) never picks it.

SHARDS_KEY = 'per_sample_state_shards'
SHARD_SET_SUFFIX = '.loss_state'
LATEST_CHECKPOINT_NAME = 'epoch_latest.pt'  # open_clip_train.main's


def _sharded(loss) -> bool:
    sharding = getattr(loss, 'sharding', None)
    return sharding is not None and sharding.sharded


def _writes_checkpoint(completed_epoch, args) -> bool:
    """Whether OpenCLIP's rank 0 writes a checkpoint after this epoch (its own conditions, on every rank)."""
    if not args.logs or args.logs.lower() == 'none':
        return False
    return (completed_epoch == args.epochs or args.save_most_recent
            or (args.save_frequency > 0 and completed_epoch % args.save_frequency == 0))


def checkpoint_loss_state(loss, loss_state, completed_epoch, args):
    """Every rank, before rank 0 writes the epoch's checkpoints: what goes into checkpoint['loss_state']."""
    if not _sharded(loss):
        return loss_state  # the whole state_dict, in the checkpoint (rank 0's replicated tables)
    if not _writes_checkpoint(completed_epoch, args):
        return {}
    import os
    from .losses import per_sample_tables
    from .losses import save_state_shards
    directory = os.path.join(args.checkpoint_path, f'epoch_{completed_epoch}{SHARD_SET_SUFFIX}')
    manifest = save_state_shards(loss, directory)
    tables = per_sample_tables(loss)
    return {**{k: v for k, v in loss_state.items() if k not in tables}, SHARDS_KEY: manifest}


def resolve_loss_state(loss, loss_state, args):
    """Every rank, on resume: the checkpoint's loss state with a shard set read in (this rank's rows of it)."""
    manifest = loss_state.get(SHARDS_KEY) if isinstance(loss_state, dict) else None
    if manifest is None:
        return loss_state
    import os
    from .losses import load_state_shards
    if '://' in str(args.resume):
        raise RuntimeError(f"the per-sample state of this checkpoint is a shard set next to it: resume from a local "
                           f"(or mounted) copy of the checkpoint directory, with its "
                           f"'{manifest.get('directory')}' directory")
    directory = os.path.join(os.path.dirname(os.path.abspath(args.resume)), manifest['directory'])
    tables = load_state_shards(loss, directory, manifest)
    sharding = getattr(loss, 'sharding', None)
    logging.info(f"drrho-openclip: per-sample state read from '{directory}' ({manifest['world_size']} shards), "
                 f"rows {sharding.start}-{sharding.stop} of {sharding.num_samples} on rank {args.rank}")
    return {**{k: v for k, v in loss_state.items() if k != SHARDS_KEY}, **tables}


def _shard_set_of(checkpoint_file: Path):
    import torch
    try:
        state = torch.load(checkpoint_file, map_location='cpu', mmap=True, weights_only=False).get('loss_state', {})
    except Exception:  # noqa: BLE001 - unreadable: keep every set
        return None
    return state.get(SHARDS_KEY, {}).get('directory', '') if isinstance(state, dict) else ''


def checkpoints_saved(completed_epoch, args):
    """Rank 0, after every rank passed the barrier behind the save: remove the shard sets that no checkpoint refers
    to any more (that of a deleted epoch_N.pt, with --delete-previous-checkpoint; that of a superseded
    epoch_latest.pt) and the staging directories of interrupted saves."""
    import re
    import shutil
    if args.rank != 0 or not _sharded(getattr(args, 'plugin_loss', None)) or not _writes_checkpoint(
            completed_epoch, args):
        return
    root = Path(args.checkpoint_path)
    latest = root / LATEST_CHECKPOINT_NAME
    if args.save_most_recent:
        kept_by_latest = f'epoch_{completed_epoch}{SHARD_SET_SUFFIX}'
    else:
        kept_by_latest = _shard_set_of(latest) if latest.is_file() else ''
        if kept_by_latest is None:
            return
    pattern = re.compile(rf'epoch_(\d+){re.escape(SHARD_SET_SUFFIX)}(\.tmp-[0-9a-f]+)?')
    for path in root.iterdir():
        match = pattern.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        staging, epoch = match.group(2), int(match.group(1))
        if staging or (path.name != kept_by_latest and not (root / f'epoch_{epoch}.pt').is_file()):
            shutil.rmtree(path, ignore_errors=True)


class OnlineReference:
    """Reference features computed on the fly from the learner's batch (its augmentation and tokenizer)."""

    def __init__(self, args):
        import open_clip
        import torch
        learner, ref = open_clip.get_model_config(args.model), open_clip.get_model_config(args.ref_model)
        if learner is not None and ref is not None:
            for part, key in (('vision_cfg', 'image_size'), ('text_cfg', 'context_length'), ('text_cfg', 'vocab_size')):
                a, b = learner[part].get(key), ref[part].get(key)
                if a != b:
                    raise ValueError(f"--ref-model {args.ref_model} has {key}={b}, the learner {a}: it cannot read the "
                                     f"learner's batches; precompute its features with drrho-openclip-features")
        from .precompute import create_model
        self.model = create_model(args.ref_model, args.ref_pretrained, args.device)[0].requires_grad_(False)
        self.no_grad = torch.no_grad

    def __call__(self, images, texts):
        with self.no_grad():
            return self.model.encode_image(images, normalize=True), self.model.encode_text(texts, normalize=True)


def wrap_data(data, args, preprocess_fns, epoch=0, tokenizer=None):
    """Attach `{'index', ['ref_image_features', 'ref_text_features']}` to every training batch: the index per
    sample, the reference features per batch once it is collated."""
    if 'train' not in data or _is_plain_clip(args):
        return data
    from open_clip_train.data import CsvDataset, SyntheticDataset
    from .features import FeatureStore
    store = FeatureStore.open(args.ref_features) if args.ref_features else None
    info = data['train']
    dataset = getattr(info.dataloader, 'dataset', None)  # WebDataset's WebLoader has none
    if isinstance(dataset, (CsvDataset, SyntheticDataset)):
        if store is not None:
            if isinstance(dataset, SyntheticDataset):
                raise ValueError("--ref-features cannot describe --dataset-type synthetic")
            check_csv_keys(store, args.train_data, dataset.images)
            if store.num_samples != len(dataset):  # the row number is the dense index: no other shard may come first
                raise ValueError(f"'{store.root}' holds {store.num_samples} reference features, the dataset has "
                                 f"{len(dataset)} samples")
        data['train'] = _map_loader_with_extras(info, dataset, store, args)
    else:
        index = FeatureStore.open(args.sample_index) if args.sample_index else store
        data['train'] = _wds_with_extras(args, preprocess_fns[0], index, store, epoch, tokenizer)
    return data


def check_csv_keys(store, csv_path, images):
    from .features import FeatureStoreError, shard_name
    shard = store.shard(shard_name(csv_path))
    keys = store.keys(shard.name)
    if len(keys) != len(images):
        raise FeatureStoreError(f"'{store.root}' has {len(keys)} reference features for '{csv_path}', "
                                f"which has {len(images)} rows")
    for row, (key, image) in enumerate(zip(keys, images)):
        if str(key) != str(image):
            raise FeatureStoreError(f"'{store.root}' was computed for another CSV: row {row} is '{key}' there and "
                                    f"'{image}' in '{csv_path}'")


def _map_loader_with_extras(info, dataset, store, args):
    """OpenCLIP's CSV/synthetic loader, with the extras, and always a seeded DistributedSampler (one replica when not
    distributed) so that each epoch's order is a function of (seed, epoch): exact resume, equal across world sizes."""
    from torch.utils.data import DataLoader, DistributedSampler
    from open_clip_train.data import DataInfo
    from .data import CollateWithReferenceFeatures, WithSampleExtras
    sampler = DistributedSampler(dataset, num_replicas=args.world_size, rank=args.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(WithSampleExtras(dataset, sampler, args.seed), batch_size=args.batch_size,
                        num_workers=args.workers, pin_memory=info.dataloader.pin_memory, sampler=sampler,
                        drop_last=True, collate_fn=None if store is None else CollateWithReferenceFeatures(store))
    loader.num_samples, loader.num_batches = info.dataloader.num_samples, len(loader)
    return DataInfo(loader, sampler)


def _wds_with_extras(args, preprocess_img, index, store, epoch, tokenizer):
    """OpenCLIP's training WebDataset pipeline (open_clip_train.data.get_wds_dataset, is_train=True), keeping each
    sample's shard and `__key__` long enough to look its index up in the `index` store; the reference features of
    `store` are added to each batch as it is collated."""
    import webdataset as wds
    from torch.utils.data import default_collate
    from open_clip_train import data as oc
    from .data import CollateWithReferenceFeatures, SampleIndexFromKey

    input_shards = args.train_data
    resampled = args.dataset_resampled
    num_shards = None
    if args.train_num_samples is not None:
        num_samples = args.train_num_samples
    else:
        num_samples, num_shards = oc.get_dataset_size(input_shards)
        if not num_samples:
            raise RuntimeError('the number of training samples is unknown: pass --train-num-samples')
    shared_epoch = oc.SharedEpoch(epoch=epoch)
    if resampled:
        pipeline = [oc.ResampledShards2(input_shards, weights=args.train_data_upsampling_factors,
                                        deterministic=True, epoch=shared_epoch)]
    else:
        pipeline = [wds.SimpleShardList(input_shards),
                    oc.detshuffle2(bufsize=oc._SHARD_SHUFFLE_SIZE, initial=oc._SHARD_SHUFFLE_INITIAL,
                                   seed=args.seed, epoch=shared_epoch),
                    wds.split_by_node, wds.split_by_worker]
    pipeline.extend([
        oc.tarfile_to_samples_nothrow,
        wds.shuffle(bufsize=oc._SAMPLE_SHUFFLE_SIZE, initial=oc._SAMPLE_SHUFFLE_INITIAL),
        wds.select(oc.filter_no_caption_or_no_image),
        wds.decode("pilrgb", handler=oc.log_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess_img, text=lambda text: tokenizer(text)[0]),
        wds.map(SampleIndexFromKey(index)),
        wds.to_tuple("image", "text", "extras"),
        wds.batched(args.batch_size, partial=False,
                    collation_fn=default_collate if store is None else CollateWithReferenceFeatures(store)),
    ])
    dataset = wds.DataPipeline(*pipeline)
    if not resampled:
        num_shards = num_shards or len(oc.expand_urls(input_shards)[0])
        if num_shards < args.workers * args.world_size:
            raise ValueError(f"{num_shards} shards cannot feed {args.workers} workers x {args.world_size} ranks")
    global_batch_size = args.batch_size * args.world_size
    num_worker_batches = math.ceil(math.ceil(num_samples / global_batch_size) / max(1, args.workers))
    num_batches = num_worker_batches * max(1, args.workers)
    dataset = dataset.with_epoch(num_worker_batches)
    loader = wds.WebLoader(dataset, batch_size=None, shuffle=False, num_workers=args.workers,
                           persistent_workers=args.workers > 0)
    loader.num_batches = num_batches
    loader.num_samples = num_batches * global_batch_size
    return oc.DataInfo(dataloader=loader, shared_epoch=shared_epoch)
