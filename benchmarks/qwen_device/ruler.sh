# RULER (13 tasks) + loss, 4K-32K, 2,048 keys: the warmed model under dense / window0 / oracle / msa,
# and the stage-2 model under msa, in parallel processes; merged reports come back
export PYTHONUNBUFFERED=1 PYTHONPATH=$HOME/site:$PWD
R=$HOME/qwork/ruler; mkdir -p $R
LIM=${LIM:-470}; N=${N:-50}
python benchmarks/ruler_gpu.py --model ~/qwork/w128/model --out $R/b128 --lengths 4096,8192,16384,32768 \
  --policies dense,window0,oracle,msa --budget block128-top16 --ruler-samples $N --workers 9 --time-limit $LIM \
  --loss-samples 4 > $OUT/ruler_b128.log 2>&1 &
if [ -d ~/qwork/s2/model ]; then
python benchmarks/ruler_gpu.py --model ~/qwork/s2/model --out $R/s2 --lengths 4096,8192,16384,32768 \
  --policies msa --budget block128-top16 --ruler-samples $N --workers 3 --time-limit $LIM \
  --loss-samples 4 > $OUT/ruler_s2.log 2>&1 &
fi
sleep 60; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
wait
for d in b128 s2; do [ -d $R/$d/merged ] && cp -r $R/$d/merged $OUT/${d}_merged && cp $R/$d/ruler_gpu.json $OUT/${d}_ruler_gpu.json; done
grep -h "samples_per_s" $OUT/ruler_*.log | cut -c1-400
head -c 6000 $OUT/b128_merged/table.md
