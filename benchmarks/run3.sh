#!/usr/bin/env bash
# Run 3 (one device call, ~4 min): index_topk config sweep + check, sparse attention profile,
# decode (graph check + B=1 table), quant format bandwidth.  Each step has its own time limit.
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
step() { local t=$1; shift; echo "=== $* (limit ${t}s)"; timeout "$t" "$@" 2>&1 | tee -a "$O/run3_log.txt"; }
step 80 python3 -c "
from msakit.ops.index_topk.bench import check_and_bench, CANDIDATE_CONFIGS as C
import json; r=check_and_bench(T_list=(131072,), configs=C, score_dtypes=('bf16',))
json.dump(r, open('$O/topk_sweep.json','w'), default=str)"
step 70 python3 -c "
from msakit.ops.sparse_attention.bench import gpu_run
gpu_run(131072, 16384)" 
step 75 python3 benchmarks/decode.py --B 1 8 --N 16384 1048576 --no-tune --tag _run3
step 40 python3 -c "
from msakit.quant.formats.bench import bench_formats, print_table
import json; r=bench_formats(sizes=((8192, 8192),)); print_table(r); json.dump(r, open('$O/quant_bench.json','w'), default=str)"
cp benchmarks/results/decode_*run3* "$O/" 2>/dev/null
echo "=== done"
