# run on the GPU machine from the checkout's root after `bash .device/setup.sh`; .device/loss_times.py is measure_losses.py here
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/machine.txt
timeout 320 python3 benchmarks/gpu_check.py --parallel 12 --out $OUT/gpu_check 2>&1 | grep -v -i "warn" | tee $OUT/gpu_check.log
echo "gpu_check rc $?"
timeout 170 python3 .device/loss_times.py 16384,32768,4096 16384,32768 2>&1 | grep -v -i "warn" | tee $OUT/loss_times.log
echo "loss_times rc $?"
