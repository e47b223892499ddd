cd REPO
for kl in selected all; do
  .venv/bin/python -m msakit convert QWEN --out OUT/warm_qk_$kl --train index \
    --index-init qk --init-blocks 1 --kl-tokens $kl --block-size 64 --topk 8 --context 2048 --long-min-tokens 4096 \
    --batch-size 1 --max-tokens 24576 --max-train-tokens 24576 --eval-rows 2 --index-lr 1e-3 --device cpu --dtype bfloat16 \
    --no-progress --log-every 1 > OUT/log_$kl.txt 2>&1
done
