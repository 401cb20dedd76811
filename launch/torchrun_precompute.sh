#!/bin/bash
# Reference features on one node: torchrun starts NPROC processes, rank R computes the R-th contiguous slice of the
# shard list on GPU R (drrho-openclip-features reads RANK, WORLD_SIZE and LOCAL_RANK); the last to end writes the
# store. Run it again after an interruption: finished shards are skipped.
#
#   bash launch/torchrun_precompute.sh                     # settings below
#   bash launch/torchrun_precompute.sh --dtype int8        # extra arguments go to drrho-openclip-features
#   DRY_RUN=1 bash launch/torchrun_precompute.sh           # print the command, run nothing
set -euo pipefail

# ---- settings: edit here, or set them in the environment ----
# the reference model: REF_ (the training scripts' MODEL is the model trained, and sbatch passes the environment on)
REF_MODEL=${REF_MODEL:-ViT-B-32}
REF_PRETRAINED=${REF_PRETRAINED-openai}                # a tag or a checkpoint file; empty: none
TRAIN_DATA=${TRAIN_DATA:-"/data/cc3m/shards/{00000..00331}.tar"}
OUTPUT=${OUTPUT:-/data/cc3m/ref_features}
DTYPE=${DTYPE:-float16}                                # float16, float32 or int8
BATCH_SIZE=${BATCH_SIZE:-512}
WORKERS=${WORKERS:-4}                                  # data-loading processes per rank
NPROC=${NPROC:-gpu}                                    # processes; "gpu": one per visible GPU

cmd=(torchrun --standalone --nproc_per_node="$NPROC"
     -m drrho_openclip.precompute --   # `--`: arguments after it are the module's, never torchrun's
     --model "$REF_MODEL" --train-data "$TRAIN_DATA" --output "$OUTPUT" --dtype "$DTYPE"
     --batch-size "$BATCH_SIZE" --workers "$WORKERS")
[[ -n "$REF_PRETRAINED" ]] && cmd+=(--pretrained "$REF_PRETRAINED")
cmd+=("$@")   # later flags win: arguments of this script override the settings

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
