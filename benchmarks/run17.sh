#!/usr/bin/env bash
# Run 17 (single H200, the last ~4 min of the session's device time): spec.py with the speed
# phase warmed up at both timed lengths (run 16's t(n) - t(2) was corrupted by first-call costs of
# the 2-token shapes); a short pipeline: target 50 s, pool 2048 rows, DSpark 80 s, budget "off".
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
OUT=$O timeout 245 python3 benchmarks/spec.py --budget-s 230 --target-s 50 --pool-rows 2048 --drafter-s 80 \
    --no-ablation --budgets off --tag _run17 > "$O/run17_log.txt" 2>&1
grep -E "target:|drafter |accept |speed B|round breakdown|bars:" "$O/run17_log.txt"; tail -2 "$O/run17_log.txt"
