"""The run the hooks share: started by check_args from the flags, completed by configure_model (the loss).

Each training process parses its flags once, so there is one active run per process; a hook called before
check_args (a patched OpenCLIP driven without its parser) is an error, not a silent default."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..features import FeatureStore


@dataclass
class Run:
    loss_name: str
    plain_clip: bool                           # OpenCLIP builds and runs its own loss: the plugin stays out of it
    options: Dict = field(default_factory=dict)  # the loss's user options in force (flags or the loss's defaults)
    reference_store: Optional[FeatureStore] = None  # --ref-features
    index_store: Optional[FeatureStore] = None      # whose keys index WebDataset samples: --sample-index or the above
    sample_index_size: int = 0                 # rows of the per-sample state: store, CSV rows or synthetic samples
    loss: Optional[object] = None              # built by configure_model
    # warnings about the flags, logged with the loss (at parse time OpenCLIP's logging is not set up yet, and a
    # logging call then would give the root logger a second handler: every later line printed twice)
    warnings: List[str] = field(default_factory=list)
    # what a checkpoint's loss state records of the run that wrote it, checked on resume (checkpoints.py): the loss,
    # its options as given, the reference model in words, a fingerprint of the sample index, the global batch
    provenance: Dict = field(default_factory=dict)
    resume_latest: bool = False                # --resume latest, which OpenCLIP resolves to a file after the flags


_active: Optional[Run] = None


def start(run: Run):
    global _active
    _active = run


def active() -> Run:
    if _active is None:
        raise RuntimeError("drrho-openclip: no run: open_clip_train's parse_args (the plugin's check_args) has not "
                           "run in this process")
    return _active
