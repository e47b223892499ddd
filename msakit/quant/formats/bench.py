"""Micro-benchmark of the MXFP8 / NVFP4 Triton kernels (CUDA only; never run by the tests).

    python -c "from msakit.quant.formats.bench import bench_formats, print_table; print_table(bench_formats())"

Each row times one kernel with ``triton.testing.do_bench`` (median, in ms) and reports the
effective bandwidth (bytes read + bytes written) / time, the read bandwidth alone, and
the fraction of `peak_gbps` (H200 HBM3e: 4800 GB/s) that the total traffic reaches.  Kernel
rows take the global scale as given; the ``nvfp4_*+amax`` rows also include the amax
reduction (torch.aminmax, one extra read of x) that computes it, with check_finite=False so
that no host sync is timed.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["bench_formats", "print_table"]


def bench_formats(
    device: str = "cuda",
    sizes: tuple[tuple[int, int], ...] = ((8192, 8192), (4096, 14336), (16384, 4096)),
    dtype: torch.dtype = torch.bfloat16,
    *,
    tile_elems: tuple[int | None, ...] = (None,),
    num_warps: tuple[int | None, ...] = (None,),
    peak_gbps: float = 4800.0,
    warmup: int = 25,
    rep: int = 100,
) -> list[dict]:
    """Times quantize / dequantize / fake-quantize of both formats at each [M, K] in `sizes`
    for every (tile_elems, num_warps) pair (None = the launcher's default).  Returns one dict
    per kernel, size and config: op, shape, dtype, tile_elems, num_warps, ms, bytes_read,
    bytes_written, gbps (total), read_gbps, frac_peak."""
    from triton.testing import do_bench

    from . import _amax_scale
    from .triton import (
        mxfp8_dequantize_triton,
        mxfp8_fake_quantize_triton,
        mxfp8_quantize_triton,
        nvfp4_dequantize_triton,
        nvfp4_fake_quantize_triton,
        nvfp4_quantize_triton,
    )

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("bench_formats needs a CUDA device")
    rows: list[dict] = []
    esz = torch.empty((), dtype=dtype).element_size()
    for (M, K), te, nw in itertools.product(sizes, tile_elems, num_warps):
        x = torch.randn(M, K, device=device, dtype=torch.float32).mul_(3.0).to(dtype)
        n = M * K
        kw = {"tile_elems": te, "num_warps": nw}
        codes, scales = mxfp8_quantize_triton(x, **kw)
        gs = _amax_scale(x)[1]
        packed, bscales = nvfp4_quantize_triton(x, gs, **kw)

        def nvfp4_quant_amax():
            return nvfp4_quantize_triton(x, _amax_scale(x)[1], **kw)

        def nvfp4_fake_amax():
            return nvfp4_fake_quantize_triton(x, _amax_scale(x)[1], **kw)

        cases = [
            ("mxfp8_quantize", lambda: mxfp8_quantize_triton(x, **kw), n * esz, n + n // 32),
            ("mxfp8_dequantize", lambda: mxfp8_dequantize_triton(codes, scales, dtype, **kw), n + n // 32, n * esz),
            ("mxfp8_fake_quantize", lambda: mxfp8_fake_quantize_triton(x, **kw), n * esz, n * esz),
            ("nvfp4_quantize", lambda: nvfp4_quantize_triton(x, gs, **kw), n * esz, n // 2 + n // 16),
            ("nvfp4_quantize+amax", nvfp4_quant_amax, 2 * n * esz, n // 2 + n // 16),
            (
                "nvfp4_dequantize",
                lambda: nvfp4_dequantize_triton(packed, bscales, gs, dtype, **kw),
                n // 2 + n // 16,
                n * esz,
            ),
            ("nvfp4_fake_quantize", lambda: nvfp4_fake_quantize_triton(x, gs, **kw), n * esz, n * esz),
            ("nvfp4_fake_quantize+amax", nvfp4_fake_amax, 2 * n * esz, n * esz),
        ]
        for name, fn, rd, wr in cases:
            ms = float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
            gbps = (rd + wr) / (ms * 1e-3) / 1e9
            rows.append(
                {
                    "op": name,
                    "shape": (M, K),
                    "dtype": str(dtype).replace("torch.", ""),
                    "tile_elems": te,
                    "num_warps": nw,
                    "ms": ms,
                    "bytes_read": rd,
                    "bytes_written": wr,
                    "gbps": gbps,
                    "read_gbps": rd / (ms * 1e-3) / 1e9,
                    "frac_peak": gbps / peak_gbps,
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("op", "shape", "tile", "warps", "ms", "GB/s", "read GB/s", "peak")
    print("{:26s} {:>13s} {:>6s} {:>5s} {:>8s} {:>8s} {:>9s} {:>6s}".format(*head))
    for r in rows:
        print(
            f"{r['op']:26s} {str(r['shape']):>13s} {str(r['tile_elems']):>6s} {str(r['num_warps']):>5s} "
            f"{r['ms']:8.4f} {r['gbps']:8.0f} {r['read_gbps']:9.0f} {r['frac_peak']:6.1%}"
        )
