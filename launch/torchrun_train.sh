#!/bin/bash
# Single-node OpenCLIP training with any --loss of drrho-openclip: torchrun, one process per GPU.
#
#   bash launch/torchrun_train.sh                          # settings below
#   LOSS=clip REF_FEATURES= bash launch/torchrun_train.sh  # a loss without reference features
#   bash launch/torchrun_train.sh --epochs 40              # extra arguments go to open_clip_train.main
#   DRY_RUN=1 bash launch/torchrun_train.sh                # print the command, run nothing
#
# Run it again to continue an interrupted run: the run name is fixed and it starts with `--resume latest`.
set -euo pipefail

# ---- settings: edit here, or set them in the environment ----
LOSS=${LOSS:-drrho}                                    # any name that `--loss` accepts
MODEL=${MODEL:-ViT-B-32}
TRAIN_DATA=${TRAIN_DATA:-"/data/cc3m/shards/{00000..00331}.tar"}
TRAIN_NUM_SAMPLES=${TRAIN_NUM_SAMPLES-2818102}        # empty: let OpenCLIP read the shards' sizes
REF_FEATURES=${REF_FEATURES-/data/cc3m/ref_features}   # set empty for a loss that uses no reference features
SAMPLE_INDEX=${SAMPLE_INDEX-}                          # WebDataset, a stateful loss without REF_FEATURES: a store of
                                                       # the shards' keys (drrho-openclip-features --keys-only)
LOGS=${LOGS:-./logs}
NAME=${NAME:-$LOSS-${MODEL//[\/:]/-}}                  # fixed: what --resume latest looks up (no / or : of
                                                       # an hf-hub: or local-dir: model name in a folder name)
TRAIN_ARGS=${TRAIN_ARGS-"--batch-size 256 --epochs 30 --lr 1e-3 --wd 0.1 --warmup 2000 --workers 6 \
    --precision amp_bf16 --save-frequency 1"}   # bf16: Ampere and newer; --precision amp on V100
NPROC=${NPROC:-gpu}                                    # processes; "gpu": one per visible GPU

cmd=(torchrun --standalone --nproc_per_node="$NPROC"
     -m open_clip_train.main --   # `--`: torchrun would read --logs as one of its own options (torch >= 2.14)
     --logs "$LOGS" --name "$NAME" --model "$MODEL" --train-data "$TRAIN_DATA" --loss "$LOSS"
     # resume from the newest checkpoint, epoch_latest.pt (the plugin writes every checkpoint file atomically)
     --resume latest)
[[ -n "$TRAIN_NUM_SAMPLES" ]] && cmd+=(--train-num-samples "$TRAIN_NUM_SAMPLES")
[[ -n "$REF_FEATURES" ]] && cmd+=(--ref-features "$REF_FEATURES")
# OpenCLIP's memory-saving options, for the losses that read them: the DRO losses always take the local samples as
# anchors and the gathered global batch as candidates, and would warn that they ignore these
case "$LOSS" in clip|jest|jest-topk) cmd+=(--local-loss --gather-with-grad) ;; esac
[[ -n "$SAMPLE_INDEX" ]] && cmd+=(--sample-index "$SAMPLE_INDEX")
# TRAIN_ARGS: split on spaces and newlines, quotes not read (an argument with a space goes on the command line);
# set empty for none. -d '': every line, not the first; read then ends at the input's end, with status 1
read -ra extra -d '' <<< "$TRAIN_ARGS" || true
# --save-most-recent, unless --remote-sync is given: OpenCLIP's remote --resume latest cannot take it
save_most_recent=(--save-most-recent)
for arg in ${extra[@]+"${extra[@]}"} "$@"; do
    if [[ "$arg" == --remote-sync || "$arg" == --remote-sync=* ]]; then save_most_recent=(); fi
done
# later flags win: arguments of this script override the settings (`${x[@]+...}`: under set -u, bash < 4.4 takes an
# empty array for an unbound variable)
cmd+=(${save_most_recent[@]+"${save_most_recent[@]}"} ${extra[@]+"${extra[@]}"} "$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
elif [[ "$NPROC" == gpu && "$(python -c 'import torch; print(torch.cuda.device_count())')" == 0 ]]; then
    # torchrun's own message for this is a traceback ending in "Cuda is not available"
    echo "NPROC=gpu starts one process per visible GPU, and none is visible: set NPROC to the number of processes" \
         "(without a GPU, e.g. NPROC=2)" >&2
    exit 2
else
    exec "${cmd[@]}"
fi
