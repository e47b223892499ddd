"""Developer tooling outside the library: GPU benchmarks of the kernels (`tools.bench`), compiling
Triton kernels for a CUDA target without a GPU (`tools.cuda_compile`) and reading their SASS
(`tools.sass`).  tools may import msakit; msakit never imports tools."""
