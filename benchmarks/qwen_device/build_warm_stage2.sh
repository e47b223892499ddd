# build the Qwen folder from the staged GGUF; the 2,048-key index warm-up at 32K rows (KL over all
# END (default 560): seconds after the build starts by which stage 2 ends; WARM (default 300): the
# warm-up's seconds; S2=0 skips stage 2
# tokens, q/k init); stage 2 (LoRA 16, LM + KL) from it with the 2K check
export PYTHONUNBUFFERED=1
mkdir -p ~/stage ~/site ~/qwork/downloads
mv .stage/g09 ~/stage/
ls ~/stage | tr '\n' ' '; echo
pip install -q --no-index --no-deps --target ~/site .stage/wheels/*.whl 2>&1 | tail -2
cat ~/stage/g0? > ~/qwork/downloads/qwen2.5-coder-0.5b-instruct.gguf && rm -f ~/stage/g0?
export PYTHONPATH=$HOME/site:$PWD
t0=$(date +%s)
# the Triton KL over all causal blocks at the warm-up's shape (24 layers of this a step), checked
# beside the build; if it fails, the warm-up takes the KL over the selected tokens instead
(timeout 120 python - > $OUT/kl_all_check.log 2>&1 <<'PY'
import time, torch
from msakit.ops.index_kl import index_kl_loss
from msakit.ops.index_kl.reference import index_kl_loss_reference
torch.manual_seed(0)
for T, check in ((2048, True), (32768, False)):
    q = torch.randn(1, T, 14, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, 2, 64, device="cuda", dtype=torch.bfloat16)
    qi = torch.randn(1, T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ki = torch.randn(1, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for i in range(3):
        torch.cuda.synchronize(); t = time.perf_counter()
        loss = index_kl_loss(q, k, qi, ki, None, block_size=128, over="all"); loss.backward()
        torch.cuda.synchronize(); print(f"KL all T={T} call {i}: {time.perf_counter() - t:.4f} s, loss {loss.item():.5f}")
    if check:
        ref = index_kl_loss_reference(q.float(), k.float(), qi.detach().float(), ki.detach().float(), None,
                                      block_size=128, over="all")
        print(f"T={T} reference {ref.item():.5f}")
        assert abs(ref.item() - loss.item()) <= 2e-2 * abs(ref.item()) + 1e-3
print("peak GB", torch.cuda.max_memory_allocated() / 1e9)
PY
) &
klpid=$!
timeout 170 python tools/qwen_checkpoint.py --work ~/qwork/downloads --out ~/qwork/qwen 2>&1 | grep -v "Loading weights" | tail -8 || exit 1
echo "build done at $(( $(date +%s) - t0 ))s"
python tools/essay_documents.py --out ~/qwork/essays   # another corpus for stage 2's short-context check
wait $klpid && KL=all || KL=selected
echo "KL check: warm-up KL over $KL tokens"; cat $OUT/kl_all_check.log | tail -9
timeout $(( ${WARM:-300} + 30 )) python -m msakit convert ~/qwork/qwen --out ~/qwork/w128 --train index --index-init qk --init-blocks 1 \
  --kl-tokens $KL --block-size 128 --topk 16 --context 32768 --long-min-tokens 4096 --batch-size 1 \
  --max-tokens 10000000 --eval-rows 2 --time-budget ${WARM:-300} --index-lr 1e-3 --device cuda --dtype bfloat16 \
  --no-progress --log-every 10 > $OUT/warm128.log 2>&1
echo "warm-up rc $? at $(( $(date +%s) - t0 ))s"; grep -v "Loading weights" $OUT/warm128.log | tail -12
cp ~/qwork/w128/metrics.jsonl $OUT/warm128_metrics.jsonl 2>/dev/null
if [ "${S2:-1}" = 1 ]; then
left=$(( ${END:-560} - ($(date +%s) - t0) ))
echo "stage 2 gets ${left}s"
S2CMD="python -m msakit convert $HOME/qwork/w128/model --train all --warmup-steps 0 --kl-coef 1 --lora 16 --lora-alpha 32 \
  --lr 1e-4 --index-lr 1e-3 --init-blocks 1 --batch-size 1 --dtype bfloat16 --activation-checkpointing \
  --long-min-tokens 4096 --short-context 2048 --short-context-data $HOME/qwork/essays --eval-rows 2 --device cuda --no-progress --log-every 10"
timeout $left $S2CMD --context 32768 --max-tokens 3000000 --time-budget $(( left - 30 )) --out ~/qwork/s2 > $OUT/stage2.log 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "out of memory\|OutOfMemory\|--batch-size" $OUT/stage2.log; then
  echo "stage 2 at 32K failed (rc $rc): 16K rows"; rm -rf ~/qwork/s2
  left=$(( ${END:-560} + 20 - ($(date +%s) - t0) ))
  timeout $left $S2CMD --context 16384 --max-tokens 3000000 --time-budget $(( left - 25 )) --out ~/qwork/s2 > $OUT/stage2_16k.log 2>&1
  rc=$?
fi
echo "stage 2 rc $rc at $(( $(date +%s) - t0 ))s"; grep -v "Loading weights" $OUT/stage2*.log | tail -14
cp ~/qwork/s2/metrics.jsonl $OUT/stage2_metrics.jsonl 2>/dev/null
fi
ls ~/qwork/w128/model; [ -d ~/qwork/s2 ] && ls ~/qwork/s2/model
