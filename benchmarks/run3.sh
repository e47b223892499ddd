#!/usr/bin/env bash
# Run 3 (one device call, ~4 min): quant tests on CUDA + bandwidth sweep, index_topk config sweep,
# sparse attention profile, decode (graph check + table).  Each step has its own time limit.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
step() { local t=$1; shift; echo "=== $* (limit ${t}s)"; timeout "$t" "$@" 2>&1 | tee -a "$O/run3_log.txt"; }
step 75 python3 -m pytest -q -x -p no:cacheprovider tests/test_quant_formats.py
step 45 python3 -c "
from msakit.quant.formats.bench import *
import json; rows = bench_formats(sizes=((8192, 8192),), variants=VARIANTS, warmup=10, rep=40)
print_table(rows); print('--- best'); print_table(best(rows)); json.dump(rows, open('$O/quant_bench.json','w'), default=str)"
step 80 python3 -c "
from msakit.ops.index_topk.bench import check_and_bench, CANDIDATE_CONFIGS as C
import json; r=check_and_bench(T_list=(131072,), configs=C, score_dtypes=('bf16',))
json.dump(r, open('$O/topk_sweep.json','w'), default=str)"
step 70 python3 -c "
from msakit.ops.sparse_attention.bench import gpu_run
gpu_run(131072, 16384)"
step 75 python3 benchmarks/decode.py --B 1 8 --N 16384 1048576 --no-tune --tag _run3
cp benchmarks/results/decode_*run3* "$O/" 2>/dev/null
echo "=== done"
