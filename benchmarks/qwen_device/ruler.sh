# RULER (13 tasks) + loss, 4K-32K, 2,048 keys, in parallel `msakit eval` processes (benchmarks/ruler_gpu.py),
# for a new indexer of the same backbone: dense, oracle and window0 do not depend on the indexer, so
# they are run only where no earlier run holds them (DENSE=1 runs dense on the NIAH tasks too);
#   the warmed model: msa on the 8 NIAH tasks (N samples) and its loss by position (4 documents),
#   dense + msa on the 5 other tasks (N / 2); the 64K loss with YaRN factor 4 on RULER's essays
#   (four policies); the stage-2 model (if built): dense + msa on the NIAH tasks (N / 2).
# A second call with the same LIM / N resumes every folder (ruler_gpu.py adds --resume by itself).
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD
R=$HOME/qwork/ruler; mkdir -p $R
LIM=${LIM:-460}; N=${N:-50}
NIAH=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery
OTHER=ruler_vt,cwe,fwe,qa_1,qa_2
L=4096,8192,16384,32768
NP=msa; [ "${DENSE:-0}" = 1 ] && NP=dense,msa
python benchmarks/ruler_gpu.py --model ~/qwork/w128/model --out $R/niah --tasks $NIAH --lengths $L --policies $NP \
  --budget block128-top16 --ruler-samples $N --workers 6 --time-limit $LIM --loss-samples 4 > $OUT/ruler_niah.log 2>&1 &
python benchmarks/ruler_gpu.py --model ~/qwork/w128/model --out $R/other --tasks $OTHER --lengths $L --policies dense,msa \
  --budget block128-top16 --ruler-samples $(( N / 2 )) --workers 5 --time-limit $LIM > $OUT/ruler_other.log 2>&1 &
if [ -d ~/qwork/s2/model ]; then
python benchmarks/ruler_gpu.py --model ~/qwork/s2/model --out $R/s2 --tasks $NIAH --lengths $L --policies dense,msa \
  --budget block128-top16 --ruler-samples $(( N / 2 )) --workers 3 --time-limit $LIM --loss-samples 2 > $OUT/ruler_s2.log 2>&1 &
fi
# loss at 64K past the native 32K (YaRN factor 4) on RULER's essays as 8 long documents (built by
# build_warm_stage2.sh)
timeout $(( LIM + 20 )) python -m msakit eval --model ~/qwork/w128/model --tasks loss --lengths 65536 --samples 4 \
  --docs ~/qwork/essays --rope-scaling yarn:4 --policies dense,msa,oracle,window0 --budget block128-top16 \
  --device cuda --dtype bfloat16 --no-progress --out $R/loss64k $( [ -d $R/loss64k ] && echo --resume ) \
  > $OUT/loss64k.log 2>&1 &
sleep 60; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
wait
for d in niah other s2 loss64k; do
  src=$R/$d/merged; [ $d = loss64k ] && src=$R/$d
  [ -d $src ] && mkdir -p $OUT/$d && cp $src/results.jsonl $src/summary.json $src/*.png $src/table.md $OUT/$d/ 2>/dev/null
  [ -f $R/$d/ruler_gpu.json ] && cp $R/$d/ruler_gpu.json $OUT/${d}_ruler_gpu.json
done
tail -5 $OUT/loss64k.log
grep -h "samples_per_s" $OUT/ruler_*.log | cut -c1-300
