#!/usr/bin/env bash
# Run 11 (one device call on nvidia-h200-x2, <= ~9.3 min).
#   GPU 0: sparse-attention forward A/B (work list, merge, forward configs) at 16K / 128K, then
#          prefill.py (16K, 128K; training 128K) and decode.py (the issue's table) on the new defaults
#   GPU 1: msa_decode graph check + old/new A/B, generate CUDA-graph check + generate tokens/s,
#          then qat.py (m3.1-flash) and qat.py --recipe nvfp4 (stress recipe, measurable PTQ gap)
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r11; mkdir -p "$O" "$R"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
(
export CUDA_VISIBLE_DEVICES=1 OUT=$R
echo "=== decode graph_check + ab"
timeout 170 python3 -c "
from msakit.ops.decode import bench
print('graph_check ok:', bench.graph_check(small=True)['ok'])
bench.ab(Ns=(16384, 1 << 20), Bs=(1,), out_dir='$R')"
echo "=== generate graph check"
timeout 100 python3 benchmarks/generate_graph_check.py --contexts 1024,32768 --new 64
echo "=== decode --generate"
timeout 80 python3 benchmarks/decode.py --generate 32768 131072 --skip-layer --no-check --no-tune --tag _run11gen
B=$(left 420); echo "=== qat m3.1-flash budget $B"
timeout $((B + 40)) python3 benchmarks/qat.py --budget-s $((B > 130 ? 130 : B)) --tag _run11
B=$(left 500); echo "=== qat nvfp4 budget $B"
[ "$B" -gt 45 ] && timeout $((B + 30)) python3 benchmarks/qat.py --recipe nvfp4 --no-kernels --budget-s "$B" --tag _run11_nvfp4
) > "$R/gpu1_log.txt" 2>&1 &
P1=$!
(
export CUDA_VISIBLE_DEVICES=0 OUT=$R
echo "=== sparse ab_run"
timeout 250 python3 -c "
import json
from msakit.ops.sparse_attention.bench import ab_run
r = ab_run((16384, 131072))
json.dump(r, open('$R/sparse_ab.json', 'w'), default=str, indent=1)"
echo "=== prefill"
timeout 150 python3 benchmarks/prefill.py --T 16384 131072 --train-T 131072 --tag _run11
echo "=== decode table"
B=$(left 540); timeout "$B" python3 benchmarks/decode.py --B 1 8 --N 16384 131072 1048576 --no-tune --tag _run11
) > "$R/gpu0_log.txt" 2>&1 &
P0=$!
wait $P0 $P1
cp benchmarks/results/*run11* "$R/" 2>/dev/null
tar czf "$O/run11.tgz" -C /tmp r11
cp "$R/gpu0_log.txt" "$R/gpu1_log.txt" "$O/"
tail -45 "$R/gpu0_log.txt"; echo; echo "######## GPU1"; tail -40 "$R/gpu1_log.txt"
