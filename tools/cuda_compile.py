"""Compile Triton kernels for a CUDA target without a GPU and read what the compiler made of
them (the triton wheel ships ptxas and cuobjdump).  The kernels' compile reports
(`tools.bench.index_topk.compile_report`, `tools.bench.index_kl.ptxas_report`,
`tools.bench.decode.compile_report`, `tools.bench.formats.compile_kernels`) are built on this.
Run with TRITON_INTERPRET unset."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any, Mapping

import torch

TRITON_DTYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}


def compile_cuda(fn, args: Mapping[str, Any], constexprs: Mapping[str, Any] | None = None, *,
                 aligned: tuple[str, ...] = (), capability: int = 90, **options):
    """Compile the @triton.jit `fn` for sm_`capability` as its JIT would specialise it.

    args: every runtime argument by name: a Triton type string ("*bf16", "i32", "fp32",
    "tensordesc<...>"), a torch.Tensor (a pointer to its dtype), a TensorDescriptor, a float
    (fp32) or an int (the constant 1 as the JIT makes it; else i32 / i64 with the divisibility
    hint when a multiple of 16).  Pointers, and the integer arguments named in `aligned`, get
    the 16-byte divisibility hint the JIT gives real tensors (without it Triton does not
    software-pipeline the loads).  constexprs: the constexpr arguments by name.  options:
    num_warps, num_stages...  Returns the triton CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.tools.tensor_descriptor import TensorDescriptor

    consts = dict(constexprs or {})
    names = fn.arg_names
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
            continue
        v = args[n]
        hint = n in aligned
        if isinstance(v, TensorDescriptor):
            v = f"tensordesc<{TRITON_DTYPES[v.base.dtype]}[{', '.join(map(str, v.block_shape))}]>"
        elif isinstance(v, torch.Tensor):
            v = "*" + TRITON_DTYPES[v.dtype]
        elif isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ValueError(f"argument {n!r}: cannot specialise {type(v).__name__}")
        elif isinstance(v, float):
            v = "fp32"
        elif isinstance(v, int):
            if v == 1:  # the JIT turns 1 into a constant
                sig[n], consts[n] = "constexpr", 1
                continue
            hint = hint or v % 16 == 0
            v = "i32" if abs(v) < 2**31 else "i64"
        sig[n] = v
        if hint or v.startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def cuobjdump(compiled) -> tuple[str, str]:
    """(`cuobjdump -res-usage`, `cuobjdump -sass`) of a compiled kernel's cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    return res, sass


def res_usage(compiled) -> dict:
    """registers, stack (bytes of local stack frame: spills) and shared (bytes) of a compiled kernel."""
    res, _ = cuobjdump(compiled)
    reg, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return {"registers": int(reg.group(1)) if reg else -1, "stack": int(stack.group(1)) if stack else -1,
            "shared": int(compiled.metadata.shared)}
