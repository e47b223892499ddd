#!/usr/bin/env bash
# Run 10 (one device call on nvidia-h200-x2, ~7.5 min).
#   GPU 1: quality.py seed 1: dense, convert (+ dense_ext), window, msa, bs32
#   GPU 0: profile_steps.py (QAT step at two shapes, speculative decode), then quality.py seed 1 bs128,
#          then seed 2 dense, msa, window
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r10; mkdir -p "$O" "$R"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
CUDA_VISIBLE_DEVICES=1 timeout 470 python3 benchmarks/quality.py --seed 1 --runs dense,convert,window,msa,bs32 \
    --budget-s 450 --device cuda > "$R/quality_gpu1_log.txt" 2>&1 &
QA=$!
export CUDA_VISIBLE_DEVICES=0
{
echo "=== profile_steps"; timeout 150 python3 benchmarks/profile_steps.py --what qat,decode --decode-runs speculative \
    --qat-shapes 32x512,16x2048 --out "$R"
sleep 5
B=$(left 450); echo "=== quality seed 1 bs128 budget $B"
timeout $((B + 20)) python3 benchmarks/quality.py --seed 1 --runs bs128 --budget-s "$B" --device cuda
B=$(left 450); echo "=== quality seed 2 dense,msa,window budget $B"
timeout $((B + 20)) python3 benchmarks/quality.py --seed 2 --runs dense,msa,window --budget-s "$B" --device cuda
} > "$R/gpu0_log.txt" 2>&1
wait $QA
echo "=== report" >> "$R/gpu0_log.txt"
timeout 40 python3 benchmarks/quality.py --report --seed-roots runs/quality,runs/quality-seed1,runs/quality-seed2 >> "$R/gpu0_log.txt" 2>&1
cp benchmarks/results/quality_*seeds* "$R/" 2>/dev/null
tar czf "$R/quality_runs.tgz" --exclude='checkpoints' --exclude='*.safetensors' --exclude='cache' runs/quality-seed1 runs/quality-seed2 2>/dev/null
tar czf "$O/run10.tgz" -C /tmp r10
cp "$R/gpu0_log.txt" "$R/quality_gpu1_log.txt" "$O/"
grep -v "^\[" "$R/gpu0_log.txt" | tail -45; tail -8 "$R/quality_gpu1_log.txt"
