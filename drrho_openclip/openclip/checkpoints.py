"""Sharded per-sample state in OpenCLIP's checkpoints.

With --state-layout sharded every rank writes its block of the per-sample tables next to the checkpoint, as the
shard set  checkpoints/epoch_N.loss_state/rank-R-of-W.shard  (losses/state.py), before rank 0 writes the
epoch's checkpoint files (epoch_N.pt, and epoch_latest.pt with --save-most-recent, which refers to the same set): a
checkpoint file never exists without its complete set. The checkpoint's 'loss_state' holds the loss's other entries
and the set's manifest under SHARDS_KEY. Nothing there ends in .pt, so `--resume latest` (the newest **/*.pt) never
picks it. Which files are written, and where, main.py says (the hooks' `checkpoint_files`).

Every checkpoint of a plugin loss also records the run that wrote it under RUN_KEY (`Run.provenance`): resuming it
with another --loss, or onto a sample index whose rows are other samples, stops; another reference model or other
loss options are resumed with a warning naming them."""
import logging
import os
import re
import shutil
import socket
import time
import uuid
import zipfile
from pathlib import Path

import torch

from ..losses import (ATTACHED_PREFIX, REFERENCE_SCALE_STATE_KEYS, attached_names, load_state_shards, per_sample_tables,
                      save_state_shards)
from ..losses.collectives import broadcast_object, ranks_where, run_log
from .flags import CHOSEN_BY_THE_RUN, csv_fingerprint_as_written, flag, trains
from .run import Run

SHARDS_KEY = 'per_sample_state_shards'
RUN_KEY = 'drrho_openclip_run'
SHARD_SET_SUFFIX = '.loss_state'
# a set, or the staging (.tmp-) or replaced (.old-) directory a killed save left behind
SHARD_SET = re.compile(rf'epoch_(\d+){re.escape(SHARD_SET_SUFFIX)}(\.(?:tmp|old)-[0-9a-f]+)?')
EPOCH_CHECKPOINT = re.compile(r'epoch_(\d+)\.pt')
MARK_WAIT_SECONDS = 5  # how long a rank looks for rank 0's mark in the checkpoint folder before it says it is unseen


def _sharded(loss) -> bool:
    sharding = getattr(loss, 'sharding', None)
    return sharding is not None and sharding.sharded


def checkpoint_loss_state(run: Run, loss, loss_state, completed_epoch, checkpoint_files, args):
    """Every rank, before rank 0 writes `checkpoint_files`: what goes into checkpoint['loss_state'] (nothing of the
    plugin's for plain `--loss clip`: OpenCLIP's own run)."""
    if run.plain_clip:
        return loss_state
    if not _sharded(loss):
        return {**loss_state, RUN_KEY: run.provenance}  # the whole state_dict (rank 0's replicated tables)
    if not checkpoint_files:
        return {}
    directory = Path(checkpoint_files[0]).parent / f'epoch_{completed_epoch}{SHARD_SET_SUFFIX}'
    manifest = save_state_shards(loss, str(directory))
    tables = per_sample_tables(loss)
    return {**{k: v for k, v in loss_state.items() if k not in tables}, SHARDS_KEY: manifest,
            RUN_KEY: run.provenance}


def check_resumed_loss(loss, run: Run, args):
    """Before the optimizer state is read: a checkpoint whose loss state is not this loss's (`loss` None: OpenCLIP's
    own, which keeps none) stops the run, naming the --loss or the keys that differ; it was written with another
    --loss or other state flags, whose optimizer groups and state differ too, which torch reports without the
    cause. So does one whose per-sample state is of other samples (`_stop_on_another_run`). Local files here; a remote
    checkpoint is read once, by OpenCLIP, and its loss state checked when it arrives (`resolve_loss_state`)."""
    if run.resume_latest:
        # rank 0's pick on every rank, as OpenCLIP broadcasts its own: ranks may list a shared folder differently
        # (a stale listing under load), and ranks that resume different epochs train apart until a save fails
        pick, error = None, None
        if args.rank == 0:
            try:
                pick = _newest_complete_checkpoint(Path(args.checkpoint_path), args)
            except Exception as e:  # noqa: BLE001 - stopped on every rank below, not on rank 0 alone
                error = f"'{args.checkpoint_path}': {type(e).__name__}: {e}"
        pick, error = broadcast_object((pick, error), args.world_size, torch.device(args.device))
        if error:
            raise SystemExit(f"drrho-openclip: --resume latest: rank 0 could not choose the checkpoint to resume in "
                             f"{error}")
        args.resume = pick
    if not args.resume or not os.path.isfile(args.resume):
        return
    loss_name = run.loss_name
    checkpoint = _resumed_checkpoint(args.resume)  # read once (memory-mapped) for every check below
    # without an epoch, a model's weights alone: OpenCLIP loads them and starts a new run, reading no loss state
    bare = 'epoch' not in checkpoint
    model = checkpoint if bare else checkpoint.get('state_dict', {})
    weights = {k.removeprefix('module.'): v for k, v in model.items()}
    if loss is not None:
        _check_attached_sizes(loss, weights, args)
    if bare and any(k.startswith('module.') for k in model) != bool(args.distributed):
        # OpenCLIP loads weights alone as they are written (a checkpoint's, it strips or adds DDP's prefix)
        written = "with DDP's 'module.' prefix" if not args.distributed else "without DDP's 'module.' prefix"
        raise SystemExit(f"drrho-openclip: --resume '{args.resume}' holds a model's weights alone, {written}, which "
                         f"OpenCLIP loads into this run's model as written, and fails. {_start_from(args, weights)}")
    if bare or not trains(args):  # no loss state is read, but the model's weights are, strictly
        saved = {k.split('.')[0] for k in weights if k.startswith(ATTACHED_PREFIX)}
        own = set(attached_names(loss)) if loss is not None else set()
        if saved != own:
            raise SystemExit(f"drrho-openclip: --resume '{args.resume}' holds the model of a loss that attached "
                             f"{', '.join(sorted(saved)) or 'no modules'} to it (TempNet's: --loss tempnet), this "
                             f"run's --loss {loss_name} attaches {', '.join(sorted(own)) or 'none'}: "
                             f"{'train' if trains(args) else 'evaluate'} with the --loss flags it was trained with")
        if bare and trains(args):
            run_log.info(f"drrho-openclip: --resume '{args.resume}' holds a model's weights only (no epoch): "
                         f"OpenCLIP starts a new run from them, and the loss's state starts anew")
        return
    if checkpoint.get('epoch', 0) >= args.epochs:  # OpenCLIP then ends without a word
        run_log.warning(f"drrho-openclip: --resume '{args.resume}' is at epoch {checkpoint['epoch']} of --epochs "
                        f"{args.epochs}: the run is complete and trains nothing more (a variant needs its own --name; "
                        f"more --epochs train on, with the schedules stretched to the new length)")
    check_loss_state(checkpoint.get('loss_state') or {}, loss, run, args, weights)


def _newest_complete_checkpoint(folder: Path, args):
    """What `--resume latest` resumes: the newest complete checkpoint of the run (rank 0, before the checkpoint is
    read), or OpenCLIP's pick where that is remote (--remote-sync).
    OpenCLIP's pick can be another: with --save-most-recent it is epoch_latest.pt, which a save killed while writing
    it (through tmp.pt) leaves an epoch behind epoch_N.pt, and without which the run starts from scratch over the
    epochs there; without it, the last *.pt by name, where a stale epoch_latest.pt of an earlier run comes before
    later epochs and a tmp.pt left by a killed save before everything. Every epoch_N.pt and epoch_latest.pt is
    whole (written to a temporary name, then renamed); tmp.pt never is."""
    if args.resume and not os.path.isfile(args.resume):  # a remote one: OpenCLIP's pick
        return args.resume
    complete = [(int(m.group(1)), path) for path in folder.glob('epoch_*.pt')
                for m in [EPOCH_CHECKPOINT.fullmatch(path.name)] if m]
    latest = folder / 'epoch_latest.pt'
    if latest.is_file():  # after an epoch_N.pt of its epoch: what OpenCLIP picks where both are there
        complete.append((_checkpoint_of(latest).get('epoch', 0) + 0.5, latest))
    newest = str(max(complete)[1]) if complete else None
    if _absolute(newest) != _absolute(args.resume):
        picked = f"'{args.resume}'" if args.resume else 'none'
        logging.warning(f"drrho-openclip: --resume latest resumes from '{newest}', the newest complete checkpoint of "
                        f"the run, where OpenCLIP picked {picked} (a save that did not finish, an epoch_latest.pt "
                        f"older than the epochs there, or none with --save-most-recent)" if newest else
                        f"drrho-openclip: --resume latest starts from scratch: the run has no complete checkpoint, "
                        f"and OpenCLIP picked '{args.resume}', left by a save that did not finish")
    return newest


def _absolute(path):
    """A path compared as a file, not as text: OpenCLIP's pick keeps the './' of --logs' default, Path drops it."""
    return os.path.abspath(path) if path else None


def check_checkpoint_folder_shared(args, device: torch.device):
    """Sharded state (every rank calls this): each rank writes its block next to rank 0's checkpoints, which OpenCLIP
    alone never needs, so a --logs folder local to each node passed its start-up and failed at the first save, after
    an epoch of training. Rank 0 leaves a mark in the checkpoint folder; every rank must see it."""
    if not args.logs or args.logs.lower() == 'none' or args.world_size == 1:
        return
    folder = Path(args.checkpoint_path)
    mark = folder / f".drrho-openclip-shared-{broadcast_object(uuid.uuid4().hex, args.world_size, device)}"
    written = True
    if args.rank == 0:
        try:
            mark.touch()
        except OSError as e:
            written = False
            logging.error(f"drrho-openclip: cannot write in the checkpoint folder '{folder}': {e}")
    if ranks_where(not written, args.world_size, device):  # and the mark is there before any rank looks
        raise SystemExit(f"drrho-openclip: rank 0 cannot write in the checkpoint folder '{folder}'")
    seen = _exists(mark)
    for _ in range(MARK_WAIT_SECONDS):  # a network file system may show a new file to other hosts a moment later
        if seen:
            break
        time.sleep(1)
        seen = _exists(mark)
    if not seen:
        logging.error(f"drrho-openclip: rank {args.rank} (host {socket.gethostname()}) does not see the checkpoint "
                      f"folder '{folder}' that rank 0 writes")
    unseen = ranks_where(not seen, args.world_size, device)
    if args.rank == 0:
        mark.unlink(missing_ok=True)
    if unseen:
        raise SystemExit(f"drrho-openclip: {unseen} of {args.world_size} ranks do not see the checkpoint folder "
                         f"'{folder}' that rank 0 writes, and with the per-sample state sharded every rank writes its "
                         f"block there: give --logs a folder every node shares, or --state-layout replicated")


def _exists(path: Path) -> bool:
    """Path.exists, False where the folder cannot be searched (raising here would leave the other ranks waiting)."""
    try:
        return path.exists()
    except OSError:
        return False


def check_loss_state(saved: dict, loss, run: Run, args, weights: dict):
    """A checkpoint's loss state (`saved`) against this run's loss (None: OpenCLIP's own); `weights`, the checkpoint's
    model without DDP's 'module.', only shape the advice (empty where OpenCLIP has them and the plugin does not)."""
    record = saved.get(RUN_KEY)
    if record is not None:
        _stop_on_another_run(record, run, args, weights)
    # KD added or dropped, a reference scale 'auto' or given: chosen on the first batch, or left (`resolve_loss_state`)
    own = set(loss.state_dict()) - REFERENCE_SCALE_STATE_KEYS if loss is not None else set()
    tables = set(per_sample_tables(loss)) if loss is not None else set()
    # a shard set stands for the per-sample tables, which a checkpoint of a replicated run holds itself
    saved = set(saved) - {SHARDS_KEY, RUN_KEY} - REFERENCE_SCALE_STATE_KEYS | (tables if SHARDS_KEY in saved else set())
    # tables alone missing: the loss's own message says it, unless nothing records a run (OpenCLIP's own --loss clip,
    # whose model and optimizer differ too: torch would stop first, without the cause)
    plain = record is None and not saved
    if saved != own and (plain or not (saved < own and own - saved <= tables)):
        differ = sorted(saved ^ own)
        which = ("holds no loss state (a run of OpenCLIP's own --loss clip, or of a loss without per-sample state), "
                 f"which this run's --loss {run.loss_name} keeps" if plain else
                 f"holds the loss state of another loss or other flags than this run's --loss {run.loss_name}")
        raise SystemExit(f"drrho-openclip: --resume '{args.resume}' {which} (differing: {', '.join(differ[:4])}"
                         f"{', ...' if len(differ) > 4 else ''}; the checkpoint has {len(saved)} entries, this loss "
                         f"{len(own)}). {_new_run(args, weights)}")
    if record is not None:  # once nothing stops the run: a change is not announced and then refused
        _warn_of_changes(record, run, args, shifted_state=bool(tables) and getattr(loss, 'reference_shift', False))


def _check_attached_sizes(loss, weights: dict, args):
    """The networks a loss attaches to the model (TempNet's) against those the checkpoint's model holds (`weights`,
    without DDP's 'module.'): other sizes (--tempnet-width, --tempnet-prototypes) stop the run, naming them, before
    the model's strict load fails."""
    for name in attached_names(loss):
        for key, value in getattr(loss, name.removeprefix(ATTACHED_PREFIX)).state_dict().items():
            saved = weights.get(f'{name}.{key}')
            if saved is not None and tuple(saved.shape) != tuple(value.shape):
                raise SystemExit(f"drrho-openclip: --resume '{args.resume}' holds {name}.{key} of shape "
                                 f"{tuple(saved.shape)}, this run's --loss {args.loss} one of {tuple(value.shape)}: "
                                 f"give the --tempnet-width and --tempnet-prototypes it was trained with")


def _stop_on_another_run(saved: dict, run: Run, args, weights: dict):
    """The run that wrote the checkpoint (its RUN_KEY) against this one: another --loss, or per-sample state whose
    rows are other samples, stops."""
    resume = f"drrho-openclip: --resume '{args.resume}'"
    new_run = _new_run(args, weights)
    if saved.get('loss') != run.loss_name:
        raise SystemExit(f"{resume} was trained with --loss {saved.get('loss')}, this run's is --loss "
                         f"{run.loss_name}. {new_run}")
    samples = run.provenance.get('samples')
    if saved.get('samples') not in (None, samples) and samples is not None \
            and saved['samples'] != csv_fingerprint_as_written(args):
        raise SystemExit(f"{resume} holds per-sample state whose rows are other samples than this run's: the sample "
                         f"index of --train-data (a CSV's image paths row by row, or the shards of --ref-features or "
                         f"--sample-index) is not the one it was trained on, so each sample would resume another's "
                         f"state. Resume with the data and store it was trained with. {new_run}")


def _warn_of_changes(saved: dict, run: Run, args, shifted_state: bool):
    """What the resumed run changes of the one that wrote the checkpoint (its RUN_KEY), as warnings: another reference
    model, another global batch, another length, other loss options. `shifted_state`: this run's loss keeps
    per-sample state of a reference-shifted loss."""
    resume = f"drrho-openclip: --resume '{args.resume}'"
    if saved.get('reference') != run.provenance.get('reference'):
        run_log.warning(f"{resume} was trained with {saved.get('reference') or 'no reference model'}, this run "
                        f"reads {run.provenance.get('reference') or 'none'}" +
                        (": its per-sample state was estimated under the other reference's shift, and follows this "
                         "one's within about an epoch" if shifted_state else ""))
    batch = run.provenance.get('global_batch')
    if saved.get('global_batch') not in (None, batch):
        run_log.warning(f"{resume} was trained at global batch {saved['global_batch']}, this run's is {batch} "
                        f"(--batch-size × --accum-freq × processes): what the loss takes from the batch follows it "
                        f"(ρ auto, τ's --lr-tau auto through the run's steps, an auto --tile-size)")
    if saved.get('epochs') not in (None, args.epochs):
        run_log.warning(f"{resume} was trained with --epochs {saved['epochs']}, this run's is {args.epochs}: the "
                        f"schedules that follow the run's length start over at its new length (OpenCLIP's learning "
                        f"rate, --lr-tau auto), so the resumed epochs are not those of a run of {args.epochs} epochs")
    options, saved_options = run.provenance.get('options', {}), saved.get('options', {})
    # where the per-sample rows live and how the matrix is tiled change no value (and follow the number of ranks)
    changed = [f"{flag(o)} {saved_options.get(o)} -> {options.get(o)}"
               for o in sorted((set(options) | set(saved_options)) - set(CHOSEN_BY_THE_RUN))
               if saved_options.get(o) != options.get(o)]
    if changed:
        # a learned τ (isogclr's per-sample ones have no switch) is state: the checkpoint's, not a new start
        restored = 'temperature' in options and options.get('learn_temperature', True) and \
            saved_options.get('temperature') != options['temperature']
        run_log.warning(f"{resume} was trained with other --loss {run.loss_name} options; resuming with "
                        f"{', '.join(changed)}" + ("; a learned τ resumes from the checkpoint's, so --temperature, "
                                                   "the start of a new run, does not apply" if restored else ""))


def _new_run(args, weights: dict) -> str:
    """What to do instead of resuming: a new run, from the checkpoint's weights (`weights`, without DDP's 'module.')
    where --pretrained can load them."""
    return f"Train another loss or data as a new run (another --name); {_start_from(args, weights)}"


def _start_from(args, weights: dict) -> str:
    """How a new run starts from the weights of --resume's file (`weights`, without DDP's 'module.')."""
    if (args.model or '').startswith('local-dir:'):
        return ("OpenCLIP reads a local-dir: model's weights from its folder, not from --pretrained: to start from "
                "this checkpoint, copy the folder, put the checkpoint in the copy as open_clip_pytorch_model.bin and "
                "train --model local-dir:<the copy>")
    if any(k.startswith(ATTACHED_PREFIX) for k in weights):
        return "its model also holds TempNet's networks, which --pretrained does not load"
    return f"--pretrained '{args.resume}' starts it from those weights"


def resolve_loss_state(run: Run, loss, loss_state, args):
    """Every rank, on resume: the checkpoint's loss state without the run it records, and with a shard set read in
    (this rank's rows of it). A remote checkpoint (a URL: --remote-sync's `--resume latest`) is checked here, as
    `check_resumed_loss` checks a local one."""
    if not isinstance(loss_state, dict):
        return loss_state
    remote = not os.path.isfile(args.resume)
    if remote:
        check_loss_state(loss_state, None if run.plain_clip else loss, run, args, weights={})
    loss_state = {k: v for k, v in loss_state.items() if k != RUN_KEY}
    own = loss.state_dict()
    for key in REFERENCE_SCALE_STATE_KEYS:
        if key in own and key not in loss_state:  # KD added, or 'auto' where a number was given: chosen anew
            loss_state[key] = own[key]
        if key not in own:  # KD dropped, or the scale given: nothing to restore
            loss_state.pop(key, None)
    manifest = loss_state.get(SHARDS_KEY)
    if manifest is None:
        return loss_state
    resume = f"drrho-openclip: --resume '{args.resume}'"
    if remote:
        raise SystemExit(f"{resume}: its per-sample state is a shard set next to it ('{manifest.get('directory')}'), "
                         f"which is read from files: resume from a local or mounted copy of the checkpoint folder")
    # next to the checkpoint file itself: a link to it (best.pt -> epoch_7.pt) may sit elsewhere
    directory = os.path.join(os.path.dirname(os.path.realpath(args.resume)), manifest['directory'])
    try:
        tables = load_state_shards(loss, directory, manifest)
    except RuntimeError as e:  # a set missing, incomplete or of another checkpoint: the message names the file
        raise SystemExit(f"{resume}: {e}") from None
    sharding = getattr(loss, 'sharding', None)
    logging.info(f"drrho-openclip: per-sample state read from '{directory}' ({manifest['world_size']} shards), "
                 f"rows {sharding.start}-{sharding.stop} of {sharding.num_samples} on rank {args.rank}")
    return {**{k: v for k, v in loss_state.items() if k != SHARDS_KEY}, **tables}


def checkpoints_saved(run: Run, completed_epoch, checkpoint_files, args):
    """Rank 0, once every rank has saved: the shard sets no checkpoint refers to any more go, also in a run that
    does not shard (it may have resumed a sharded run's checkpoint from its own folder)."""
    if args.rank == 0 and checkpoint_files:
        remove_unreferenced_shard_sets(Path(checkpoint_files[0]).parent, completed_epoch, checkpoint_files)


def _checkpoint_of(checkpoint_file) -> dict:
    """A checkpoint file's contents, memory-mapped: its tensors are not read."""
    return torch.load(checkpoint_file, map_location='cpu', mmap=True, weights_only=False)


def _resumed_checkpoint(checkpoint_file) -> dict:
    """`_checkpoint_of` the file --resume names, which stops the run naming the file where it cannot be read: torch's
    errors name neither, and for a file that is no checkpoint advise saving it again."""
    try:
        return _checkpoint_of(checkpoint_file)
    except Exception as e:  # noqa: BLE001 - any failure to read it is the file's; every rank reads it alike
        why = (f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if zipfile.is_zipfile(checkpoint_file) else
               "a checkpoint is the zip archive torch.save writes, and this file is none: cut short (an unfinished "
               "copy?) or another kind of file")
        raise SystemExit(f"drrho-openclip: --resume '{checkpoint_file}' cannot be read as a checkpoint ({why})") \
            from None


def _loss_state_of(checkpoint_file):
    """A checkpoint file's loss_state (None if it has none), memory-mapped."""
    return _checkpoint_of(checkpoint_file).get('loss_state')


def _shard_set_of(checkpoint_file: Path):
    """The shard set a checkpoint refers to ('' for none), or None if it cannot be read."""
    try:
        state = _loss_state_of(checkpoint_file) or {}
    except Exception:  # noqa: BLE001 - unreadable: the caller keeps every set
        return None
    return state.get(SHARDS_KEY, {}).get('directory', '') if isinstance(state, dict) else ''


def remove_unreferenced_shard_sets(root: Path, completed_epoch: int, checkpoint_files):
    """Remove from `root` the leftovers of interrupted saves and the shard sets no checkpoint refers to:
    epoch_N.loss_state is kept while epoch_N.pt exists (--delete-previous-checkpoint removes it) or while another
    checkpoint (epoch_latest.pt) names it; the files written this epoch (`checkpoint_files`) name this epoch's set.
    OpenCLIP's tmp.pt (never a whole checkpoint) and links to removed files name none; any other unreadable *.pt
    keeps every set, and says so."""
    sets = [path for path in root.iterdir() if SHARD_SET.fullmatch(path.name) and path.is_dir()]
    if not sets:  # no checkpoint is read: the usual case of a run that does not shard
        return
    written = {Path(f).name for f in checkpoint_files}
    referenced = {f'epoch_{completed_epoch}{SHARD_SET_SUFFIX}'}
    for path in root.glob('*.pt'):
        if EPOCH_CHECKPOINT.fullmatch(path.name) or path.name in written or path.name == 'tmp.pt' or not path.exists():
            continue
        shard_set = _shard_set_of(path)
        if shard_set is None:
            logging.warning(f"drrho-openclip: '{path}' cannot be read, so every per-sample state set in '{root}' is "
                            f"kept (it may name one): move it away, and sets no checkpoint names go at the next save")
            return
        referenced.add(shard_set)
    for path in sets:
        match = SHARD_SET.fullmatch(path.name)
        staging, epoch = match.group(2), int(match.group(1))
        if staging or (path.name not in referenced and not (root / f'epoch_{epoch}.pt').is_file()):
            shutil.rmtree(path, ignore_errors=True)
