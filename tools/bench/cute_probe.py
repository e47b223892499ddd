"""Toolchain probe for CUTLASS's CuTe DSL (`nvidia-cutlass-dsl`, an optional dependency): a small
warp-specialized sm_90a kernel, compiled without a GPU, and run and checked on one.

    python tools/bench/cute_probe.py --dump DIR          # compile only (no GPU needed): PTX + cubin in DIR
    python tools/bench/cute_probe.py --run               # on a Hopper GPU: compile, run, compare with torch

The kernel: one CTA of 384 threads computes C [128, 128] fp32 = A [64, 64] @ B [128, 64]^T twice
(bf16 inputs, K-major), one copy per consumer warpgroup.  Warpgroup 0 is the producer: it gives
registers back (setmaxnreg down to 40) and one thread loads the A and B tiles by TMA into 128-byte
swizzled shared memory, completing an mbarrier by transaction bytes.  Warpgroups 1 and 2 take
registers (setmaxnreg up to 232), wait on the mbarrier and each issue four 64x128x16 warpgroup
MMAs (wgmma) from shared memory into fp32 registers, then store their copy of C: rows
64 * (warpgroup - 1) ..  Compiling it shows the pieces a generation-2 MSA kernel needs (TMA,
mbarrier, setmaxnreg, wgmma) go through the toolchain for sm_90a; the architecture comes from
`--gpu-arch` in the compile options (CUTE_DSL_ARCH does the same), not from a device.
"""

from __future__ import annotations

import argparse
import glob
import os
import site
import time

if os.path.isdir(os.path.expanduser("~/site")):  # the device's optional wheels (pip install --target ~/site)
    site.addsitedir(os.path.expanduser("~/site"))

try:  # optional dependency (pip install nvidia-cutlass-dsl); the DSL resolves names in module globals
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # pragma: no cover - without the DSL this module only explains itself
    cutlass = None

M, N, K = 64, 128, 64
CONSUMERS = 2


if cutlass is not None:
    bf16 = cutlass.BFloat16

    @cute.kernel
    def ws_kernel(tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, mC: cute.Tensor,
                  tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = SmemAllocator()
        sA = smem.allocate_tensor(bf16, sA_layout.outer, byte_alignment=1024, swizzle=sA_layout.inner)
        sB = smem.allocate_tensor(bf16, sB_layout.outer, byte_alignment=1024, swizzle=sB_layout.inner)
        bar = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        gA = cute.local_tile(mA, (M, K), (0, 0))
        gB = cute.local_tile(mB, (N, K), (0, 0))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA[None, None, 0], 0, 2),
                                           cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB[None, None, 0], 0, 2),
                                           cute.group_modes(gB, 0, 2))
        if warp < 4:  # producer warpgroup
            cute.arch.setmaxregister_decrease(40)
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, (M + N) * K * 2)
                cute.copy(tma_a, tAgA, tAsA, tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB, tBsB, tma_bar_ptr=bar)
        else:  # consumer warpgroups
            cute.arch.setmaxregister_increase(232)
            cute.arch.mbarrier_wait(bar, 0)
            wg = tidx // 128 - 1
            thr_mma = tiled_mma.get_slice(tidx % 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            tCgC = thr_mma.partition_C(cute.local_tile(mC, (M, N), (wg, 0)))
            acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            acc.fill(0.0)
            # wgmma's scale-d operand comes from the TiledMma's ACCUMULATE field (a kernel
            # parameter, False unless set): without this each k-block overwrote the accumulator.
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                cute.gemm(tiled_mma, acc, tCrA[None, None, k, 0], tCrB[None, None, k, 0], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.autovec_copy(acc, tCgC)

    @cute.jit
    def ws_gemm(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
        tiled_mma = sm90.make_trivial_tiled_mma(bf16, bf16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                                                (1, 1, 1), (M, N))
        sA_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (M, N, K), bf16, 1)
        sB_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (M, N, K), bf16, 1)
        tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA,
                                                cute.slice_(sA_layout, (None, None, 0)), (M, K))
        tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB,
                                                cute.slice_(sB_layout, (None, None, 0)), (N, K))
        ws_kernel(tma_a, tA, tma_b, tB, mC, tiled_mma, sA_layout, sB_layout).launch(
            grid=(1, 1, 1), block=(128 * (1 + CONSUMERS), 1, 1), smem=64 * 1024)



def compile_only(dump: str, arch: str = "sm_90a") -> dict:
    """Compile against fake tensors (no GPU, no driver call); PTX and cubin into `dump`."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    os.makedirs(dump, exist_ok=True)
    a = make_fake_compact_tensor(cutlass.BFloat16, (M, K), stride_order=(1, 0), assumed_align=16)
    b = make_fake_compact_tensor(cutlass.BFloat16, (N, K), stride_order=(1, 0), assumed_align=16)
    c = make_fake_compact_tensor(cutlass.Float32, (CONSUMERS * M, N), stride_order=(1, 0), assumed_align=16)
    t0 = time.time()
    cute.compile(ws_gemm, a, b, c, options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump}")
    files = sorted(glob.glob(os.path.join(dump, "*ws_gemm*")))
    return {"seconds": time.time() - t0, "files": {f: os.path.getsize(f) for f in files}}


def run_on_gpu() -> dict:
    """Compile for the present GPU, run once, compare both copies of C with torch (bf16 inputs)."""
    import torch
    from cutlass.cute.runtime import from_dlpack

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.full((CONSUMERS * M, N), float("nan"), device="cuda")
    args = [from_dlpack(x, assumed_align=16) for x in (a, b, c)]
    fn = cute.compile(ws_gemm, *args)
    fn(*args)
    torch.cuda.synchronize()
    ref = (a.float() @ b.float().T).repeat(CONSUMERS, 1)
    err = float((c - ref).abs().max())
    return {"device": torch.cuda.get_device_name(), "max_abs_err": err, "ok": bool(err < 1e-2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", default="cute_probe_out", help="where the PTX and cubin go (compile only)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--run", action="store_true", help="run on the GPU and check against torch")
    args = ap.parse_args(argv)
    if cutlass is None:
        raise SystemExit("nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl)")
    print(run_on_gpu() if args.run else compile_only(args.dump, args.arch), flush=True)


if __name__ == "__main__":
    main()
