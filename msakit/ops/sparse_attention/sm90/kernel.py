"""The union-tile query-outer sparse-attention forward for sm_90a, in CUTLASS's CuTe DSL.

Imported only when `nvidia-cutlass-dsl` is installed (`cutlass` at module level: the DSL resolves
names in module globals).  Layouts (bf16 unless stated):

    q, o   [B, T, Hq, D]        k, v [B, T, G, D]        lse fp32 [B, Hq, T]
    work   int32 [B, G, ntiles, cap], count int32 [B, G, ntiles]   (`worklist.union_worklist`)

One CTA per (tile of QUERIES consecutive queries, kv group g, batch b); its 16 * QUERIES rows are
(query, head) pairs, row = query-in-tile * HPG + head-in-group.  1 + CONSUMERS warpgroups:

- warpgroup 0, the producer: gives registers back (setmaxnreg) and its warp 0 loads, for each
  entry of the tile's work list, the K block then the V block (128 tokens x D) by TMA into a
  STAGES-deep ring of 128-byte-swizzled shared-memory buffers, each completing an mbarrier by
  transaction bytes (`cutlass.pipeline.PipelineTmaAsync`, one pipeline for K and one for V);
- warpgroups 1 .. CONSUMERS: take registers; warpgroup w owns rows 64 (w - 1) .. 64 w - 1 (4
  queries x 16 heads).  Q is read once from global memory into the warpgroup's own 128-byte-
  swizzled shared tile, the A operand of S = Q K^T (wgmma, A and B from shared memory, fp32).
  Per work entry: S = Q K^T, the per-row mask (a row whose query did not select the block ->
  -inf; the causal mask j <= i only on blocks at or past the tile's own block), online softmax in
  registers (exp2, one row max and sum per row, reduced over the 4 lanes that share a row), P to
  bf16 in the registers of the second MMA's A operand, O += P V (wgmma, V^T read as an MN-major
  view of the same buffer).
- epilogue: O / rowsum (0 for a row with no key) to bf16 and lse = max * scale + log(sum)
  (natural log; -inf for a row with no key), written per (query, head) for queries < T.

The consumer loop is FlashAttention-3's intra-warpgroup overlap with one S register set: the first
entry's S and softmax before the loop; per entry i with a next one (`_overlap_entry`): P_i to
bf16, wait V_i and K_{i+1}, issue S_{i+1} = Q K_{i+1}^T into the S registers and O += P_i V_i,
wait for S_{i+1} (release K_{i+1}), mask and softmax of entry i + 1, wait for P_i V_i (release
V_i), then O *= alpha_{i+1}; the last entry's P V after the loop.  Per entry the values are those
of the sequential order (S, softmax and rescale, P V): O gets P_i V_i added, then the rescale of
entry i + 1.  In the SASS ptxas places a full wgmma wait before the softmax's first write to S
(after the partial wait that completes S_{i+1}), so the softmax does not run under P V.

The wgmma's scale-d operand is the TiledMma's runtime ACCUMULATE field: set False for the first
k-block of S (zero init) and True after; O is zeroed once and always accumulated.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .consts import BLOCK, HPG, QBITS
from .consts import HEAD_DIM as D

WG_ROWS = 64  # rows per consumer warpgroup (one wgmma M tile)
LOG2E = math.log2(math.e)
DEBUG_LAYOUTS = False  # print the fragments' layouts while tracing
LN2 = math.log(2.0)


def _aligned_strides(t: cute.Tensor) -> cute.Tensor:
    """t with every dynamic stride but the last assumed a multiple of 16 bytes (TMA needs it; the
    host wrapper checks the tensors are contiguous with D = 128)."""
    div = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=div) for s in t.stride[:-1])
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(*strides, t.stride[-1])))


class SparseFwdSm90:
    """The kernel of the module docstring; `consumers` consumer warpgroups (1 or 2: tiles of 4 or
    8 queries), `stages` buffers per pipeline."""

    def __init__(self, consumers: int = 2, stages: int = 2):
        if consumers not in (1, 2) or stages < 1:
            raise ValueError(f"consumers must be 1 or 2 and stages >= 1, got {consumers}, {stages}")
        self.consumers = consumers
        self.stages = stages
        self.queries = consumers * WG_ROWS // HPG
        self.threads = 128 * (1 + consumers)
        self.producer_regs, self.consumer_regs = (40, 232) if consumers == 2 else (56, 240)
        assert self.queries <= QBITS

    # ------------------------------------------------------------------ host side (jit)
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mWork: cute.Tensor, mCount: cute.Tensor, scale: Float32, stream: cuda.CUstream):
        bf16 = cutlass.BFloat16
        mQ, mK, mV, mO = [_aligned_strides(t) for t in (mQ, mK, mV, mO)]
        # (B, T, G, D) -> (T, D, G, B): a block of one (g, b) is a (BLOCK, D) tile of the first two modes
        kv_order = [1, 3, 2, 0]
        mKt = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=kv_order))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=kv_order))
        # S = Q K^T reads Q from shared memory (SS): with Q as a register operand (RS) ptxas gave
        # its registers to P after the first work entry (S of every later entry came out ~0)
        tiled_qk = sm90.make_trivial_tiled_mma(bf16, bf16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                               (1, 1, 1), (WG_ROWS, BLOCK))
        tiled_pv = sm90.make_trivial_tiled_mma(bf16, bf16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                               (1, 1, 1), (WG_ROWS, D), a_source=warpgroup.OperandSource.RMEM)
        # K and V buffers: (BLOCK, D, stages), D contiguous, 128-byte swizzle (the B operand of S = Q K^T)
        s_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (WG_ROWS, BLOCK, D), bf16, self.stages)
        one = cute.slice_(s_layout, (None, None, 0))
        # Q: one (WG_ROWS, D) K-major tile per consumer warpgroup (the A operand of S = Q K^T)
        q_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (WG_ROWS, BLOCK, D), bf16, self.consumers)
        tma_k, tK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mKt, one, (BLOCK, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mVt, one, (BLOCK, D))
        tx_bytes = BLOCK * D * 2
        B, T = mQ.shape[0], mQ.shape[1]
        G = mK.shape[2]
        ntiles = (T + self.queries - 1) // self.queries
        buf_bytes = cute.cosize(s_layout) * 2
        smem = 2 * buf_bytes + cute.cosize(q_layout) * 2 + 2048  # K, V rings, Q tiles, mbarriers, alignment
        self.kernel(mQ, tma_k, tK, tma_v, tV, mO, mLSE, mWork, mCount, scale * LOG2E, scale, tiled_qk,
                    tiled_pv, s_layout, q_layout, tx_bytes).launch(
            grid=(ntiles, G, B), block=(self.threads, 1, 1), smem=smem, stream=stream, min_blocks_per_mp=1)

    def _entry_state(self, i: Int32) -> pipeline.PipelineState:
        """The consumer's pipeline state of work entry i (stage i mod stages, phase bit of the
        round), as `stages`-fold advances of `make_pipeline_state(Consumer)` give it."""
        return pipeline.PipelineState(self.stages, i, i % self.stages, (i // self.stages) % 2)

    @cute.jit
    def _issue_qk(self, tiled_qk: cute.TiledMma, acc: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                  wg: Int32, stage: Int32) -> cute.TiledMma:
        """Issue S = Q K^T of one K stage into acc (zero-initialised by the first k-block) and
        commit it as one wgmma group; not waited.  Returns tiled_qk, whose ACCUMULATE field it
        set: the caller rebinds it, so that the field's value is carried out of a branch."""
        warpgroup.fence()
        tiled_qk.set(warpgroup.Field.ACCUMULATE, False)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(tiled_qk, acc, tSrQ[None, None, k, wg], tSrK[None, None, k, stage], acc)
            tiled_qk.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return tiled_qk

    @cute.jit
    def _overlap_entry(self, i: Int32, has_next: cutlass.Constexpr, tiled_qk: cute.TiledMma,
                       tiled_pv: cute.TiledMma, ops: tuple, mWork: cute.Tensor, b: Int32, g: Int32, tile: Int32,
                       own: Int32, wg: Int32, scale_log2: Float32) -> cute.TiledMma:
        """Work entry i of the consumer loop, its softmax done (P in fp32 in acc_S, O rescaled):
        O += P V; with has_next, S of entry i + 1 into acc_S (issued before P V, waited after it is
        issued) and its softmax between P V's issue and its wait, then O's rescale.  Returns
        tiled_qk (`_issue_qk`)."""
        pipe_k, pipe_v, tSrQ, tSrK, tOrP, tOrP_acc, tOrV, acc_S, acc_O, cS, row_max, row_sum, row_q, alpha = ops
        tOrP_acc.store(acc_S.load().to(cutlass.BFloat16))
        # both stages are waited for before the first wgmma is issued: no branch (the mbarrier
        # wait loop) between the two wgmma groups, or ptxas cannot tell S's group from P V's and
        # waits for both before the softmax touches S (V of i is loaded before K of i + 1)
        vst = self._entry_state(i)
        pipe_v.consumer_wait(vst)
        if cutlass.const_expr(has_next):  # ---- S of the next entry into acc_S (read into P above)
            kst = self._entry_state(i + 1)
            pipe_k.consumer_wait(kst)
            tiled_qk = self._issue_qk(tiled_qk, acc_S, tSrQ, tSrK, wg, kst.index)
        # ---- O += P V
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(tiled_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, vst.index], acc_O)
        warpgroup.commit_group()
        if cutlass.const_expr(has_next):  # groups complete in order: S of i + 1, then P V of i
            warpgroup.wait_group(1)
            pipe_k.consumer_release(kst)
            e = mWork[b, g, tile, i + 1]
            self._softmax(acc_S, acc_O, cS, row_max, row_sum, row_q, e, e >> QBITS, own, tile, scale_log2,
                          alpha_out=alpha)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(vst)
        if cutlass.const_expr(has_next):
            for r in cutlass.range_constexpr(2):
                for v in cutlass.range_constexpr(cute.size(acc_O) // 4):
                    for c0 in cutlass.range_constexpr(2):
                        acc_O[c0 + 2 * r + 4 * v] = acc_O[c0 + 2 * r + 4 * v] * alpha[r]
        return tiled_qk

    @cute.jit
    def _softmax(self, acc_S: cute.Tensor, acc_O: cute.Tensor, cS: cute.Tensor, row_max: cute.Tensor,
                 row_sum: cute.Tensor, row_q: cute.Tensor, e: Int32, blk: Int32, own: Int32, tile: Int32,
                 scale_log2: Float32, alpha_out: cute.Tensor = None):
        """Mask, online softmax and O rescale of one work entry e (block blk = e >> QBITS, row mask
        e & 0xFF; own: the tile's block), in place: S (acc_S) -> unnormalised P, row_max / row_sum
        updated, acc_O scaled by alpha (with alpha_out: alpha stored there per row, acc_O untouched,
        for a caller whose P V wgmma is still in flight)."""
        nv = cute.size(acc_S) // 4
        causal = blk >= own
        for r in cutlass.range_constexpr(2):
            keep = ((e >> row_q[r]) & 1) != 0
            # causal: column c of the block is key blk * BLOCK + c <= query; elsewhere no limit
            lim = tile * self.queries + row_q[r] - blk * BLOCK if causal else Int32(BLOCK)
            mx = -Float32.inf
            for v in cutlass.range_constexpr(nv):
                for c0 in cutlass.range_constexpr(2):
                    j = c0 + 2 * r + 4 * v
                    ok = keep & (cS[j][1] <= lim)
                    s = acc_S[j] if ok else -Float32.inf
                    acc_S[j] = s
                    mx = cute.arch.fmax(mx, s)
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            m_new = cute.arch.fmax(row_max[r], mx)
            base = m_new * scale_log2 if m_new != -Float32.inf else Float32(0.0)
            alpha = cute.math.exp2(row_max[r] * scale_log2 - base, fastmath=True)
            row_max[r] = m_new
            acc = Float32(0.0)
            for v in cutlass.range_constexpr(nv):
                for c0 in cutlass.range_constexpr(2):
                    j = c0 + 2 * r + 4 * v
                    p = cute.math.exp2(acc_S[j] * scale_log2 - base, fastmath=True)
                    acc_S[j] = p
                    acc += p
            row_sum[r] = row_sum[r] * alpha + acc
            if cutlass.const_expr(alpha_out is None):
                for v in cutlass.range_constexpr(cute.size(acc_O) // 4):
                    for c0 in cutlass.range_constexpr(2):
                        acc_O[c0 + 2 * r + 4 * v] = acc_O[c0 + 2 * r + 4 * v] * alpha
            else:
                alpha_out[r] = alpha

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
               mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, mCount: cute.Tensor,
               scale_log2: Float32, scale: Float32, tiled_qk: cute.TiledMma, tiled_pv: cute.TiledMma,
               s_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout, tx_bytes: cutlass.Constexpr):
        bf16 = cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        tile, g, b = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        alloc = cutlass.utils.SmemAllocator()
        sK = alloc.allocate_tensor(bf16, s_layout.outer, byte_alignment=1024, swizzle=s_layout.inner)
        sV = alloc.allocate_tensor(bf16, s_layout.outer, byte_alignment=1024, swizzle=s_layout.inner)
        sQ = alloc.allocate_tensor(bf16, q_layout.outer, byte_alignment=1024, swizzle=q_layout.inner)
        bars = alloc.allocate_array(cutlass.Int64, 4 * self.stages, byte_alignment=8)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumers * 4)  # one arrive per warp
        pipe_k = pipeline.PipelineTmaAsync.create(barrier_storage=bars, num_stages=self.stages,
                                                  producer_group=producer, consumer_group=consumer,
                                                  tx_count=tx_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(barrier_storage=bars + 2 * self.stages, num_stages=self.stages,
                                                  producer_group=producer, consumer_group=consumer,
                                                  tx_count=tx_bytes, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        n = mCount[b, g, tile]
        if warp < 4:  # ---------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                gK = cute.local_tile(mK[None, None, g, b], (BLOCK, D), (None, 0))  # (BLOCK, D, nblocks)
                gV = cute.local_tile(mV[None, None, g, b], (BLOCK, D), (None, 0))
                tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                 cute.group_modes(gK, 0, 2))
                tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                 cute.group_modes(gV, 0, 2))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for i in cutlass.range(n, unroll=1):
                    blk = mWork[b, g, tile, i] >> QBITS
                    pipe_k.producer_acquire(state)
                    cute.copy(tma_k, tKg[None, blk], tKs[None, state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(state))
                    pipe_v.producer_acquire(state)
                    cute.copy(tma_v, tVg[None, blk], tVs[None, state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(state))
                    state.advance()
        else:  # ------------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = tidx // 128 - 1
            tid = tidx % 128
            T = mQ.shape[1]
            t0 = tile * self.queries + wg * (WG_ROWS // HPG)  # this warpgroup's first query
            own = (tile * self.queries) // BLOCK  # every query of the tile lies in this block
            h0 = g * HPG

            thr_qk = tiled_qk.get_slice(tid)
            thr_pv = tiled_pv.get_slice(tid)
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, D / 16, consumers)
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
            sVt = cute.composition(sV, cute.make_ordered_layout((D, BLOCK, self.stages), order=(1, 0, 2)))
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((WG_ROWS, BLOCK)), Float32)
            acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((WG_ROWS, D)), Float32)
            tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((WG_ROWS, BLOCK)))
            tOrP_acc = cute.make_tensor(tOrP.iterator, acc_S.layout)  # P in the accumulator's element order
            cS = thr_qk.partition_C(cute.make_identity_tensor((WG_ROWS, BLOCK)))
            cO = thr_pv.partition_C(cute.make_identity_tensor((WG_ROWS, D)))
            if cutlass.const_expr(DEBUG_LAYOUTS):
                print('acc_S', acc_S.layout, 'tOrP', tOrP.layout, 'tSrQ', tSrQ.layout, 'acc_O', acc_O.layout, 'cS', cS.layout)

            # Q rows -> this warpgroup's shared tile (row r = query-in-warpgroup * HPG + head; thread
            # tid copies column tid of every row; queries past T read row T - 1, never stored)
            for r in cutlass.range_constexpr(WG_ROWS):
                t = cutlass.min(t0 + r // HPG, T - 1)
                sQ[r, tid, wg] = mQ[b, t, h0 + r % HPG, tid]
            cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> wgmma's reads
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=128)

            # accumulator fragments: ((2 cols, 2 rows, N/8), 1, 1); a thread holds 2 rows
            row_max = cute.make_rmem_tensor((2,), Float32)
            row_sum = cute.make_rmem_tensor((2,), Float32)
            row_q = cute.make_rmem_tensor((2,), Int32)  # query-in-tile of each row
            for r in cutlass.range_constexpr(2):
                row_max[r] = -Float32.inf
                row_sum[r] = 0.0
                row_q[r] = wg * (WG_ROWS // HPG) + cS[2 * r][0] // HPG
            acc_O.fill(0.0)

            # FlashAttention-3's intra-warpgroup overlap with one S register set (module docstring):
            # entry i starts with its softmax done (P in fp32 in acc_S, O rescaled); P -> bf16, S of
            # entry i + 1 issued into acc_S, P V of entry i issued, S of i + 1 waited, its softmax,
            # P V of i waited, O's rescale by alpha.  The last entry is peeled off the loop: no
            # wgmma is issued in a branch that joins before its wait (ptxas serialises every wgmma
            # of the kernel where one is), and P is written and read by its wgmma within one entry
            # (no wgmma operand crosses a back edge)
            tiled_pv.set(warpgroup.Field.ACCUMULATE, True)  # outside the branches: O always accumulates
            alpha = cute.make_rmem_tensor((2,), Float32)
            ops = (pipe_k, pipe_v, tSrQ, tSrK, tOrP, tOrP_acc, tOrV, acc_S, acc_O, cS, row_max, row_sum, row_q,
                   alpha)
            if n > 0:
                st0 = self._entry_state(Int32(0))
                pipe_k.consumer_wait(st0)
                tiled_qk = self._issue_qk(tiled_qk, acc_S, tSrQ, tSrK, wg, st0.index)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(st0)
                e0 = mWork[b, g, tile, 0]
                self._softmax(acc_S, acc_O, cS, row_max, row_sum, row_q, e0, e0 >> QBITS, own, tile, scale_log2)
            for i in cutlass.range(n - 1, unroll=1):  # entries 0 .. n - 2: each has a next one
                tiled_qk = self._overlap_entry(i, True, tiled_qk, tiled_pv, ops, mWork, b, g, tile, own, wg,
                                               scale_log2)
            if n > 0:
                tiled_qk = self._overlap_entry(n - 1, False, tiled_qk, tiled_pv, ops, mWork, b, g, tile, own, wg,
                                               scale_log2)

            # ---- epilogue: O / sum, lse
            for r in cutlass.range_constexpr(2):
                s = row_sum[r]
                s += cute.arch.shuffle_sync_bfly(s, offset=1)
                s += cute.arch.shuffle_sync_bfly(s, offset=2)
                inv = cute.arch.rcp_approx(s) if s > 0.0 else Float32(0.0)
                lse = row_max[r] * scale + cute.math.log(s, fastmath=False) if s > 0.0 else -Float32.inf
                t = tile * self.queries + row_q[r]
                h = h0 + cS[2 * r][0] % HPG
                if t < T:
                    for v in cutlass.range_constexpr(cute.size(acc_O) // 4):
                        for c0 in cutlass.range_constexpr(2):
                            j = c0 + 2 * r + 4 * v
                            mO[b, t, h, cO[j][1]] = (acc_O[j] * inv).to(bf16)
                    if tid % 4 == 0:
                        mLSE[b, h, t] = lse


def fake_tensor(dtype, rank: int):
    """A fake tensor of `rank` dynamic dimensions (innermost stride 1), as the host wrappers'
    from_dlpack tensors are: the offline compilations' arguments."""
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=16 if dtype is cutlass.BFloat16 else 4)


def compile_offline(op, args: list, scale: float, dump_dir: str | None, arch: str) -> dict:
    """cute.compile(op, *args, scale, stream) for `arch` (no GPU or torch needed); with dump_dir,
    the PTX and cubin go there.  Returns {"seconds", "files": {name: bytes}}."""
    import glob
    import os
    import time

    opts = f"--gpu-arch {arch}"
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        opts += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    t0 = time.time()
    cute.compile(op, *args, Float32(scale), cuda.CUstream(0), options=opts)
    files = sorted(glob.glob(os.path.join(dump_dir, "*"))) if dump_dir else []
    return {"seconds": time.time() - t0, "files": {os.path.basename(f): os.path.getsize(f) for f in files}}


def compile_check(dump_dir: str | None = None, arch: str = "sm_90a", consumers: int = 2, stages: int = 2) -> dict:
    """Compile the kernel for `arch` against fake tensors: no GPU or torch needed.  With dump_dir,
    the PTX and cubin go there.  Returns {"seconds", "files": {name: bytes}}."""
    bf16 = cutlass.BFloat16
    args = [fake_tensor(bf16, 4) for _ in range(4)] + [fake_tensor(Float32, 3), fake_tensor(Int32, 4),
                                                       fake_tensor(Int32, 3)]
    return compile_offline(SparseFwdSm90(consumers, stages), args, 0.0884, dump_dir, arch)
