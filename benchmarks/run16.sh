#!/usr/bin/env bash
# Run 16 (one device call on nvidia-h200-x2, <= ~9.5 min): spec.py with whole-generation tokens/s
# (8 held-out prompts at B = 1, 16 at B = 8, n = 128 as in the acceptance phase) and the round
# breakdown (drafter block, target forward w = 1 / 8, fused round, paged step nq = 1 / 8).
#   GPU 0: --no-ablation: DSpark alone, ~5 min of training (the speed bar)
#   GPU 1: the full pipeline with the ablation (the Markov bar), ~2.5 min per drafter
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r16; mkdir -p "$O" "$R"
(
export CUDA_VISIBLE_DEVICES=1 OUT=$R
echo "=== spec (with the ablation)"
timeout 575 python3 benchmarks/spec.py --budget-s 520 --target-s 90 --tag _run16_ablation
) > "$R/gpu1_log.txt" 2>&1 &
P1=$!
(
export CUDA_VISIBLE_DEVICES=0 OUT=$R
echo "=== spec (DSpark only)"
timeout 575 python3 benchmarks/spec.py --budget-s 530 --target-s 90 --no-ablation --tag _run16
) > "$R/gpu0_log.txt" 2>&1 &
P0=$!
wait $P0 $P1
cp benchmarks/results/*run16* "$R/" 2>/dev/null
tar czf "$O/run16.tgz" -C /tmp r16
cp "$R/gpu0_log.txt" "$R/gpu1_log.txt" "$O/"
grep -E "target:|drafter |speed B|round breakdown|bars:" "$R/gpu0_log.txt"; echo; echo "######## GPU1"
grep -E "target:|drafter |speed B|round breakdown|bars:|budget=off" "$R/gpu1_log.txt"; tail -3 "$R/gpu1_log.txt"
