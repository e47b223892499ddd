# beside the Qwen build: #30's MXFP8 bit-exact test on the device; #28's backward quick check if the DSL is staged
export PYTHONUNBUFFERED=1
(timeout 150 python -m pytest -q -p no:cacheprovider tests/ops/test_kernel_packed_gemm.py -k "mxfp8" > $OUT/mxfp8_test.log 2>&1; echo "rc $?" >> $OUT/mxfp8_test.log) &
if [ -f ~/site/sitecustomize.py ]; then
  (PYTHONPATH=$HOME/site:$PWD timeout 230 python tools/bench/sparse_sm90_bwd.py --quick > $OUT/bwd_quick.log 2>&1; echo "bwd rc $?" >> $OUT/bwd_quick.log) &
fi
END=${END:-470} bash .stage/build_warm_stage2.sh   # copied there with the other scripts of this folder
wait
echo "=== mxfp8"; tail -3 $OUT/mxfp8_test.log
[ -f $OUT/bwd_quick.log ] && { echo "=== bwd"; tail -30 $OUT/bwd_quick.log; }
