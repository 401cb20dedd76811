# run on the GPU machine from the checkout's root after `bash .device/setup.sh`: the column step (drrho's default
# since af6be10) on CUDA: its compiled passes against float64, the trainer and two ranks with it, and its cost
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
echo "== gpu_check: the column step"
timeout 230 python3 benchmarks/gpu_check.py --parallel 12 --out $OUT/gpu_check_column \
    --only aggregation/column train/drrho/ resume/drrho two-ranks/drrho 2>&1 | grep -v -i "warn" | grep -v '^ *check($' | tee $OUT/gpu_check_column.log
echo "gpu_check rc $?"
echo "== loss time and memory: drrho with and without the column step"
timeout 170 python3 benchmarks/overheads.py --device cuda --sizes 4096 16384 32768 --repeats 5 --train-repeats 0 \
    --losses drrho drrho:column_step=False balanced --memory-sizes 16384 32768 --output $OUT/overheads_column 2>&1 | grep -v -i "warn"
echo "overheads rc $?"
echo "== gpu_check: the cases the last visit did not reach"
timeout 110 python3 benchmarks/gpu_check.py --out $OUT/gpu_check_rest \
    --only two-ranks/sogclr two-ranks/fastclip two-ranks/tempnet-sharded aggregation/tiled-adnce aggregation/tiled-rank-block 2>&1 | grep -v -i "warn" | grep -v '^ *check($' | tee $OUT/gpu_check_rest.log
echo "gpu_check rc $?"
