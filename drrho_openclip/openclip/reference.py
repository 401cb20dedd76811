"""Reference models: any OpenCLIP model, from a pretrained tag or a local checkpoint file (precompute's features and
training's online reference both load them here)."""
from pathlib import Path
from typing import Optional

import torch

from ..losses import ATTACHED_PREFIX
from ..losses.collectives import run_log

CHECKPOINT_SUFFIXES = ('.pt', '.pth', '.bin', '.safetensors', '.ckpt')


def pretrained_problem(name: str, pretrained: Optional[str]) -> Optional[str]:
    """Why `pretrained` cannot give the model `name` its weights, or None. OpenCLIP ignores the `pretrained` of a
    `local-dir:` model, and a mistyped checkpoint path would leave the reference with random weights: a path must
    be a file (a pretrained tag is left to OpenCLIP, which refuses unknown ones)."""
    if not pretrained or Path(pretrained).is_file():
        return None
    if name.startswith('local-dir:'):
        return f"'{pretrained}' is not a file, and a local-dir: model loads its weights from a checkpoint file only"
    if '/' in pretrained or Path(pretrained).suffix in CHECKPOINT_SUFFIXES:
        return f"'{pretrained}' is not a file"
    return None


SCHEMAS = ('hf-hub:', 'local-dir:')  # models whose config and weights OpenCLIP reads from a hub or folder itself


def needs_quick_gelu(name: str, pretrained: Optional[str]) -> bool:
    """Whether the pretrained tag's weights were trained with QuickGELU where the config `name` builds GELU (OpenAI's
    weights under the plain names: `ViT-B-32` with `openai`): OpenCLIP builds the model as configured and only
    warns, so its features would be those of another function than the one the weights were trained as."""
    from open_clip.factory import get_model_config
    from open_clip.pretrained import get_pretrained_cfg
    if not pretrained or name.startswith(SCHEMAS) or Path(pretrained).is_file():
        return False
    name = name.replace('/', '-')  # as OpenCLIP reads `ViT-B/32`
    tag = get_pretrained_cfg(name, pretrained) or {}
    return bool(tag.get('quick_gelu')) and not (get_model_config(name) or {}).get('quick_gelu', False)


def built_model(name: str, pretrained: Optional[str]) -> str:
    """The reference model as it is built, for records that tell stores and runs apart: `name`, or OpenCLIP's
    `-quickgelu` name where the tag needs it (a store or run of an earlier version built GELU under `name`)."""
    return f"{name.replace('/', '-')}-quickgelu" if needs_quick_gelu(name, pretrained) else name


def _has_weights(name: str) -> bool:
    """Whether OpenCLIP loads weights for a `hf-hub:` model (always) or a `local-dir:` one (a checkpoint file in its
    folder, by the suffixes OpenCLIP looks for)."""
    if name.startswith('local-dir:'):
        folder = Path(name.removeprefix('local-dir:'))
        return any(any(folder.glob(f'*{suffix}')) for suffix in ('.safetensors', '.bin', '.pth'))
    return name.startswith('hf-hub:')


def create_model(name: str, pretrained: str = None, device='cpu', precision='fp32', cache_dir=None):
    """An OpenCLIP model in eval mode and its evaluation transform, from a pretrained tag or a local checkpoint file
    (OpenCLIP's own factory ignores `pretrained` for `local-dir:` models, so files are loaded here). It says where
    its weights came from: OpenCLIP's own log says "initialized randomly" before a file is loaded."""
    import open_clip
    problem = pretrained_problem(name, pretrained)
    if problem:
        raise ValueError(f"reference model {name}: {problem}")
    is_file = bool(pretrained) and Path(pretrained).is_file()
    quick_gelu = needs_quick_gelu(name, pretrained)
    if quick_gelu:
        run_log.info(f"drrho-openclip: reference model {name} is built with QuickGELU, as its '{pretrained}' weights "
                     f"were trained (OpenCLIP's {built_model(name, pretrained)})")
    model, _, preprocess = open_clip.create_model_and_transforms(
        name, pretrained=None if is_file or not pretrained else pretrained, device=device, precision=precision,
        cache_dir=cache_dir, force_quick_gelu=quick_gelu)
    if is_file:
        try:  # not strict: a checkpoint trained with TempNet also holds its networks, which the model has not
            keys = open_clip.load_checkpoint(model, pretrained, device=device, strict=False)
        except Exception as e:  # noqa: BLE001 - torch, pickle and OpenCLIP's resizing each raise their own kind
            # their messages name neither the file nor the model (and torch's goes on to suggest unpickling
            # without weights_only, which would run a foreign file's code): the cause's first sentence only
            cause = str(e).strip().split('\n')[0].split('. ')[0]
            raise ValueError(f"reference model {name}: '{pretrained}' is not a checkpoint of it "
                             f"({type(e).__name__}: {cause})") from e
        # (big_vision .npz weights load strictly by their own code and report no keys)
        missing, unexpected = getattr(keys, 'missing_keys', []), getattr(keys, 'unexpected_keys', [])
        foreign = [k for k in unexpected if not k.startswith(ATTACHED_PREFIX)]
        if missing or foreign:
            raise ValueError(f"reference model {name}: '{pretrained}' is not a checkpoint of it (it lacks "
                             f"{len(missing)} of the model's weights and has {len(foreign)} others, e.g. "
                             f"{', '.join(missing[:2] + foreign[:2])})")
        if unexpected:
            run_log.info(f"drrho-openclip: '{pretrained}' also holds the networks a loss attached to the model it "
                         f"trained (TempNet's); the reference model leaves them out")
    if pretrained:
        run_log.info(f"drrho-openclip: reference model {name}, weights from '{pretrained}'")
    elif _has_weights(name):
        run_log.info(f"drrho-openclip: reference model {name}, weights as OpenCLIP loads them for it")
    else:
        run_log.warning(f"drrho-openclip: reference model {name} has random weights (no pretrained tag or "
                        f"checkpoint file given)")
    return model.eval(), preprocess


def _sizes(model) -> dict:
    """What a model needs of its input batches: the image size (as built, --force-image-size included), the token
    context length and vocabulary."""
    size = model.visual.image_size
    return {'image_size': tuple(size) if isinstance(size, (tuple, list)) else (size, size),
            'context_length': model.context_length, 'vocab_size': getattr(model, 'vocab_size', None)}


def _same_values(a, b) -> bool:
    """Per-channel statistics alike, whether given as tuples (OpenCLIP's defaults) or lists (JSON configs)."""
    return tuple(map(float, a)) == tuple(map(float, b))


class OnlineReference:
    """Reference features computed on the fly from the learner's batch (its augmentation and tokenizer), on the
    learner's device, in the run's --precision: its weights' dtype, and under `amp`/`amp_bf16` OpenCLIP's autocast
    (the loop asks for the features before it enters its own autocast for the learner). The reference must read the learner's batches: the same image size,
    context length and vocabulary; images normalised with another mean and std than the reference's own are
    re-normalised for it (one affine map per channel)."""

    def __init__(self, learner, args, device):
        from open_clip_train.precision import get_autocast
        self.autocast = get_autocast(args.precision, device_type=torch.device(device).type)
        try:
            self.model = create_model(args.ref_model, args.ref_pretrained, device, precision=args.precision,
                                      cache_dir=args.cache_dir)[0].requires_grad_(False)
        except (RuntimeError, ValueError, OSError) as e:  # as precompute's: an unknown tag, another model's file
            raise SystemExit(f"drrho-openclip: --ref-model {args.ref_model} --ref-pretrained {args.ref_pretrained}: "
                             f"{e}") from None
        theirs, ours = _sizes(self.model), _sizes(learner)
        for key in theirs:
            if theirs[key] != ours[key]:
                raise SystemExit(f"drrho-openclip: --ref-model {args.ref_model} has {key} {theirs[key]}, the learner "
                                 f"{ours[key]} (with --force-* flags applied): it cannot read the learner's batches; "
                                 f"precompute its features with drrho-openclip-features")
        self.renormalize = None
        learner_cfg, cfg = learner.visual.preprocess_cfg, self.model.visual.preprocess_cfg
        if not all(_same_values(learner_cfg[k], cfg[k]) for k in ('mean', 'std')):
            channel = dict(device=device, dtype=torch.float32)
            mean, std = (torch.tensor(cfg[k], **channel).view(1, -1, 1, 1) for k in ('mean', 'std'))
            learner_mean, learner_std = (torch.tensor(learner_cfg[k], **channel).view(1, -1, 1, 1)
                                         for k in ('mean', 'std'))
            # x_ref = (x·σ_learner + µ_learner − µ_ref) / σ_ref, from the learner's normalised pixels
            self.renormalize = (learner_std / std, (learner_mean - mean) / std)
            run_log.info(f"drrho-openclip: the reference's images are re-normalised from the learner's mean "
                         f"{learner_cfg['mean']} and std {learner_cfg['std']} to its own {cfg['mean']}, {cfg['std']}")

    @torch.no_grad()
    def __call__(self, images, texts):
        if self.renormalize is not None:
            scale, shift = self.renormalize
            images = (images.float() * scale + shift).to(images.dtype)
        with self.autocast():
            return self.model.encode_image(images, normalize=True), self.model.encode_text(texts, normalize=True)
