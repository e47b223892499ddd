"""Fused Triton `index_topk`: scoring, causal mask, per-block max and a running top-k in one pass.

The [B, G, T, T / block_size] block-score tensor is never written: every program keeps its
rows' top-k in registers while it streams over the key blocks.

Work decomposition
------------------
q_idx [B, T, G, Di] is read as a [T * G, Di] matrix per batch (row = token * G + group, which
is its memory order), so one tile of BLOCK_M rows holds BLOCK_M / G tokens with all their
groups, and every group shares the k_idx block the tile loads.  Row i of the tile scores key
block kb as

    M(row, kb) = max_{j in block kb, j <= token(row)} q_idx[token, group] . k_idx[j]

with one tl.dot [BLOCK_M, Di] x [Di, BLOCK_N] (bf16/fp16/fp8 operands, fp32 accumulation) per
sub-tile of BLOCK_N keys (block_size = NSUB * BLOCK_N, the last sub-tile column-masked when
block_size is not a multiple of BLOCK_N).  Blocks entirely before the tile's first token need
no causal mask; the remaining (diagonal) blocks are masked per element.

The grid is 1-D over (tile, batch), heaviest (last) tiles first so the long programs start
early and the short ones fill the tail.  Packed documents (cu_seqlens) use a device-built
table of (document, tile) pairs, sorted by the tile's work, in a single launch and no host
synchronisation.

Running top-k
-------------
Each row keeps `topk` slots (a tuple of [BLOCK_M] vectors in the score tile's row layout, so
no layout conversion and no cross-thread reduction is involved) sorted ascending by
(score, -id): slot 0 is the entry to evict next.  Forced blocks (own block, the
local_blocks - 1 before it, the first init_blocks) score +inf, blocks past the row's own block
-inf.  Blocks arrive in ascending id order; block kb with score x enters a row through a
branch-free shift network (c_s = slot_s < x, true on a prefix of the slots):

    slot_s <- slot_{s+1}  if c_{s+1};   x  if c_s and not c_{s+1};   slot_s  otherwise

so x replaces the minimum only when x > minimum strictly: an equal score never displaces an
earlier (lower) id, and among equal scores the newest (highest id) sits lowest, i.e. is
evicted first.  The kept set is exactly the topk largest (score, -id) keys, the reference's
ranking.  Empty slots hold (-inf, -1), so the row written out as slots topk-1 .. 0 is the
reference's order: forced ids ascending, then by score (ties to the lower id), then -1.
Optionally (SKIP, default on) a tile skips the network when no row's score beats its minimum.

FP8 scoring (score_dtype="fp8")
-------------------------------
q_idx and k_idx are quantized per row to float8_e4m3fn with float32 scales (reference.py,
`quantize_fp8_rows`); the fp8 x fp8 dot runs at twice the bf16 rate on Hopper.  The q scale
is positive per row and cannot change the row's ranking, so it is dropped; the k scale varies
along the row and multiplies each score column before the block max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import interpret_mode
from .reference import quantize_fp8_rows

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))


@triton.jit
def _score_block(
    q, k_base, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok,
    BS: tl.constexpr, DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NSUB: tl.constexpr, HAS_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    USE_KSCALE: tl.constexpr, DOT_F32: tl.constexpr, TF32X3: tl.constexpr,
):
    """Max over key block kb's tokens (j <= tok when CAUSAL) of each row's scores -> [BLOCK_M]."""
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    mb = tl.full([BLOCK_M], NEG_INF, tl.float32)
    for sub in tl.static_range(NSUB):
        n_in = sub * BLOCK_N + rn  # position inside the block
        col = kb * BS + n_in  # key position inside the sequence
        cmask = col < seq_len
        if HAS_PAD:
            cmask = cmask & (n_in < BS)
        kp = k_base + col.to(tl.int64)[:, None] * stride_kt + rd[None, :] * stride_kd
        if DI == BLOCK_D:
            k = tl.load(kp, mask=cmask[:, None], other=0.0)
        else:
            k = tl.load(kp, mask=cmask[:, None] & (rd[None, :] < DI), other=0.0)
        if DOT_F32:  # interpreter only: its bf16 dot multiplies the raw bits
            k = k.to(tl.float32)
        if TF32X3:  # float32 inputs: 3-pass tf32, near-fp32 accuracy on tensor cores
            s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
        else:
            s = tl.dot(q, tl.trans(k))
        if USE_KSCALE:
            ks = tl.load(ks_base + col.to(tl.int64) * stride_kst, mask=cmask, other=1.0)
            s = s * ks[None, :]
        if CAUSAL:
            ok = col[None, :] <= tok[:, None]
            if HAS_PAD:
                ok = ok & (n_in < BS)[None, :]
            s = tl.where(ok, s, NEG_INF)
        elif HAS_PAD:
            s = tl.where(cmask[None, :], s, NEG_INF)
        mb = tl.maximum(mb, tl.max(s, 1))
    return mb


@triton.jit
def _topk_insert(vals, ids, x, kb, K: tl.constexpr):
    """Insert block kb with row scores x into each row's sorted top-K (see the module docstring).

    vals/ids: tuples of K [BLOCK_M] vectors, ascending by (value, -id): slot 0 is the next to be
    evicted.  With c_s = vals[s] < x (true on a prefix), slot s takes vals[s + 1] where c_{s+1}
    (shift down, dropping slot 0), x where c_s and not c_{s+1}, and keeps its entry otherwise;
    x <= vals[0] changes nothing, so an equal score never displaces an earlier (lower) id.
    """
    nv = ()
    ni = ()
    c_s = vals[0] < x
    for s in tl.static_range(K):
        if s + 1 < K:
            c_n = vals[s + 1] < x
            nv = nv + (tl.where(c_n, vals[s + 1], tl.where(c_s, x, vals[s])),)
            ni = ni + (tl.where(c_n, ids[s + 1], tl.where(c_s, kb, ids[s])),)
            c_s = c_n
        else:
            nv = nv + (tl.where(c_s, x, vals[s]),)
            ni = ni + (tl.where(c_s, kb, ids[s]),)
    return nv, ni


@triton.jit
def _topk_step(vals, ids, x, kb, K: tl.constexpr, SKIP: tl.constexpr):
    if SKIP:  # the whole tile skips the network when no row beats its current minimum
        if tl.max((x > vals[0]).to(tl.int32), 0) > 0:
            vals, ids = _topk_insert(vals, ids, x, kb, K)
    else:
        vals, ids = _topk_insert(vals, ids, x, kb, K)
    return vals, ids


@triton.jit
def _index_topk_kernel(
    q_ptr, k_ptr, ks_ptr, out_ptr, tile_ptr, cu_ptr,
    T, B, n_tiles,
    stride_qb, stride_qt, stride_qg, stride_qd,
    stride_kb, stride_kt, stride_kd,
    stride_ksb, stride_kst,
    stride_ob, stride_og, stride_ot, stride_os,
    local_blocks, init_blocks,
    G: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NSUB: tl.constexpr,
    HAS_PAD: tl.constexpr, TOPK: tl.constexpr, SKIP: tl.constexpr, VARLEN: tl.constexpr,
    USE_KSCALE: tl.constexpr, DOT_F32: tl.constexpr, TF32X3: tl.constexpr,
):
    pid = tl.program_id(0)
    if VARLEN:
        # table of (document, tile inside the document), heaviest first; document -1 = padding
        doc = tl.load(tile_ptr + 2 * pid)
        tile = tl.load(tile_ptr + 2 * pid + 1)
        doc_ok = doc >= 0
        doc = tl.maximum(doc, 0)
        seq_start = tl.load(cu_ptr + doc)
        seq_len = tl.load(cu_ptr + doc + 1) - seq_start
        seq_len = tl.where(doc_ok, seq_len, 0)
        b = pid * 0
    else:
        b = pid % B
        tile = n_tiles - 1 - pid // B
        seq_start = pid * 0
        seq_len = T + pid * 0

    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    flat = tile * BLOCK_M + rm  # (token, group) row inside the sequence
    tok = flat // G
    grp = flat % G
    row_ok = tok < seq_len

    b64 = b.to(tl.int64)
    start64 = seq_start.to(tl.int64)
    q_rows = q_ptr + b64 * stride_qb + (start64 + tok.to(tl.int64)) * stride_qt + grp.to(tl.int64) * stride_qg
    qp = q_rows[:, None] + rd[None, :] * stride_qd
    if DI == BLOCK_D:
        q = tl.load(qp, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(qp, mask=row_ok[:, None] & (rd[None, :] < DI), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + b64 * stride_kb + start64 * stride_kt
    ks_base = ks_ptr + b64 * stride_ksb + start64 * stride_kst

    # key blocks: [0, n_full) lie before the tile's first token (no causal mask), then the
    # diagonal blocks up to the last valid token's block
    tok_lo = (tile * BLOCK_M) // G
    tok_hi = tl.maximum(tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, seq_len - 1), 0)
    n_blk = tl.where(seq_len > 0, tok_hi // BS + 1, 0)
    n_full = tl.minimum(tok_lo // BS, n_blk)
    own = tok // BS

    vals = ()
    ids = ()
    for _s in tl.static_range(TOPK):
        vals = vals + (tl.full([BLOCK_M], NEG_INF, tl.float32),)
        ids = ids + (tl.full([BLOCK_M], -1, tl.int32),)

    for kb in range(0, n_full):
        mb = _score_block(q, k_base, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok,
                          BS, DI, BLOCK_M, BLOCK_N, BLOCK_D, NSUB, HAS_PAD, False, USE_KSCALE, DOT_F32, TF32X3)
        forced = ((kb <= own) & (kb > own - local_blocks)) | ((kb < init_blocks) & (kb <= own))
        vals, ids = _topk_step(vals, ids, tl.where(forced, POS_INF, mb), kb, TOPK, SKIP)
    for kb in range(n_full, n_blk):
        mb = _score_block(q, k_base, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok,
                          BS, DI, BLOCK_M, BLOCK_N, BLOCK_D, NSUB, HAS_PAD, True, USE_KSCALE, DOT_F32, TF32X3)
        forced = ((kb <= own) & (kb > own - local_blocks)) | ((kb < init_blocks) & (kb <= own))
        vals, ids = _topk_step(vals, ids, tl.where(forced, POS_INF, mb), kb, TOPK, SKIP)

    # slots ascend by (score, -id); the reference lists them descending (forced ids ascending,
    # then by score, ties to the lower id), then -1 for the empty slots, which hold id -1
    o_rows = out_ptr + b64 * stride_ob + grp.to(tl.int64) * stride_og + (start64 + tok.to(tl.int64)) * stride_ot
    for s in tl.static_range(TOPK):
        tl.store(o_rows + (TOPK - 1 - s) * stride_os, ids[s], mask=row_ok)


# ----------------------------------------------------------------------------- host side

def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block_n_for(block_size: int, cap: int = 128) -> int:
    """Keys per dot: the largest power of two in [16, cap] dividing block_size, else the padded block."""
    bn = cap
    while bn >= 16:
        if block_size % bn == 0:
            return bn
        bn //= 2
    return min(cap, max(16, _next_pow2(block_size)))


# GPU configurations (H100/H200, sm_90), keyed by the scoring dtype class and head dim.
# BLOCK_M rows = BLOCK_M / G tokens with all their groups; 128 x 128 fp32 scores over 8 warps.
GPU_CONFIGS = {
    ("16bit", 128): dict(BLOCK_M=128, num_warps=8, num_stages=3),
    ("16bit", 256): dict(BLOCK_M=128, num_warps=8, num_stages=2),
    ("fp8", 128): dict(BLOCK_M=128, num_warps=8, num_stages=4),
    ("fp8", 256): dict(BLOCK_M=128, num_warps=8, num_stages=3),
    # float32 inputs: 3-pass tf32 (near-fp32 accuracy); 64-key tiles to fit shared memory
    ("fp32", 128): dict(BLOCK_M=64, BLOCK_N_MAX=64, num_warps=4, num_stages=2),
    ("fp32", 256): dict(BLOCK_M=64, BLOCK_N_MAX=32, num_warps=4, num_stages=2),
}
INTERPRET_CONFIG = dict(BLOCK_M=64, num_warps=4, num_stages=1)


def default_config(kind: str, head_dim: int) -> dict:
    if interpret_mode():
        return dict(INTERPRET_CONFIG)
    return dict(GPU_CONFIGS[(kind, 128 if head_dim <= 128 else 256)])


def build_varlen_tiles(cu_seqlens: torch.Tensor, total: int, G: int, block_m: int) -> torch.Tensor:
    """Device-side (document, tile) table, int32 [max_tiles, 2], heaviest tiles first.

    Document d has ceil(len_d * G / block_m) tiles; the table length is the bound
    ceil(total * G / block_m) + ndocs (no host sync), padded with document -1.
    """
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    ndocs = cu.numel() - 1
    lens = (cu[1:] - cu[:-1]).clamp(min=0)
    nt = (lens * G + block_m - 1) // block_m
    cum = torch.cumsum(nt, 0)
    max_tiles = (total * G + block_m - 1) // block_m + ndocs
    t = torch.arange(max_tiles, device=dev)
    doc = torch.searchsorted(cum, t, right=True)
    valid = doc < ndocs
    docc = doc.clamp(max=ndocs - 1)
    local = t - (cum[docc] - nt[docc])
    last_row = torch.minimum((local + 1) * block_m, lens[docc] * G) - 1
    work = torch.where(valid, last_row // G + 1, torch.full_like(last_row, -1))
    order = torch.sort(work, descending=True, stable=True).indices
    table = torch.stack(
        [torch.where(valid, docc, torch.full_like(docc, -1))[order], torch.where(valid, local, 0)[order]], dim=1
    )
    return table.to(torch.int32).contiguous()


def index_topk_triton(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int = 128,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    score_dtype: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Kernel entry (arguments already checked by `index_topk`).  Returns int32 [B, G, T, topk]."""
    if score_dtype == "fp8":
        q8, _ = quantize_fp8_rows(q_idx)
        k8, ks = quantize_fp8_rows(k_idx)
        return launch(q8, k8, ks, block_size=block_size, topk=topk, local_blocks=local_blocks,
                      init_blocks=init_blocks, cu_seqlens=cu_seqlens, config=config)
    if q_idx.dtype == torch.float64:  # the kernel scores in float32
        q_idx, k_idx = q_idx.float(), k_idx.float()
    return launch(q_idx, k_idx, None, block_size=block_size, topk=topk, local_blocks=local_blocks,
                  init_blocks=init_blocks, cu_seqlens=cu_seqlens, config=config)


def _prepare(q, k, k_scale, *, block_size, topk, local_blocks, init_blocks, cu_seqlens=None, config=None):
    """Everything one launch needs: (out, grid, runtime args, constexprs, launch options)."""
    B, T, G, Di = q.shape
    dev = q.device
    fp8 = q.dtype == torch.float8_e4m3fn
    kind = "fp8" if fp8 else ("fp32" if q.dtype == torch.float32 else "16bit")
    cfg = default_config(kind, Di)
    if config:
        cfg.update(config)
    block_m = int(cfg["BLOCK_M"])
    block_m = max(16, min(block_m, _next_pow2(T * G)))  # tiny sequences: smaller tiles
    # topk > 16 slots need the registers of a 128-wide score tile: use 64-key sub-tiles
    block_n = block_n_for(block_size, int(cfg.get("BLOCK_N_MAX", 128 if topk <= 16 else 64)))
    nsub = (block_size + block_n - 1) // block_n
    block_d = max(16, _next_pow2(Di))
    num_stages = int(cfg["num_stages"])
    if not interpret_mode():  # keep q + the pipelined key tiles within Hopper's 227 KiB
        esize = q.element_size()
        while num_stages > 1 and (block_m + num_stages * nsub * block_n) * block_d * esize > 200 * 1024:
            num_stages -= 1
    if T * G >= 2**31 - block_m:
        raise ValueError(f"index_topk: T * G = {T * G} rows exceed the kernel's int32 row index")

    if fp8:
        ks = k_scale.float()
        stride_ksb, stride_kst = ks.stride(0), ks.stride(1)
    else:
        ks = k  # unused
        stride_ksb, stride_kst = 0, 0
    if cu_seqlens is None:
        out = torch.empty((B, G, T, topk), dtype=torch.int32, device=dev)
        n_tiles = (T * G + block_m - 1) // block_m
        grid = (B * n_tiles,)
        tiles = cu = out  # unused
    else:
        out = torch.full((B, G, T, topk), -1, dtype=torch.int32, device=dev)
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
        tiles = build_varlen_tiles(cu, T, G, block_m)
        n_tiles = tiles.shape[0]
        grid = (n_tiles,)
    args = [
        q, k, ks, out, tiles, cu,
        T, B, n_tiles,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2),
        stride_ksb, stride_kst,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        local_blocks, init_blocks,
    ]
    constexprs = dict(
        G=G, DI=Di, BS=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NSUB=nsub,
        HAS_PAD=nsub * block_n != block_size, TOPK=topk, SKIP=bool(cfg.get("SKIP", True)),
        VARLEN=cu_seqlens is not None, USE_KSCALE=fp8,
        DOT_F32=interpret_mode() and q.dtype == torch.bfloat16,
        TF32X3=q.dtype == torch.float32,
    )
    options = dict(num_warps=int(cfg["num_warps"]), num_stages=num_stages)
    return out, grid, args, constexprs, options


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int,
    cu_seqlens: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q [B, T, G, Di], k [B, T, Di] (bf16/fp16/fp32, or float8_e4m3fn with k_scale [B, T])."""
    out, grid, args, constexprs, options = _prepare(
        q, k, k_scale, block_size=block_size, topk=topk, local_blocks=local_blocks,
        init_blocks=init_blocks, cu_seqlens=cu_seqlens, config=config,
    )
    if grid[0] > 0:
        _index_topk_kernel[grid](*args, **constexprs, **options)
    return out


# ----------------------------------------------------------------------------- ahead-of-time check

_TRITON_DTYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32",
}


def compile_for(q, k, k_scale=None, *, capability: int = 90, **kw):
    """Compile (not run) the kernel a `launch` with these arguments would use, for a CUDA target.

    Needs no GPU (the triton wheel ships ptxas) and TRITON_INTERPRET unset.  Tensors may live on
    the CPU; integer arguments are specialised like the launcher does (== 1 -> constant,
    multiple of 16 -> divisibility hint; pointers are assumed 16-byte aligned).  Returns the
    triton CompiledKernel (asm["ttgir"], asm["ptx"], asm["cubin"], metadata.shared).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpret_mode():
        raise RuntimeError("compile_for needs TRITON_INTERPRET unset (the kernel is interpreted otherwise)")
    _, _, args, constexprs, options = _prepare(q, k, k_scale, **kw)
    names = _index_topk_kernel.arg_names
    sig, consts, attrs = {}, {}, {}
    for name, val in zip(names, args):
        i = names.index(name)
        if isinstance(val, torch.Tensor):
            sig[name] = "*" + _TRITON_DTYPES[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif val == 1:
            sig[name] = "constexpr"
            consts[(i,)] = 1
        else:
            sig[name] = "i32" if abs(val) < 2**31 else "i64"
            if val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name, val in constexprs.items():
        sig[name] = "constexpr"
        consts[(names.index(name),)] = val
    src = ASTSource(fn=_index_topk_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def resource_usage(compiled) -> dict:
    """Registers, spill stack and shared memory of a compiled kernel (cuobjdump from the wheel)."""
    import os
    import re
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return {
        "regs": int(reg.group(1)) if reg else -1,
        "stack": int(stack.group(1)) if stack else -1,
        "shared": int(compiled.metadata.shared),
        "local_loads": sass.count("LDL"),
        "gmma": sass.count("HGMMA") + sass.count("QGMMA"),
        "async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local"),
    }


def compile_report(T: int = 4096, G: int = 4, Di: int = 128, block_size: int = 128, topk: int = 16,
                   configs: dict | None = None) -> list[dict]:
    """sm_90 resource usage of the M3-shape kernels (bf16, fp8, varlen bf16), without a GPU."""
    q = torch.empty((1, T, G, Di), dtype=torch.bfloat16)
    k = torch.empty((1, T, Di), dtype=torch.bfloat16)
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    ks = torch.empty((1, T), dtype=torch.float32)
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    kw = dict(block_size=block_size, topk=topk, local_blocks=1, init_blocks=0)
    variants = [
        ("bf16", (q, k, None), {}),
        ("fp8", (q8, k8, ks), {}),
        ("bf16_varlen", (q, k, None), {"cu_seqlens": cu}),
    ]
    rows = []
    for name, (a, b, c), extra in variants:
        for cfg in (configs or {}).get(name, [None]):
            ck = compile_for(a, b, c, config=cfg, **kw, **extra)
            rows.append({"variant": name, "config": cfg, **resource_usage(ck)})
    return rows
