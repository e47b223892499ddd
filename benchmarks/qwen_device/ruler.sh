# RULER (13 tasks) + loss, 4K-32K, 2,048 keys, in parallel `msakit eval` processes (benchmarks/ruler_gpu.py):
#   the warmed model: dense + msa on every task (N samples), oracle + window0 on the NIAH tasks (N / 2),
#   loss under the four policies; the stage-2 model (if built): msa; then the merged reports come back.
# A second call with the same LIM / N resumes every folder (ruler_gpu.py adds --resume by itself).
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD
R=$HOME/qwork/ruler; mkdir -p $R
LIM=${LIM:-460}; N=${N:-50}
NIAH=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery
L=4096,8192,16384,32768
python benchmarks/ruler_gpu.py --model ~/qwork/w128/model --out $R/b128 --lengths $L --policies dense,msa \
  --budget block128-top16 --ruler-samples $N --workers 7 --time-limit $LIM > $OUT/ruler_b128.log 2>&1 &
python benchmarks/ruler_gpu.py --model ~/qwork/w128/model --out $R/b128o --tasks $NIAH --lengths $L \
  --policies oracle,window0 --budget block128-top16 --ruler-samples $(( N / 2 )) --workers 2 --time-limit $LIM \
  --loss-samples 4 > $OUT/ruler_b128o.log 2>&1 &
if [ -d ~/qwork/s2/model ]; then
python benchmarks/ruler_gpu.py --model ~/qwork/s2/model --out $R/s2 --lengths $L --policies dense,msa \
  --budget block128-top16 --ruler-samples $(( N / 2 )) --workers 3 --time-limit $LIM > $OUT/ruler_s2.log 2>&1 &
fi
# loss at 64K past the native 32K (YaRN factor 4) on RULER's essays as 8 long documents (built by
# build_warm_stage2.sh), the four policies on the warmed model, dense + msa on the stage-2 one
for m in w128 s2; do
  [ -d ~/qwork/$m/model ] || continue
  pol=dense,msa; [ $m = w128 ] && pol=dense,msa,oracle,window0
  timeout $(( LIM + 20 )) python -m msakit eval --model ~/qwork/$m/model --tasks loss --lengths 65536 --samples 4 \
    --docs ~/qwork/essays --rope-scaling yarn:4 --policies $pol --budget block128-top16 \
    --device cuda --dtype bfloat16 --no-progress --out $R/loss64k_$m $( [ -d $R/loss64k_$m ] && echo --resume ) \
    > $OUT/loss64k_$m.log 2>&1 &
done
sleep 60; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
wait
python benchmarks/ruler_gpu.py --merge $R/b128/merged $R/b128o/merged --out $R/b128all > /dev/null
for d in b128all s2; do
  [ -d $R/$d/merged ] && mkdir -p $OUT/$d && cp $R/$d/merged/results.jsonl $R/$d/merged/summary.json $R/$d/merged/*.png $OUT/$d/
done
for m in w128 s2; do [ -d $R/loss64k_$m ] && mkdir -p $OUT/loss64k_$m && cp $R/loss64k_$m/*.json* $OUT/loss64k_$m/ 2>/dev/null; tail -4 $OUT/loss64k_$m.log; done
for d in b128 b128o s2; do [ -f $R/$d/ruler_gpu.json ] && cp $R/$d/ruler_gpu.json $OUT/${d}_ruler_gpu.json; done
grep -h "samples_per_s" $OUT/ruler_*.log | cut -c1-300
grep -E "niah \||average \|" $R/b128all/merged/table.md | head -20
