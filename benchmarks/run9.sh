#!/usr/bin/env bash
# Run 9 (one device call on nvidia-h200-x2, ~9.5 min).
#   GPU 1: quality.py dense, convert (+ dense_ext), window
#   GPU 0: profile_steps.py (decode + QAT step), decode.py --generate, then quality.py msa, bs32, bs128
# Everything lands in /tmp/r9 and is packed into $OUT/run9.tgz at the end.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r9; mkdir -p "$O" "$R"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.used --format=csv > "$R/gpus.txt"
CUDA_VISIBLE_DEVICES=1 timeout 560 python3 benchmarks/quality.py --runs dense,convert,window --budget-s 520 \
    --device cuda > "$R/quality_gpu1_log.txt" 2>&1 &
QA=$!
export CUDA_VISIBLE_DEVICES=0
{
echo "=== profile_steps"; timeout 150 python3 benchmarks/profile_steps.py --what decode,qat --out "$R"
echo "=== decode --generate"; timeout 120 python3 benchmarks/decode.py --generate 32768 131072 --skip-layer --no-check --no-tune --tag _run9
cp benchmarks/results/decode_*run9* "$R/" 2>/dev/null
B=$(left 530); echo "=== quality msa,bs32,bs128 budget $B"
timeout $((B + 30)) python3 benchmarks/quality.py --runs msa,bs32,bs128 --budget-s "$B" --device cuda
} > "$R/gpu0_log.txt" 2>&1
wait $QA
echo "=== report" >> "$R/gpu0_log.txt"
timeout 30 python3 benchmarks/quality.py --report >> "$R/gpu0_log.txt" 2>&1
cp benchmarks/results/quality_* "$R/" 2>/dev/null
tar czf "$R/quality_runs.tgz" --exclude='checkpoints' --exclude='*.safetensors' --exclude='cache' runs/quality 2>/dev/null
ls -la "$R" runs/quality/* | head -60 >> "$R/gpu0_log.txt"
tar czf "$O/run9.tgz" -C /tmp r9
cp "$R/gpu0_log.txt" "$R/quality_gpu1_log.txt" "$O/"
tail -40 "$R/gpu0_log.txt"; tail -25 "$R/quality_gpu1_log.txt"
