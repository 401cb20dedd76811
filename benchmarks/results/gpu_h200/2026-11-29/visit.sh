# run on the GPU machine from the checkout's root after `bash .device/setup.sh`; .device/loss_times.py is measure_losses.py here
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
echo "== loss times"
timeout 150 python3 .device/loss_times.py 16384,32768,4096 16384,32768 2>&1 | grep -v -i "warn"
echo "loss_times rc $?"
echo "== gpu_check"
timeout 290 python3 benchmarks/gpu_check.py --parallel 14 --out $OUT/gpu_check 2>&1 | grep -v -i "warn" | grep -v '^ *check($'
echo "gpu_check rc $?"
echo "== tiled"
timeout 90 python3 benchmarks/tiled_memory.py --device cuda --precision bf16 --batches 32768 --sweep-tiles --repeats 5 --memory-limit-gib 100 --out-dir $OUT --tag cuda_bf16 2>&1 | grep -v -i "warn"
echo "tiled rc $?"
