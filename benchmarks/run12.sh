#!/usr/bin/env bash
# Run 12 (one device call on nvidia-h200-x2, <= ~6 min): the measured defaults of run 11.
#   GPU 0: prefill.py, the full table (forward 16K..1M, training 16K..128K)
#   GPU 1: decode.py (per-dtype scoring defaults), then qat.py --recipe nvfp4 with seeds 1 and 2
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r12; mkdir -p "$O" "$R"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
(
export CUDA_VISIBLE_DEVICES=1 OUT=$R
echo "=== decode table"
timeout 130 python3 benchmarks/decode.py --B 1 8 --N 16384 131072 1048576 --no-tune --tag _run12
for s in 1 2; do
  B=$(left 320); echo "=== qat nvfp4 seed $s budget $B"
  [ "$B" -gt 50 ] && timeout $((B + 25)) python3 benchmarks/qat.py --recipe nvfp4 --no-kernels --seed $s \
      --budget-s $((B > 95 ? 95 : B)) --tag _run12_nvfp4_seed$s
done
) > "$R/gpu1_log.txt" 2>&1 &
P1=$!
(
export CUDA_VISIBLE_DEVICES=0 OUT=$R
echo "=== prefill"
timeout 330 python3 benchmarks/prefill.py --tag _run12
) > "$R/gpu0_log.txt" 2>&1 &
P0=$!
wait $P0 $P1
cp benchmarks/results/*run12* "$R/" 2>/dev/null
tar czf "$O/run12.tgz" -C /tmp r12
cp "$R/gpu0_log.txt" "$R/gpu1_log.txt" "$O/"
tail -12 "$R/gpu0_log.txt"; echo; echo "######## GPU1"; grep -E "^ +[18] |recovery|step time|bars" "$R/gpu1_log.txt"
