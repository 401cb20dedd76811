# second command of the visit, after the column step reads the dense core's matrix (run as visit.sh)
set -o pipefail
export PYTHONUNBUFFERED=1
echo "== gpu_check: the column step over the core's matrix"
timeout 70 python3 benchmarks/gpu_check.py --out $OUT/gpu_check_pairs --only aggregation/column two-ranks/drrho-s \
    2>&1 | grep -v -i "warn" | grep -v '^ *check($'
echo "gpu_check rc $?"
echo "== loss time and memory"
timeout 150 python3 benchmarks/overheads.py --device cuda --sizes 16384 32768 4096 --repeats 5 --train-repeats 0 \
    --losses drrho drrho:column_step=False --memory-sizes 16384 32768 --output $OUT/overheads_pairs 2>&1 | grep -v -i "warn" | grep -v '^ *check($'
echo "overheads rc $?"
