"""Static SASS count of the packed grouped GEMM's K loop (no GPU: compiled for sm_90a offline).

    python -m tools.bench.packed_gemm_sass [--kernel old|new|both|mxfp8] [--dump DIR]

old / new: the NVFP4 kernels (`_grouped_kernel` with FMT=0, the byte-table kernel); mxfp8: the
MXFP8 W8A16 kernel for bfloat16 x (`_mxfp8_grouped_kernel`) at the library's decode tiles
(16 x 64 x 256, 2 warps: `grouped_config` at <= 16 rows per group), 16 x 32 x 256 on one warp and
16 x 128 x 256, with EVEN (no K / N masks: the decode shapes) and without; its float16 loop
(the one with FFMA) and its bfloat16 fallback loop (HMUL2, 32-wide K steps) are counted apart.
x is bfloat16 throughout.
For each kernel and tile config: the innermost backward-branch loop that holds the MMA (HMMA /
HGMMA), its instruction count by opcode, and the count per 32 weights (warp-instructions per
32 weight elements = per-thread instructions per weight): loop instructions x warps x 32 /
(BLOCK_N x BLOCK_K).  Run with TRITON_INTERPRET unset."""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def loops(sass: str) -> list[list[str]]:
    """Opcodes of the loops of `sass` holding a wgmma or an mma.sync, smallest first."""
    from tools.sass import sass_loops

    return [[op for _, op in body] for body in sass_loops(sass, mma=("HGMMA", "HMMA"))]


def count(fn, consts: dict, warps: int, stages: int, bn: int, bk: int, dump: str | None = None, tag: str = "",
          w_type: str = "*u8", loop_with: str | None = None) -> dict:
    """loop_with: count the smallest MMA loop holding this opcode (prefix) instead of the smallest."""
    from tools.cuda_compile import compile_cuda, cuobjdump

    args = {n: "i32" for n in fn.arg_names}
    args.update(X="*bf16", X16="*fp16", XE="*i32", W=w_type, S="*u8", GS="*fp32", COUNTS="*i64", Y="*fp32")
    for n in ("K", "k_per_split", "kw_per_split", "kb_per_split", "sxm", "s16m", "swg", "swn", "ssg", "ssn", "sys",
              "sym", "N"):
        if n in args:
            args[n] = 6144 * 16  # multiples of 16: the divisibility hint real shapes get
    ck = compile_cuda(fn, args, consts, num_warps=warps, num_stages=stages)
    res, sass = cuobjdump(ck)
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        Path(dump, f"{tag}.sass").write_text(sass)
        Path(dump, f"{tag}.ptx").write_text(ck.asm["ptx"])
        Path(dump, f"{tag}.ttgir").write_text(ck.asm["ttgir"])
    ls = loops(sass)
    if loop_with:
        ls = [b for b in ls if any(o.startswith(loop_with) for o in b)]
    reg = re.search(r"REG:(\d+)", res)
    row = {"tag": tag, "regs": int(reg.group(1)) if reg else -1, "shared": int(ck.metadata.shared),
           "spills": sass.count("STL")}
    if ls:
        body = ls[0]
        ops = collections.Counter(o.split(".")[0] for o in body)
        row["loop_instrs"] = len(body)
        row["per_32_weights"] = len(body) * warps * 32 / (bn * bk)
        row["ops"] = dict(ops.most_common())
    return row


# (BLOCK_N, BLOCK_K, warps); the library's decode default first
NEW_CONFIGS = ((64, 256, 4), (128, 256, 4), (128, 128, 4))
MXFP8_CONFIGS = ((64, 256, 2), (32, 256, 1), (128, 256, 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="both", choices=("old", "new", "both", "mxfp8"))
    ap.add_argument("--dump", default=None)
    ap.add_argument("--stages", type=int, default=3)
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import msakit.ops.packed_gemm.triton as T

    rows = []
    if a.kernel in ("old", "both"):
        fn = getattr(T, "_grouped_kernel_old", None) or T._grouped_kernel
        for bn, bk, w in ((64, 256, 4), (128, 256, 4), (64, 512, 4)):
            c = {"FMT": 0, "DT": 1, "OUT_F32": True, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_G": 128}
            rows.append(count(fn, c, w, a.stages, bn, bk, a.dump, f"old_bn{bn}_bk{bk}_w{w}"))
    if a.kernel in ("new", "both"):
        for bn, bk, w in NEW_CONFIGS:
            c = {"DT": 1, "OUT_F32": True, "EVEN_K": True, "EVEN_N": True, "BLOCK_M": 16,
                 "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_G": 128}
            rows.append(count(T._nvfp4_grouped_kernel, c, w, a.stages, bn, bk, a.dump,
                              f"new_bn{bn}_bk{bk}_w{w}", "*i32"))
    if a.kernel == "mxfp8":
        for bn, bk, w in MXFP8_CONFIGS:
            for even in (True, False):
                c = {"OUT_F32": True, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_G": 2, "EVEN": even}
                for loop, op, lk in (("f16", "FFMA", bk), ("bf16", "HMUL2", 32)):  # the fallback: 32-wide K steps
                    rows.append(count(T._mxfp8_grouped_kernel, c, w, a.stages, bn, lk, a.dump,
                                      f"mxfp8_{loop}_bn{bn}_bk{bk}_w{w}{'_even' if even else ''}", loop_with=op))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
