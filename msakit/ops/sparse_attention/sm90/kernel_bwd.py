"""The key-block-outer sparse-attention backward for sm_90a, in CUTLASS's CuTe DSL.

Imported only when `nvidia-cutlass-dsl` is installed (`cutlass` at module level: the DSL resolves
names in module globals).  Layouts (bf16 unless stated):

    q, do      [B, T, Hq, D]            k, v [B, T, G, D]
    lse2, delta fp32 [B, T, Hq]         lse * log2(e) and rowsum(dO * O) (the host wrapper's
                                        preprocessing)
    dq_accum   fp32 [B * G * nmb * 8192] per (b, g, m-block): two D halves of 64 rows x 64
                                        columns, column c of row r at c ^ (8 * (r % 8))
                                        (`worklist_bwd.dq_from_accum`); zeroed by the caller
    dk_accum, dv_accum fp32 [B, T, G, D] zeroed by the caller; dK without the softmax scale
    items int32 [n_items, 4], ent int32 [E]   (`worklist_bwd`)

FlashAttention-3's backward (hdim 128, causal: tile_m 64, tile_n 128, S and dP computed
transposed, dK / dV with P^T and dS^T from registers) over MSA's work list.  One CTA per item
(b, g, key block blk, a run of m-blocks whose union holds blk); an m-block is 4 consecutive
queries x the group's 16 heads = 64 rows (row = query-in-m-block * 16 + head), loaded by TMA as
one box of the (heads, queries) view of q / do, with its 64 lse2 and delta values.  384 threads:

- warpgroup 0, the producer: gives registers back; its warp 0 loads K and V of the block once
  (one mbarrier, 64 KB) and per m-block Q + lse2 and dO + delta into STAGES-deep rings
  (`PipelineTmaAsync`, 128-byte-swizzled tiles);
- warpgroups 1 and 2, the consumers: warpgroup w owns keys 64 w .. 64 w + 63 of the block and
  D columns 64 w .. 64 w + 63 of dQ.  Per m-block:
    S^T = K Q^T and dP^T = V dO^T (wgmma SS, fp32, 64 keys x 64 rows per warpgroup);
    P^T = exp2(S^T scale log2(e) - lse2) where the row's query selected blk (its bit of the
    entry's mask) and key <= query, else 0; dS^T = P^T (dP^T - delta);
    dV += P^T dO and dK += dS^T Q (wgmma RS: P^T and dS^T in bf16 registers; accumulators 64 x
    128 fp32 per warpgroup, 64 + 64 registers a thread, kept over the item);
    dS to shared memory (64 rows x 128 keys, both warpgroups' halves; named barrier), dQ = dS K
    (wgmma SS, 64 rows x 64 columns per warpgroup), to shared memory in the accumulator layout
    above and added to dq_accum by one bulk reduce (`cp.reduce.async.bulk .add.f32`, 16 KB) per
    warpgroup, waited for (read) before the next m-block overwrites the buffer;
  after the last m-block, dK and dV are added to dk_accum / dv_accum by fp32 atomics (keys < T).

Rows of a query past T read zeros (TMA bounds) and have no mask bit, so they add nothing; a key
block's tokens past T are zeros and never written.  wgmma groups per m-block in order: S^T, dP^T
(waited before the softmax, then dS), dV, dQ (waited: dV done -> release dO), dK (waited: dQ
done -> its shared-memory store and reduce), then everything (release Q).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from .consts import BLOCK, HPG, MB_BITS, MB_QUERIES
from .consts import HEAD_DIM as D

MB_ROWS = MB_QUERIES * HPG  # rows of an m-block (64)
LOG2E = math.log2(math.e)
DQ_HALF = MB_ROWS * (D // 2)  # fp32 elements of one warpgroup's dQ tile (4096)


def _aligned_strides(t: cute.Tensor) -> cute.Tensor:
    """t with every dynamic stride but the last assumed a multiple of 16 bytes (TMA needs it; the
    host wrapper checks the tensors are contiguous with D = 128)."""
    div = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=div) for s in t.stride[:-1])
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(*strides, t.stride[-1])))


@dsl_user_op
def _bulk_reduce_add_f32(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, nbytes: int, *, loc=None, ip=None):
    """cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: nbytes of fp32 from shared
    memory added into global memory (one thread issues it; commit and wait as a bulk group)."""
    llvm.inline_asm(None, [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(),
                           Int32(nbytes).ir_value(loc=loc, ip=ip)],
                    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class SparseBwdSm90:
    """The kernel of the module docstring: `stages` buffers per Q and dO pipeline."""

    def __init__(self, stages: int = 2):
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}")
        self.stages = stages
        self.threads = 384
        self.producer_regs, self.consumer_regs = 24, 240

    # ------------------------------------------------------------------ host side (jit)
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                 mDelta: cute.Tensor, mDQa: cute.Tensor, mDKa: cute.Tensor, mDVa: cute.Tensor, mItems: cute.Tensor,
                 mEnt: cute.Tensor, scale_log2: Float32, stream: cuda.CUstream):
        bf16 = cutlass.BFloat16
        mQ, mK, mV, mdO = [_aligned_strides(t) for t in (mQ, mK, mV, mdO)]
        mLSE2, mDelta = [_aligned_strides(t) for t in (mLSE2, mDelta)]
        # (B, T, G, D) -> (T, D, G, B): a block of one (g, b) is a (BLOCK, D) tile of the first two modes
        kv_order = [1, 3, 2, 0]
        mKt = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=kv_order))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=kv_order))

        # (B, T, Hq, D) -> ((HPG, T), D, G, B): an m-block of one (g, b) is a (64, D) tile, rows (head, query)
        def rows_view(t: cute.Tensor) -> cute.Tensor:
            return cute.make_tensor(t.iterator, cute.make_layout(
                ((HPG, t.shape[1]), t.shape[3], t.shape[2] // HPG, t.shape[0]),
                stride=((t.stride[2], t.stride[1]), t.stride[3], t.stride[2] * HPG, t.stride[0])))

        # (B, T, Hq) fp32 -> ((HPG, T), G, B)
        def stat_view(t: cute.Tensor) -> cute.Tensor:
            return cute.make_tensor(t.iterator, cute.make_layout(
                ((HPG, t.shape[1]), t.shape[2] // HPG, t.shape[0]),
                stride=((t.stride[2], t.stride[1]), t.stride[2] * HPG, t.stride[0])))

        mQv, mdOv = rows_view(mQ), rows_view(mdO)
        mLv, mDv = stat_view(mLSE2), stat_view(mDelta)

        # S^T = K Q^T, dP^T = V dO^T: M = 128 keys over the two consumer warpgroups, N = 64 rows
        tiled_sdp = sm90.make_trivial_tiled_mma(bf16, bf16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                (2, 1, 1), (64, MB_ROWS))
        # dV += P^T dO, dK += dS^T Q: M = 128 keys over the warpgroups, N = D, K = 64 rows; A from registers
        tiled_dkv = sm90.make_trivial_tiled_mma(bf16, bf16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                (2, 1, 1), (64, D), a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K: M = 64 rows, N = D over the warpgroups, K = 128 keys
        tiled_dq = sm90.make_trivial_tiled_mma(bf16, bf16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                               (1, 2, 1), (MB_ROWS, D // 2))
        kv_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK, MB_ROWS, D), bf16, 1)
        q_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK, MB_ROWS, D), bf16, self.stages)
        ds_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (MB_ROWS, D, BLOCK), bf16, 1)
        stat_layout = cute.make_layout((MB_ROWS, self.stages))
        kv_one = cute.slice_(kv_layout, (None, None, 0))
        q_one = cute.slice_(q_layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mKt, kv_one, (BLOCK, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mVt, kv_one, (BLOCK, D))
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQv, q_one, (MB_ROWS, D))
        tma_do, tdO = cpasync.make_tiled_tma_atom(g2s, mdOv, q_one, (MB_ROWS, D))
        tma_l, tL = cpasync.make_tiled_tma_atom(g2s, mLv, cute.make_layout(MB_ROWS), (MB_ROWS,))
        tma_d, tDl = cpasync.make_tiled_tma_atom(g2s, mDv, cute.make_layout(MB_ROWS), (MB_ROWS,))
        smem = (2 * cute.cosize(kv_layout) * 2 + 2 * cute.cosize(q_layout) * 2 + cute.cosize(ds_layout) * 2
                + 2 * DQ_HALF * 4 + 2 * cute.cosize(stat_layout) * 4 + 8192)  # + mbarriers, alignment
        n_items = mItems.shape[0]
        self.kernel(tma_k, tK, tma_v, tV, tma_q, tQ, tma_do, tdO, tma_l, tL, tma_d, tDl, mDQa, mDKa, mDVa,
                    mItems, mEnt, scale_log2, tiled_sdp, tiled_dkv, tiled_dq, kv_layout, q_layout, ds_layout,
                    stat_layout).launch(grid=(n_items, 1, 1), block=(self.threads, 1, 1), smem=smem, stream=stream,
                                        min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_l: cute.CopyAtom, mL: cute.Tensor, tma_d: cute.CopyAtom, mDl: cute.Tensor,
               mDQa: cute.Tensor, mDKa: cute.Tensor, mDVa: cute.Tensor, mItems: cute.Tensor, mEnt: cute.Tensor,
               scale_log2: Float32, tiled_sdp: cute.TiledMma, tiled_dkv: cute.TiledMma, tiled_dq: cute.TiledMma,
               kv_layout: cute.ComposedLayout, q_layout: cute.ComposedLayout, ds_layout: cute.ComposedLayout,
               stat_layout: cute.Layout):
        bf16 = cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in (tma_k, tma_v, tma_q, tma_do, tma_l, tma_d):
                cpasync.prefetch_descriptor(atom)

        alloc = cutlass.utils.SmemAllocator()
        sK = alloc.allocate_tensor(bf16, kv_layout.outer, byte_alignment=1024, swizzle=kv_layout.inner)
        sV = alloc.allocate_tensor(bf16, kv_layout.outer, byte_alignment=1024, swizzle=kv_layout.inner)
        sQ = alloc.allocate_tensor(bf16, q_layout.outer, byte_alignment=1024, swizzle=q_layout.inner)
        sdO = alloc.allocate_tensor(bf16, q_layout.outer, byte_alignment=1024, swizzle=q_layout.inner)
        sdS = alloc.allocate_tensor(bf16, ds_layout.outer, byte_alignment=1024, swizzle=ds_layout.inner)
        sdQ = alloc.allocate_tensor(Float32, cute.make_layout(2 * DQ_HALF), byte_alignment=128)
        sL = alloc.allocate_tensor(Float32, stat_layout, byte_alignment=128)
        sDl = alloc.allocate_tensor(Float32, stat_layout, byte_alignment=128)
        bars = alloc.allocate_array(cutlass.Int64, 2 + 4 * self.stages, byte_alignment=8)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 8)  # one arrive per consumer warp
        tile_bytes = MB_ROWS * D * 2 + MB_ROWS * 4
        pipe_kv = pipeline.PipelineTmaAsync.create(barrier_storage=bars, num_stages=1, producer_group=producer,
                                                   consumer_group=consumer, tx_count=2 * BLOCK * D * 2,
                                                   defer_sync=True)
        pipe_q = pipeline.PipelineTmaAsync.create(barrier_storage=bars + 2, num_stages=self.stages,
                                                  producer_group=producer, consumer_group=consumer,
                                                  tx_count=tile_bytes, defer_sync=True)
        pipe_do = pipeline.PipelineTmaAsync.create(barrier_storage=bars + 2 + 2 * self.stages,
                                                   num_stages=self.stages, producer_group=producer,
                                                   consumer_group=consumer, tx_count=tile_bytes, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        bg = mItems[item, 0]
        blk = mItems[item, 1]
        start = mItems[item, 2]
        n = mItems[item, 3]
        G = mK.shape[2]
        g = bg % G
        b = bg // G
        T = mK.shape[0]
        if warp < 4:  # ---------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                gK = cute.local_tile(mK[None, None, g, b], (BLOCK, D), (None, 0))  # (BLOCK, D, nblocks)
                gV = cute.local_tile(mV[None, None, g, b], (BLOCK, D), (None, 0))
                gQ = cute.local_tile(mQ[None, None, g, b], (MB_ROWS, D), (None, 0))  # (64, D, nmb)
                gdO = cute.local_tile(mdO[None, None, g, b], (MB_ROWS, D), (None, 0))
                gL = cute.local_tile(mL[None, g, b], (MB_ROWS,), (None,))  # (64, nmb)
                gDl = cute.local_tile(mDl[None, g, b], (MB_ROWS,), (None,))
                one = cute.make_layout(1)
                tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
                tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                tdOs, tdOg = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
                tLs, tLg = cpasync.tma_partition(tma_l, 0, one, sL, gL)
                tDs, tDg = cpasync.tma_partition(tma_d, 0, one, sDl, gDl)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                pipe_kv.producer_acquire(kv_state)
                cute.copy(tma_k, tKg[None, blk], tKs[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
                cute.copy(tma_v, tVg[None, blk], tVs[None, 0], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for i in cutlass.range(n, unroll=1):
                    mb = mEnt[start + i] >> MB_BITS
                    pipe_q.producer_acquire(state)
                    bar = pipe_q.producer_get_barrier(state)
                    cute.copy(tma_q, tQg[None, mb], tQs[None, state.index], tma_bar_ptr=bar)
                    cute.copy(tma_l, tLg[None, mb], tLs[None, state.index], tma_bar_ptr=bar)
                    pipe_do.producer_acquire(state)
                    bar = pipe_do.producer_get_barrier(state)
                    cute.copy(tma_do, tdOg[None, mb], tdOs[None, state.index], tma_bar_ptr=bar)
                    cute.copy(tma_d, tDg[None, mb], tDs[None, state.index], tma_bar_ptr=bar)
                    state.advance()
        else:  # ------------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128  # 0 .. 255 over the two consumer warpgroups
            wg = ctid // 128
            tid = ctid % 128
            nmb = (T + MB_QUERIES - 1) // MB_QUERIES
            wg_sdp = tiled_sdp.get_slice(wg * 128)
            wg_dkv = tiled_dkv.get_slice(wg * 128)
            wg_dq = tiled_dq.get_slice(wg * 128)
            thr_sdp = tiled_sdp.get_slice(ctid)
            thr_dkv = tiled_dkv.get_slice(ctid)
            thr_dq = tiled_dq.get_slice(ctid)
            # transposed (MN-major) views: Q^T, dO^T (D, rows, stages) and K^T (D, keys, 1)
            sQt = cute.composition(sQ, cute.make_ordered_layout((D, MB_ROWS, self.stages), order=(1, 0, 2)))
            sdOt = cute.composition(sdO, cute.make_ordered_layout((D, MB_ROWS, self.stages), order=(1, 0, 2)))
            sKt = cute.composition(sK, cute.make_ordered_layout((D, BLOCK, 1), order=(1, 0, 2)))

            tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))  # (MMA, 1, D / 16, 1)
            tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))  # (MMA, 1, D / 16, stages)
            tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
            tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
            acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BLOCK, MB_ROWS)), Float32)
            acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BLOCK, MB_ROWS)), Float32)
            cS = thr_sdp.partition_C(cute.make_identity_tensor((BLOCK, MB_ROWS)))  # (key, row)

            tVrP = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((BLOCK, MB_ROWS)))
            tKrdS = thr_dkv.make_fragment_A(thr_dkv.partition_shape_A((BLOCK, MB_ROWS)))
            tVrP_acc = cute.make_tensor(tVrP.iterator, acc_S.layout)  # P^T in the accumulator's element order
            tKrdS_acc = cute.make_tensor(tKrdS.iterator, acc_dP.layout)
            tVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt))  # (MMA, 1, 64 / 16, stages)
            tKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt))
            acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((BLOCK, D)), Float32)
            acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((BLOCK, D)), Float32)
            cKV = thr_dkv.partition_C(cute.make_identity_tensor((BLOCK, D)))  # (key, d)

            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (MMA, 1, BLOCK / 16, 1)
            tQrK = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((MB_ROWS, D)), Float32)
            cQ = thr_dq.partition_C(cute.make_identity_tensor((MB_ROWS, D)))  # (row, d)

            key_b = cS[0][0]
            row_b = cS[0][1]
            dq_r = cQ[0][0]
            dq_sw = dq_r % 8
            dq_base = wg * DQ_HALF + dq_r * (D // 2) + cQ[0][1] % 8
            acc_dV.fill(0.0)
            acc_dK.fill(0.0)
            tiled_dkv.set(warpgroup.Field.ACCUMULATE, True)
            key0 = blk * BLOCK
            pipe_kv.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))
            for i in cutlass.range(n, unroll=1):
                e = mEnt[start + i]
                mb = e >> MB_BITS
                st = pipeline.PipelineState(self.stages, i, i % self.stages, (i // self.stages) % 2)
                s = st.index
                # ---- S^T = K Q^T, dP^T = V dO^T
                pipe_q.consumer_wait(st)
                warpgroup.fence()
                tiled_sdp.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrK, mode=[2])):
                    cute.gemm(tiled_sdp, acc_S, tSrK[None, None, k, 0], tSrQ[None, None, k, s], acc_S)
                    tiled_sdp.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                pipe_do.consumer_wait(st)
                tiled_sdp.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tPrV, mode=[2])):
                    cute.gemm(tiled_sdp, acc_dP, tPrV[None, None, k, 0], tPrdO[None, None, k, s], acc_dP)
                    tiled_sdp.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                # ---- P^T: the row's query selected the block and key <= query
                warpgroup.wait_group(1)
                # fragment element j = c0 + 2 r + 4 v: key key_b + 8 r, row row_b + 8 v + c0, whose
                # query-in-m-block is v // 2 (row_b % 8 + c0 < 8)
                lim = mb * MB_QUERIES - key0 - key_b
                for v in cutlass.range_constexpr(cute.size(acc_S) // 4):
                    qi = v // 2
                    sel = ((e >> qi) & 1) != 0
                    for c0 in cutlass.range_constexpr(2):
                        lse2 = sL[row_b + 8 * v + c0, s]
                        for r in cutlass.range_constexpr(2):
                            j = c0 + 2 * r + 4 * v
                            ok = sel & (8 * r - qi <= lim)
                            p = cute.math.exp2(acc_S[j] * scale_log2 - lse2, fastmath=True)
                            acc_S[j] = p if ok else Float32(0.0)
                tVrP_acc.store(acc_S.load().to(bf16))
                # ---- dS^T = P^T (dP^T - delta)
                warpgroup.wait_group(0)
                for v in cutlass.range_constexpr(cute.size(acc_dP) // 4):
                    for c0 in cutlass.range_constexpr(2):
                        dl = sDl[row_b + 8 * v + c0, s]
                        for r in cutlass.range_constexpr(2):
                            j = c0 + 2 * r + 4 * v
                            acc_dP[j] = acc_S[j] * (acc_dP[j] - dl)
                tKrdS_acc.store(acc_dP.load().to(bf16))
                # both warpgroups' dQ wgmma of the previous m-block have read sdS (each waited for its
                # groups at the end of that m-block)
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                for j in cutlass.range_constexpr(cute.size(acc_dP)):
                    sdS[row_b + 8 * (j // 4) + j % 2, key_b + 8 * ((j // 2) % 2), 0] = tKrdS_acc[j]
                # ---- dV += P^T dO
                warpgroup.fence()
                for k in cutlass.range_constexpr(cute.size(tVrP, mode=[2])):
                    cute.gemm(tiled_dkv, acc_dV, tVrP[None, None, k], tVrdO[None, None, k, s], acc_dV)
                warpgroup.commit_group()
                cute.arch.fence_proxy("async.shared", space="cta")  # generic stores of dS -> wgmma's reads
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
                # ---- dQ = dS K (this warpgroup's 64 columns)
                tiled_dq.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tQrdS, mode=[2])):
                    cute.gemm(tiled_dq, acc_dQ, tQrdS[None, None, k, 0], tQrK[None, None, k, 0], acc_dQ)
                    tiled_dq.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # dV done: dO free
                pipe_do.consumer_release(st)
                # ---- dK += dS^T Q
                for k in cutlass.range_constexpr(cute.size(tKrdS, mode=[2])):
                    cute.gemm(tiled_dkv, acc_dK, tKrdS[None, None, k], tKrQ[None, None, k, s], acc_dK)
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # dQ done
                # ---- dQ -> shared memory -> bulk reduce into dq_accum
                if tid == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous reduce has read the buffer
                cute.arch.barrier(barrier_id=2 + wg, number_of_threads=128)
                # element j = c0 + 2 r + 4 v: row dq_r + 8 r, column dq_c + 8 v + c0 (dq_c < 8): stored at
                # row * 64 + (column ^ 8 (row % 8)) = dq_base + 512 r + 8 (v ^ (dq_r % 8)) + c0
                for v in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
                    vo = dq_base + 8 * (v ^ dq_sw)
                    for r in cutlass.range_constexpr(2):
                        for c0 in cutlass.range_constexpr(2):
                            sdQ[vo + 512 * r + c0] = acc_dQ[c0 + 2 * r + 4 * v]
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=2 + wg, number_of_threads=128)
                if tid == 0:
                    off = ((Int64(bg) * nmb + mb) * 2 + wg) * DQ_HALF
                    _bulk_reduce_add_f32(sdQ.iterator + wg * DQ_HALF, mDQa.iterator + off, DQ_HALF * 4)
                    cute.arch.cp_async_bulk_commit_group()
                warpgroup.wait_group(0)  # dK done: Q free
                pipe_q.consumer_release(st)
            if tid == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            # ---- dK, dV -> fp32 accumulators (keys < T)
            for j in cutlass.range_constexpr(cute.size(acc_dK)):
                tok = key0 + cKV[j][0]
                if tok < T:
                    off = cute.crd2idx((b, tok, g, cKV[j][1]), mDKa.layout)
                    cute.arch.atomic_add(mDKa.iterator + off, acc_dK[j])
                    cute.arch.atomic_add(mDVa.iterator + off, acc_dV[j])


def compile_check_bwd(dump_dir: str | None = None, arch: str = "sm_90a", stages: int = 2) -> dict:
    """Compile the kernel for `arch` against fake tensors: no GPU or torch needed.  With dump_dir,
    the PTX and cubin go there.  Returns {"seconds", "files": {name: bytes}}."""
    from .kernel import compile_offline, fake_tensor

    bf16 = cutlass.BFloat16
    args = ([fake_tensor(bf16, 4) for _ in range(4)] + [fake_tensor(Float32, 3), fake_tensor(Float32, 3),
            fake_tensor(Float32, 1)] + [fake_tensor(Float32, 4), fake_tensor(Float32, 4), fake_tensor(Int32, 2),
            fake_tensor(Int32, 1)])
    return compile_offline(SparseBwdSm90(stages), args, 0.0884 * LOG2E, dump_dir, arch)
