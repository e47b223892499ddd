"""Micro-benchmark and compile report of the MXFP8 / NVFP4 Triton kernels.

    python -c "from tools.bench.formats import *; print_table(bench_formats())"
    python -c "from tools.bench.formats import *; \\
               rows = bench_formats(sizes=((8192, 8192),), variants=VARIANTS, warmup=10, rep=40); \\
               print_table(rows); print_table(best(rows))"
    python -c "from tools.bench.formats import compile_report; compile_report()"   # CPU is enough

Bandwidth definitions (every row reports all of them):
* ``gbps``       total traffic: (bytes read + bytes written) / time.  THE figure of merit: the
                 goal is gbps >= 0.7 x the measured read ceiling.
* ``read_gbps``  bytes read / time.
* ``frac_read``  gbps / read ceiling, the read ceiling being the bandwidth of a read-only
                 Triton kernel (16-byte loads, no stores) over a buffer of the size of the
                 op's input, measured in the same run (H200: ~4.1-4.2 TB/s).
* ``frac_copy``  gbps / copy ceiling, the copy ceiling being (read + write) / time of
                 ``dst.copy_(src)`` on a buffer of the size of the op's input, same run
                 (H200: ~4.2-4.3 TB/s).  A kernel moving the same bytes as a copy at the copy's
                 speed has frac_copy 1.
Byte counts are what the kernel must move: codes, scales, packed data, outputs (the 0-d
global scale is ignored).  Times are ``triton.testing.do_bench`` medians.  The
``nvfp4_*+amax`` rows also include the pass that computes the global scale (one more read
of x, counted) through the library's entry point (``nvfp4_global_scale``, which runs the fused
Triton read on CUDA); the ``(triton)`` rows call ``nvfp4_amax_scale_triton`` directly (same
kernel and bits), and ``nvfp4_amax`` / ``nvfp4_amax(triton)`` time that pass alone.  These
composite rows are two launches of ~0.05 ms with Python in between: on the H200 they vary
between identical calls (47-92% measured, benchmarks/NOTES.md) with the host's launch gaps; the single-kernel
rows are the bandwidth figures.

``variants``: (tile_elems, num_warps[, packed_compare]) to sweep (None = the launcher's
default; packed_compare "int" / "hset2" only concerns the NVFP4 quantize / fake-quantize
kernels of bfloat16 / float16 input, other ops skip the variants that only differ in it).
Each variant's outputs are compared bit for bit with the default configuration's before it
is timed (``bit_exact``; a mismatch is flagged in the table and excluded by ``best``).
``VARIANTS`` is a sweep meant to take well under 30 s on an H200 at one 8192 x 8192 size
with warmup=10, rep=40.  ``best(rows)`` picks the fastest variant per op and shape.
"""

from __future__ import annotations

import itertools
import re

import torch

__all__ = ["bench_formats", "print_table", "best", "VARIANTS", "compile_report", "compile_kernels"]

# (tile_elems, num_warps, packed_compare); None = the launcher's default.
VARIANTS: tuple[tuple, ...] = (
    (None, None, None),
    (None, None, "hset2"),
    (2048, 4, None),
    (4096, 4, None),
    (8192, 4, None),
    (8192, 8, None),
    (16384, 8, None),
    (8192, 8, "hset2"),
)
_COMPARE_OPS = (
    "nvfp4_quantize",
    "nvfp4_quantize+amax",
    "nvfp4_quantize+amax(triton)",
    "nvfp4_fake_quantize",
    "nvfp4_fake_quantize+amax",
    "nvfp4_fake_quantize+amax(triton)",
)
_AMAX_OPS = ("nvfp4_amax", "nvfp4_amax(triton)")


# ----------------------------------------------------------------------------------------------
# Ceilings (same run, same sizes)
# ----------------------------------------------------------------------------------------------


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _read_only(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0)
        tl.store(out_ptr + tl.program_id(0), tl.xor_sum(v, axis=0))  # keeps the loads alive

    return _read_only


def _ceilings(nbytes: int, device: str, warmup: int, rep: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over a buffer of `nbytes` bytes."""
    import triton
    from triton.testing import do_bench

    n = nbytes // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    block = 8192
    grid = (triton.cdiv(n, block),)
    part = torch.empty(grid[0], dtype=torch.int32, device=device)
    kern = _read_kernel()
    ms_read = float(do_bench(lambda: kern[grid](src, part, n, BLOCK=block, num_warps=8), warmup=warmup, rep=rep))
    ms_copy = float(do_bench(lambda: dst.copy_(src), warmup=warmup, rep=rep))
    return n * 4 / (ms_read * 1e-3) / 1e9, 2 * n * 4 / (ms_copy * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _outputs_equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_outputs_equal(u, v) for u, v in zip(a, b))
    return torch.equal(_bits(a), _bits(b))


def bench_formats(
    device: str = "cuda",
    sizes: tuple[tuple[int, int], ...] = ((8192, 8192), (4096, 14336), (16384, 4096)),
    dtype: torch.dtype = torch.bfloat16,
    *,
    variants: tuple[tuple, ...] | None = None,
    tile_elems: tuple[int | None, ...] = (None,),
    num_warps: tuple[int | None, ...] = (None,),
    ops: tuple[str, ...] | None = None,
    warmup: int = 25,
    rep: int = 100,
    verify: bool = True,
) -> list[dict]:
    """Times quantize / dequantize / fake-quantize of both formats at each [M, K] in `sizes`
    for every variant (`variants`, else the product of `tile_elems` x `num_warps`).  Returns
    one dict per op, size and variant: op, shape, dtype, tile_elems, num_warps,
    packed_compare, ms, bytes_read, bytes_written, gbps, read_gbps, read_ceiling_gbps,
    copy_ceiling_gbps, frac_read, frac_copy, bit_exact (output == the default variant's; None
    without `verify`).  `ops` restricts the ops (names as in the rows)."""
    from triton.testing import do_bench

    from msakit.quant.formats import nvfp4_global_scale
    from msakit.quant.formats.triton import (
        mxfp8_dequantize_triton,
        mxfp8_fake_quantize_triton,
        mxfp8_quantize_triton,
        nvfp4_dequantize_triton,
        nvfp4_amax_scale_triton,
        nvfp4_fake_quantize_triton,
        nvfp4_quantize_triton,
    )

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("bench_formats needs a CUDA device")
    if variants is None:
        variants = tuple(itertools.product(tile_elems, num_warps))
    variants = tuple((*v, None)[:3] for v in variants)
    rows: list[dict] = []
    esz = torch.empty((), dtype=dtype).element_size()
    for M, K in sizes:
        n = M * K
        read_ceiling, copy_ceiling = _ceilings(n * esz, device, warmup, rep)
        x = torch.randn(M, K, device=device, dtype=torch.float32).mul_(3.0).to(dtype)
        codes, scales = mxfp8_quantize_triton(x)
        gs = nvfp4_global_scale(x)
        packed, bscales = nvfp4_quantize_triton(x, gs)

        def cases(kw, ckw):
            return [
                ("nvfp4_amax", lambda: nvfp4_global_scale(x), n * esz, 0),
                ("nvfp4_amax(triton)", lambda: nvfp4_amax_scale_triton(x), n * esz, 0),
                ("mxfp8_quantize", lambda: mxfp8_quantize_triton(x, **kw), n * esz, n + n // 32),
                ("mxfp8_dequantize", lambda: mxfp8_dequantize_triton(codes, scales, dtype, **kw), n + n // 32, n * esz),
                ("mxfp8_fake_quantize", lambda: mxfp8_fake_quantize_triton(x, **kw), n * esz, n * esz),
                ("nvfp4_quantize", lambda: nvfp4_quantize_triton(x, gs, **kw, **ckw), n * esz, n // 2 + n // 16),
                (
                    "nvfp4_quantize+amax",
                    lambda: nvfp4_quantize_triton(x, nvfp4_global_scale(x), **kw, **ckw),
                    2 * n * esz,
                    n // 2 + n // 16,
                ),
                (
                    "nvfp4_quantize+amax(triton)",
                    lambda: nvfp4_quantize_triton(x, nvfp4_amax_scale_triton(x)[1], **kw, **ckw),
                    2 * n * esz,
                    n // 2 + n // 16,
                ),
                (
                    "nvfp4_dequantize",
                    lambda: nvfp4_dequantize_triton(packed, bscales, gs, dtype, **kw),
                    n // 2 + n // 16,
                    n * esz,
                ),
                ("nvfp4_fake_quantize", lambda: nvfp4_fake_quantize_triton(x, gs, **kw, **ckw), n * esz, n * esz),
                (
                    "nvfp4_fake_quantize+amax",
                    lambda: nvfp4_fake_quantize_triton(x, nvfp4_global_scale(x), **kw, **ckw),
                    2 * n * esz,
                    n * esz,
                ),
                (
                    "nvfp4_fake_quantize+amax(triton)",
                    lambda: nvfp4_fake_quantize_triton(x, nvfp4_amax_scale_triton(x)[1], **kw, **ckw),
                    2 * n * esz,
                    n * esz,
                ),
            ]

        reference = {name: fn() for name, fn, _, _ in cases({}, {})} if verify else {}
        done = set()
        for te, nw, cmp in variants:
            kw = {"tile_elems": te, "num_warps": nw}
            ckw = {} if cmp is None else {"packed_compare": cmp}
            for name, fn, rd, wr in cases(kw, ckw):
                if name in _AMAX_OPS:  # not configurable: time once
                    te_, nw_ = None, None
                else:
                    te_, nw_ = te, nw
                key = (name, te_, nw_, cmp if name in _COMPARE_OPS else None)
                if (ops is not None and name not in ops) or key in done:
                    continue
                done.add(key)
                exact = None
                if verify:
                    exact = (te, nw, cmp) == (None, None, None) or _outputs_equal(fn(), reference[name])
                ms = float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
                gbps = (rd + wr) / (ms * 1e-3) / 1e9
                rows.append(
                    {
                        "op": name,
                        "shape": (M, K),
                        "dtype": str(dtype).replace("torch.", ""),
                        "tile_elems": te_,
                        "num_warps": nw_,
                        "packed_compare": key[3],
                        "ms": ms,
                        "bytes_read": rd,
                        "bytes_written": wr,
                        "gbps": gbps,
                        "read_gbps": rd / (ms * 1e-3) / 1e9,
                        "read_ceiling_gbps": read_ceiling,
                        "copy_ceiling_gbps": copy_ceiling,
                        "frac_read": gbps / read_ceiling,
                        "frac_copy": gbps / copy_ceiling,
                        # against the ceiling of the same kind of traffic: read-only kernels (amax)
                        # against the read ceiling, read + write kernels against the copy ceiling
                        "frac_ceiling": gbps / (read_ceiling if wr == 0 else copy_ceiling),
                        "bit_exact": exact,
                    }
                )
        del x, codes, scales, packed, bscales, reference
    return rows


def best(rows: list[dict]) -> list[dict]:
    """The fastest bit-exact row per (op, shape)."""
    out: dict = {}
    for r in rows:
        if r.get("bit_exact") is False:
            continue
        key = (r["op"], r["shape"])
        if key not in out or r["ms"] < out[key]["ms"]:
            out[key] = r
    return list(out.values())


def print_table(rows: list[dict]) -> None:
    if rows:
        r0 = rows[0]
        print(
            f"ceilings at {r0['shape']}: read {r0['read_ceiling_gbps']:.0f} GB/s, "
            f"copy {r0['copy_ceiling_gbps']:.0f} GB/s; "
            "GB/s = (read + written) / time; %read = GB/s / read ceiling (goal >= 70%); %copy = GB/s / copy ceiling"
        )
    head = ("op", "shape", "tile", "warps", "cmp", "ms", "GB/s", "read GB/s", "%read", "%copy")
    print("{:33s} {:>13s} {:>6s} {:>5s} {:>5s} {:>8s} {:>7s} {:>9s} {:>6s} {:>6s}".format(*head))
    for r in rows:
        print(
            f"{r['op']:33s} {str(r['shape']):>13s} {str(r['tile_elems']):>6s} {str(r['num_warps']):>5s} "
            f"{str(r.get('packed_compare')):>5s} {r['ms']:8.4f} {r['gbps']:7.0f} {r['read_gbps']:9.0f} "
            f"{r['frac_read']:6.1%} {r['frac_copy']:6.1%}"
            + ("  OUTPUT DIFFERS FROM DEFAULT" if r.get("bit_exact") is False else "")
        )


# ----------------------------------------------------------------------------------------------
# Compile report (no GPU needed: the triton wheel ships ptxas and cuobjdump)
# ----------------------------------------------------------------------------------------------


def _kernel_specs(dtype: torch.dtype, tile_elems: dict, num_warps: int, packed_compare: str = "int"):
    """(name, kernel, signature {arg: type or constexpr value}, elements per program) for the
    launch configurations the launchers use on `dtype` input, EVEN, 32-bit offsets."""
    from msakit.quant.formats import triton as T

    kind = T._KIND[dtype]
    cmp = T._COMPARES[packed_compare]
    ety = {0: "*fp32", 1: "*i16", 2: "*fp16"}[kind]
    mx_te, nv_te = tile_elems["mxfp8"], tile_elems["nvfp4"]
    common = {"n_blocks": "i32", "EVEN": True, "I64": False}
    mx_br, nv_br = mx_te // 32, nv_te // 16
    specs = [
        ("mxfp8_quantize", T._mxfp8_quant_kernel,
         {"x_ptr": ety, "codes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*u8", "BS": 32, "BR": mx_br,
          "IN_KIND": kind, "OUT_KIND": 0, "FLOOR": False, "FAKE": False, **common}, mx_te),
        ("mxfp8_fake_quantize", T._mxfp8_quant_kernel,
         {"x_ptr": ety, "codes_ptr": ety, "scales_ptr": ety, "out_ptr": ety, "BS": 32, "BR": mx_br,
          "IN_KIND": kind, "OUT_KIND": kind, "FLOOR": False, "FAKE": True, **common}, mx_te),
        ("mxfp8_dequantize", T._mxfp8_dequant_kernel,
         {"codes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": ety, "BS": 32, "BR": mx_br, "OUT_KIND": kind, **common},
         mx_te),
    ]  # fmt: skip
    if kind == 0:
        specs += [
            ("nvfp4_quantize", T._nvfp4_quant32_kernel,
             {"x_ptr": "*fp32", "gs_ptr": "*fp32", "packed_ptr": "*i64", "scales_ptr": "*u8", "out_ptr": "*i64",
              "BR": nv_br, "FAKE": False, **common}, nv_te),
            ("nvfp4_fake_quantize", T._nvfp4_quant32_kernel,
             {"x_ptr": "*fp32", "gs_ptr": "*fp32", "packed_ptr": "*fp32", "scales_ptr": "*fp32", "out_ptr": "*fp32",
              "BR": nv_br, "FAKE": True, **common}, nv_te),
            ("nvfp4_dequantize", T._nvfp4_dequant32_kernel,
             {"packed_ptr": "*i64", "scales_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*fp32", "BR": nv_br, **common},
             nv_te),
        ]  # fmt: skip
    else:
        specs += [
            ("nvfp4_quantize", T._nvfp4_quant16_kernel,
             {"x_ptr": "*i32", "gs_ptr": "*fp32", "packed_ptr": "*i64", "scales_ptr": "*u8", "out_ptr": "*i64",
              "BR": nv_br, "IN_KIND": kind, "OUT_KIND": kind, "FAKE": False, "CMP": cmp, **common}, nv_te),
            ("nvfp4_fake_quantize", T._nvfp4_quant16_kernel,
             {"x_ptr": "*i32", "gs_ptr": "*fp32", "packed_ptr": "*i32", "scales_ptr": "*i32", "out_ptr": "*i32",
              "BR": nv_br, "IN_KIND": kind, "OUT_KIND": kind, "FAKE": True, "CMP": cmp, **common}, nv_te),
            ("nvfp4_dequantize", T._nvfp4_dequant16_kernel,
             {"packed_ptr": "*i64", "scales_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*i32", "BR": nv_br,
              "OUT_KIND": kind, **common}, nv_te),
        ]  # fmt: skip
    return specs, num_warps


def _compile(kernel, args: dict, num_warps: int, capability: int):
    """args: type strings for the runtime arguments, values for the constexprs."""
    from tools.cuda_compile import compile_cuda

    rt = {n: v for n, v in args.items() if isinstance(v, str)}
    consts = {n: v for n, v in args.items() if not isinstance(v, str)}
    return compile_cuda(kernel, rt, consts, aligned=("n_blocks",), capability=capability, num_warps=num_warps)


_INT_CVT = {"cvt.u64.u32", "cvt.s64.s32", "cvt.u32.u64", "cvt.u16.u32", "cvt.u32.u16", "cvt.rzi.s32.f32"}


def _inline_asm_ops(ptx: str) -> list[str]:
    """The instructions of inline assembly blocks (Triton's own and ours) other than loads,
    stores and conversions (reported separately)."""
    ops = []
    for block in re.findall(r"// begin inline asm(.*?)// end inline asm", ptx, re.S):
        ops += re.findall(r"\b(?!reg\b|mov\b)([a-z][a-z0-9]*(?:\.[a-z0-9]+)+)\s", block)
    return [op for op in ops if not op.startswith((".reg", "mov.", "ld.", "st.", "cvt."))]


def _main_path(sass: str) -> list[str]:
    """SASS instructions up to the first unpredicated EXIT (the straight-line hot path; the
    div.rn slow-path subroutines follow it)."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if not m:
            continue
        out.append(m.group(2))
        if m.group(2) == "EXIT" and not m.group(1):
            break
    return out


def compile_kernels(dtype: torch.dtype = torch.bfloat16, *, tile_elems: dict | None = None, num_warps: int = 4,
                    packed_compare: str = "int", capability: int = 90) -> list[dict]:
    """Compiles (without running) every kernel for an sm_`capability` target and returns one
    dict per kernel: name, elems (per program), regs, stack (spill bytes), local_ops
    (LDL/STL), shared, sass (main-path instructions), sass_per_elem, ld_v4 / st_v4 (16-byte
    global accesses in the PTX) / ld / st (all global accesses), cvt (the PTX conversions),
    asm (the inline PTX instructions used)."""
    from tools.cuda_compile import cuobjdump

    from msakit.quant.formats import triton as T

    if T._interpreting():
        raise RuntimeError("compile_kernels needs TRITON_INTERPRET unset (kernels are interpreted otherwise)")
    tile_elems = tile_elems or {"mxfp8": T._DEFAULT_TILE["mxfp8"], "nvfp4": T._DEFAULT_TILE["nvfp4"]}
    specs, nw = _kernel_specs(dtype, tile_elems, num_warps, packed_compare)
    rows = []
    for name, kernel, args, elems in specs:
        if "CMP" in args and args["CMP"]:
            name += f"[{packed_compare}]"
        ck = _compile(kernel, args, nw, capability)
        res, sass = cuobjdump(ck)
        ptx = ck.asm["ptx"]
        main = _main_path(sass)
        reg, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
        rows.append(
            {
                "name": name,
                "dtype": str(dtype).replace("torch.", ""),
                "elems": elems,
                "num_warps": nw,
                "regs": int(reg.group(1)) if reg else -1,
                "stack": int(stack.group(1)) if stack else -1,
                "local_ops": sum(op.startswith(("LDL", "STL")) for op in main),
                "shared": int(ck.metadata.shared),
                "sass": len(main),
                "sass_per_elem": len(main) / (elems / (32 * nw)),
                "ld_v4": len(re.findall(r"ld\.global[.\w]*\.v4", ptx)),
                "ld": len(re.findall(r"ld\.global", ptx)),
                "st_v4": len(re.findall(r"st\.global[.\w]*\.v4", ptx)),
                "st": len(re.findall(r"st\.global", ptx)),
                "cvt": sorted(set(re.findall(r"\bcvt\.[\w.]+", ptx)) - _INT_CVT),
                "asm": sorted(set(_inline_asm_ops(ptx))),
            }
        )
    return rows


def compile_report(dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,), **kw) -> list[dict]:
    """Prints (and returns) compile_kernels for each dtype (and, for 16-bit dtypes, the
    hset2 variant of the NVFP4 quantize kernels): registers, spills, shared memory,
    main-path SASS instructions per element, 16-byte vector accesses, conversions and inline
    PTX.  Runs on CPU (needs TRITON_INTERPRET unset)."""
    rows = []
    for dt in dtypes:
        rows += compile_kernels(dt, **kw)
        if dt != torch.float32 and "packed_compare" not in kw:
            rows += [r for r in compile_kernels(dt, packed_compare="hset2", **kw) if "[" in r["name"]]
    print(f"{'kernel':27s} {'dtype':8s} {'elems':>5s} {'warps':>5s} {'regs':>4s} {'spill':>5s} {'smem':>5s} "
          f"{'sass/el':>7s} {'ld.v4/ld':>8s} {'st.v4/st':>8s}  PTX conversions | inline PTX")  # fmt: skip
    for r in rows:
        spill = r["stack"] + r["local_ops"]
        print(
            f"{r['name']:27s} {r['dtype']:8s} {r['elems']:5d} {r['num_warps']:5d} {r['regs']:4d} {spill:5d} "
            f"{r['shared']:5d} {r['sass_per_elem']:7.2f} "
            f"{r['ld_v4']:>3d}/{r['ld']:<4d} {r['st_v4']:>3d}/{r['st']:<4d}  "
            f"{' '.join(r['cvt'])} | {' '.join(r['asm'])}"
        )
    return rows
