#!/usr/bin/env bash
# Run 14 (one device call on nvidia-h200-x2, <= ~9.5 min).
#   GPU 0: spec.py with minutes of drafter training (target 140 s, each drafter ~2 min, pool 2048 rows)
#   GPU 1: the CUDA-only graph tests (capture_graph refactor after run 13), then QAT recovery
#          experiments on the nvfp4 stress recipe: a QAT / control phase as long as the BF16
#          phase, cosine to 0 (--ft-floor 0) at two LRs, and a second seed
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r14; mkdir -p "$O" "$R"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
(
export CUDA_VISIBLE_DEVICES=1 OUT=$R
echo "=== CUDA graph tests"
timeout 120 python3 -m pytest -q -x tests/test_spec_graph.py tests/test_generate_graph.py -k cuda 2>&1 | tail -4
i=0
for cfg in "2e-4 0" "6e-4 0" "2e-4 1"; do
  set -- $cfg; i=$((i + 1))
  B=$(left 540); echo "=== qat nvfp4 ft_lr $1 seed $2 budget $B"
  [ "$B" -gt 100 ] && timeout $((B > 170 ? 170 : B)) python3 benchmarks/qat.py --recipe nvfp4 --no-kernels \
      --seed $2 --extra 510 --ft-lr $1 --ft-floor 0 --budget-s 300 --tag _run14_v$i
done
) > "$R/gpu1_log.txt" 2>&1 &
P1=$!
(
export CUDA_VISIBLE_DEVICES=0 OUT=$R
echo "=== spec"
timeout 560 python3 benchmarks/spec.py --budget-s 520 --target-s 140 --pool-rows 2048 --tag _run14
) > "$R/gpu0_log.txt" 2>&1 &
P0=$!
wait $P0 $P1
cp benchmarks/results/*run14* "$R/" 2>/dev/null
tar czf "$O/run14.tgz" -C /tmp r14
cp "$R/gpu0_log.txt" "$R/gpu1_log.txt" "$O/"
tail -32 "$R/gpu0_log.txt"; echo; echo "######## GPU1"; grep -E "passed|failed|===|recovery|PTQ|QAT after|control after|Error" "$R/gpu1_log.txt"
