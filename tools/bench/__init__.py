"""GPU checks and benchmarks of the kernels, one module per op (`sparse_attention`, `index_topk`,
`index_kl`, `decode`) and the quantization formats (`formats`); shared timing in `common`.
They import on the CPU and run on CUDA; benchmarks/ drives them."""
