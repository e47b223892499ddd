"""The fused Triton index_topk kernel against the reference (CPU: run with TRITON_INTERPRET=1).

Inputs are integer-valued (exact in bf16/fp16/fp32, every dot product exact in fp32), so the
kernel must equal the reference exactly, ties (frequent with small integers) included: they go
to the lower block id on both sides.  Rows are compared as sets (the contract), and the kernel's
order (forced ascending, then by score, then -1) is checked to equal the reference's too.

Interpreter notes: Triton 3.6's interpreter multiplies the raw uint16 bits in a bf16 tl.dot, so
under TRITON_INTERPRET the kernel upcasts bf16 operands to fp32 before the dot (exact); fp8 dots
are interpreted correctly (through fp16), so the FP8 path runs here too.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from msakit.ops.dispatch import interpret_mode
from msakit.ops.index_topk import Selection, index_topk, index_topk_reference
from tools.bench.index_topk import agreement_rate, as_sets, rows_reference, sample_rows
from msakit.ops.fp8 import quantize_fp8_reference as quantize_fp8_rows
from msakit.ops.index_topk.reference import fp8_scoring_inputs

CAN_RUN_KERNEL = interpret_mode() or torch.cuda.is_available()
needs_kernel = pytest.mark.skipif(not CAN_RUN_KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if (torch.cuda.is_available() and not interpret_mode()) else "cpu"
# the interpreter converts its 1-element loop bounds with a numpy deprecation warning
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


SELECTION_DEFAULTS = dict(local_blocks=1, init_blocks=0)  # index_topk's defaults of the two forced counts


def int_inputs(B, T, G, Di, dtype=torch.bfloat16, lo=-4, hi=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi + 1, (B, T, G, Di), generator=gen).to(dtype)
    k = torch.randint(lo, hi + 1, (B, T, Di), generator=gen).to(dtype)
    return q.to(DEV), k.to(DEV)


def assert_same_sets(got, ref):
    assert got.shape == ref.shape and got.dtype == torch.int32
    ga, ra = as_sets(got), as_sets(ref)
    bad = (ga != ra).any(dim=-1)
    assert not bad.any(), f"{int(bad.sum())} rows differ, first at {bad.nonzero()[0].tolist()}"


CASES = {
    # name: (B, T, G, Di, block_size, topk, local_blocks, init_blocks, dtype)
    "partial_last_block": (1, 200, 2, 32, 32, 4, 1, 0, torch.bfloat16),
    "T_below_block": (1, 20, 2, 16, 32, 4, 1, 0, torch.bfloat16),
    "T_1": (1, 1, 2, 16, 16, 4, 1, 0, torch.bfloat16),
    "fewer_blocks_than_topk": (1, 70, 2, 16, 32, 8, 1, 0, torch.bfloat16),
    "groups_3_batch_2": (2, 150, 3, 16, 16, 5, 1, 0, torch.bfloat16),
    "local2_init1": (1, 260, 2, 32, 16, 6, 2, 1, torch.bfloat16),
    # Qwen2.5's index shapes with a forced first block: 2 slots per lane and the init loop (the
    # shape whose quad shuffle once hung on the GPU)
    "top8_init1_Di64": (1, 512, 2, 64, 64, 8, 1, 1, torch.bfloat16),
    "block_not_mult16_Di24": (1, 130, 1, 24, 20, 3, 1, 1, torch.bfloat16),
    "block_160_subtiles": (1, 400, 1, 16, 160, 2, 1, 0, torch.bfloat16),
    "block_48_topk1": (1, 150, 2, 16, 48, 1, 1, 0, torch.bfloat16),
    "fp16": (1, 150, 2, 32, 16, 4, 1, 0, torch.float16),
    "fp32": (2, 100, 2, 16, 16, 4, 1, 1, torch.float32),
}


# Kernel variants (config overrides): the default takes the GPU default's branches (TMA key
# loads for 16-bit inputs, cp.async for fp32); "no_tma" the other key-load path (the GPU's
# fallback where k_idx is not 16-byte aligned, and the fp32 default).
VARIANTS = {
    "default": None,
    "no_tma": dict(TMA=False),
}
# the cases the non-default variants also run (batch > 1, forced init/local blocks, padded
# blocks and head dims, sub-tiles, fewer blocks than topk, a single token)
VARIANT_CASES = ["groups_3_batch_2", "local2_init1", "block_not_mult16_Di24", "block_160_subtiles",
                 "fewer_blocks_than_topk", "partial_last_block", "T_1"]


def run_kernel(q, k, config=None, **kw):
    if config is None:
        return index_topk(q, k, backend="triton", **kw)
    from msakit.ops.index_topk.triton import index_topk_triton

    rest = {name: kw.pop(name) for name in ("cu_seqlens", "score_dtype") if name in kw}
    return index_topk_triton(q, k, Selection(**{**SELECTION_DEFAULTS, **kw}), config=config, **rest)


@needs_kernel
@pytest.mark.parametrize(
    "name,variant",
    [(n, "default") for n in CASES] + [(n, v) for v in VARIANTS if v != "default" for n in VARIANT_CASES],
)
def test_kernel_matches_reference(name, variant):
    B, T, G, Di, bs, topk, loc, ini, dtype = CASES[name]
    q, k = int_inputs(B, T, G, Di, dtype)
    kw = dict(block_size=bs, topk=topk, local_blocks=loc, init_blocks=ini)
    got = run_kernel(q, k, VARIANTS[variant], **kw)
    ref = index_topk_reference(q, k, **kw)
    assert_same_sets(got, ref)
    assert torch.equal(got, ref)  # exact inputs: the order matches the reference's too
    if name == "groups_3_batch_2":  # the groups really select differently
        assert not torch.equal(got[:, 0], got[:, 1]) and not torch.equal(got[:, 1], got[:, 2])


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_many_blocks_ties_and_topk_padding(variant):
    # many key blocks per row (the unmasked loop dominates), heavy ties (values in [-1, 1]), and
    # topk values that are / are not multiples of the 4 lanes (padded slots)
    q, k = int_inputs(1, 330, 2, 16, lo=-1, hi=1, seed=11)
    for topk in (7, 12):
        kw = dict(block_size=16, topk=topk, local_blocks=1, init_blocks=0)
        assert torch.equal(run_kernel(q, k, VARIANTS[variant], **kw), index_topk_reference(q, k, **kw))


@needs_kernel
def test_kernel_random_floats_agree():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((1, 256, 2, 32), generator=gen).to(torch.bfloat16).to(DEV)
    k = torch.randn((1, 256, 32), generator=gen).to(torch.bfloat16).to(DEV)
    got = index_topk(q, k, block_size=16, topk=5, backend="triton")
    ref = index_topk_reference(q, k, block_size=16, topk=5)
    assert agreement_rate(got, ref)["agree"] >= 0.99


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_varlen_three_documents(variant):
    lens = [70, 10, 150]  # the middle document is shorter than a block
    cu = torch.tensor([0, 70, 80, 230], dtype=torch.int32, device=DEV)
    q, k = int_inputs(1, sum(lens), 2, 32, seed=3)
    kw = dict(block_size=32, topk=3, local_blocks=2, init_blocks=1)
    got = run_kernel(q, k, VARIANTS[variant], cu_seqlens=cu, **kw)
    ref = index_topk_reference(q, k, cu_seqlens=cu, **kw)
    assert_same_sets(got, ref)
    # the varlen reference is the per-document reference, ids relative to each document
    for s, e in [(0, 70), (70, 80), (80, 230)]:
        assert torch.equal(ref[:, :, s:e], index_topk_reference(q[:, s:e], k[:, s:e], **kw))
    assert int(got[:, :, 70:80].max()) == 0  # the short document has only its block 0
    assert torch.equal(index_topk(q, k, cu_seqlens=cu, backend="reference", **kw), ref)


@needs_kernel
def test_kernel_varlen_empty_document_and_batch_equivalence():
    cu = torch.tensor([0, 0, 33, 33, 97], dtype=torch.int32, device=DEV)
    q, k = int_inputs(1, 97, 3, 16, seed=4)
    kw = dict(block_size=16, topk=4)
    got = index_topk(q, k, cu_seqlens=cu, backend="triton", **kw)
    assert_same_sets(got, index_topk_reference(q, k, cu_seqlens=cu, **kw))
    # a single document spanning everything is the plain op
    cu1 = torch.tensor([0, 97], dtype=torch.int32, device=DEV)
    assert torch.equal(index_topk(q, k, cu_seqlens=cu1, backend="triton", **kw), index_topk_reference(q, k, **kw))


def test_varlen_tile_table_covers_each_tile_once():
    from msakit.ops.index_topk.triton import build_varlen_tiles

    lens = [5, 0, 40, 17, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    G, bm = 3, 16
    tab = build_varlen_tiles(cu, sum(lens), G, bm)
    assert tab.shape[0] == (sum(lens) * G + bm - 1) // bm + len(lens)
    real = [(int(d), int(t)) for d, t in tab.tolist() if d >= 0]
    want = [(d, t) for d, n in enumerate(lens) for t in range((n * G + bm - 1) // bm)]
    assert sorted(real) == sorted(want)
    # heaviest first: the tile's last token (its key count) never increases along the table
    work = [min((t + 1) * bm, lens[d] * G) // G for d, t in real]
    assert work == sorted(work, reverse=True)
    assert all(d < 0 for d, _ in tab.tolist()[len(real):])


@needs_kernel
def test_quantize_fp8_kernel_matches_reference():
    from msakit.ops.fp8 import quantize_fp8

    gen = torch.Generator().manual_seed(9)
    for shape in [(3, 37, 2, 24), (1, 5, 128)]:
        x = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 10).to(torch.bfloat16)
        x.view(-1, shape[-1])[1] = 0.0  # an all-zero row
        a, sa = quantize_fp8_rows(x)
        b, sb = quantize_fp8(x.to(DEV), backend="triton")
        assert b.dtype == torch.float8_e4m3fn and b.shape == x.shape and sb.shape == x.shape[:-1]
        assert torch.equal(sa, sb.cpu()) and torch.equal(a.float(), b.cpu().float())


def test_quantize_fp8_rows():
    x = torch.randn(5, 7, 32)
    x[0, 0] = 0.0
    xq, s = quantize_fp8_rows(x)
    assert xq.dtype == torch.float8_e4m3fn and s.shape == (5, 7)
    assert float(xq.float().abs().amax()) <= 448.0
    assert torch.all(xq[0, 0].float() == 0)
    err = (xq.float() * s.unsqueeze(-1) - x).abs() / x.abs().amax(-1, keepdim=True).clamp(min=1e-6)
    assert float(err.max()) <= 2**-4 + 1e-6  # e4m3: 3 mantissa bits


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_fp8_exact_inputs_equal_reference(variant):
    # integer rows in [-7, 7] with a +-7 in each row: scale 7/448 = 1/64, codes exact, so the fp8
    # scores are the exact scores (times 64^2) and the fp8 selection is the reference's
    q, k = int_inputs(2, 160, 2, 32, torch.float32, -7, 7, seed=5)
    q[..., 0], k[..., 0] = 7.0, -7.0
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    kw = dict(block_size=16, topk=5, local_blocks=2, init_blocks=1)
    got = run_kernel(q, k, VARIANTS[variant], score_dtype="fp8", **kw)
    ref = index_topk_reference(q, k, **kw)
    assert torch.equal(got, ref)


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_fp8_random_matches_fp8_reference(variant):
    gen = torch.Generator().manual_seed(6)
    q = torch.randn((1, 200, 2, 32), generator=gen).to(torch.bfloat16).to(DEV)
    k = (torch.randn((1, 200, 32), generator=gen) * torch.rand((1, 200, 1), generator=gen) * 3).to(torch.bfloat16).to(DEV)
    kw = dict(block_size=16, topk=4)
    if variant == "default":
        got = index_topk(q, k, score_dtype="fp8", backend="triton", **kw)
    else:
        from msakit.ops.index_topk.triton import index_topk_triton

        got = index_topk_triton(q, k, Selection(**{**SELECTION_DEFAULTS, **kw}), score_dtype="fp8",
                                config=VARIANTS[variant])
    ref = index_topk(q, k, score_dtype="fp8", backend="reference", **kw)
    qf, kf = fp8_scoring_inputs(q, k)
    assert torch.equal(ref, index_topk_reference(qf, kf, **kw))
    assert agreement_rate(got, ref)["agree"] >= 0.99
    cu = torch.tensor([0, 50, 200], dtype=torch.int32, device=DEV)
    got_v = run_kernel(q, k, VARIANTS[variant], score_dtype="fp8", cu_seqlens=cu, **kw)
    ref_v = index_topk(q, k, score_dtype="fp8", cu_seqlens=cu, backend="reference", **kw)
    assert agreement_rate(got_v, ref_v)["agree"] >= 0.99


def test_reference_and_auto_backends_on_cpu(monkeypatch):
    # (msakit.ops.index_topk as an attribute is the function, so import the module by name)
    tk = importlib.import_module("msakit.ops.index_topk.triton")

    def boom(*a, **k):
        raise AssertionError("the Triton path must not run")

    monkeypatch.setattr(tk, "index_topk_triton", boom)
    q, k = int_inputs(1, 50, 2, 16)
    q, k = q.cpu(), k.cpu()
    ref = index_topk_reference(q, k, block_size=16, topk=3)
    assert torch.equal(index_topk(q, k, block_size=16, topk=3, backend="reference"), ref)
    assert torch.equal(index_topk(q, k, block_size=16, topk=3, backend="auto"), ref)


def test_bad_arguments_raise():
    q, k = int_inputs(1, 40, 2, 16)
    with pytest.raises(ValueError, match="backend"):
        index_topk(q, k, backend="cuda")
    with pytest.raises(ValueError, match="score_dtype"):
        index_topk(q, k, score_dtype="int8")
    with pytest.raises(ValueError, match="cu_seqlens"):
        index_topk(q, k, cu_seqlens=torch.tensor([0, 10, 30], dtype=torch.int32, device=DEV).cpu())
    with pytest.raises(ValueError, match="cu_seqlens"):
        index_topk(q, k, cu_seqlens=torch.tensor([0, 40], dtype=torch.float32))
    q2, k2 = int_inputs(2, 40, 2, 16)
    with pytest.raises(ValueError, match="packed"):
        index_topk(q2.cpu(), k2.cpu(), cu_seqlens=torch.tensor([0, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match="topk"):
        index_topk(q, k, topk=2, local_blocks=2, init_blocks=1)


def test_custom_op_compiles_and_has_no_gradient():
    assert hasattr(torch.ops.msakit, "index_topk")
    q, k = int_inputs(1, 64, 2, 16)
    q, k = q.cpu().float().requires_grad_(), k.cpu().float()

    def f(q, k):
        return index_topk(q, k, block_size=16, topk=3, backend="reference")

    ref = index_topk_reference(q.detach(), k, block_size=16, topk=3)
    out = f(q, k)
    assert torch.equal(out, ref) and not out.requires_grad
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k), ref)
    torch.library.opcheck(
        torch.ops.msakit.index_topk.default,
        (q.detach(), k, None, 16, 3, 1, 0, "", "reference"),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_rows_reference_matches_full_reference():
    gen = torch.Generator().manual_seed(7)
    B, T, G = 2, 300, 3
    q = torch.randn((B, T, G, 16), generator=gen)
    k = torch.randn((B, T, 16), generator=gen)
    kw = dict(block_size=32, topk=5, local_blocks=2, init_blocks=1)
    full = index_topk_reference(q, k, **kw)
    b, g, i = sample_rows(B, G, T, 64, gen)
    sel, M = rows_reference(q, k, b, g, i, **kw)
    assert torch.equal(sel, full[b, g, i])
    assert M.shape == (64, (T + 31) // 32)
    res = agreement_rate(full[b, g, i].flip(-1), sel, M)  # order is ignored
    assert res["agree"] == 1.0 and res["agree_tol"] == 1.0 and res["recall"] == 1.0
    other = sel.clone()
    other[0, -1] = -1 if other[0, -1] >= 0 else 0
    assert agreement_rate(other, sel, M)["agree"] < 1.0


def test_bench_imports_without_gpu():
    from tools.bench import index_topk as bench

    assert callable(bench.check_and_bench)
    assert os.environ.get("TRITON_INTERPRET", "0") in ("0", "1")


def test_shfl_layout_check():
    """`shfl_layouts_ok` accepts exactly the [M, 4] layouts whose axis 1 is lane bits 0, 1."""
    from msakit.ops.index_topk.triton import shfl_layouts_ok

    asm = ('  %%b = tt.elementwise_inline_asm "shfl.sync.down.b32 $0, $1, 1, 0x1c1f, 0xffffffff;" '
           '{constraints = "=r,r", packed_element = 1 : i32, pure = true} %%a : tensor<128x4xi32, %s> '
           '-> tensor<128x4xi32, %s> loc(#loc1)\n')
    blocked = ("#blocked3 = #ttg.blocked<{sizePerThread = [%s], threadsPerWarp = [%s], warpsPerCTA = [8, 1], "
               "order = [%s]}>\n")
    for spt, tpw, order, ok in [("1, 1", "8, 4", "1, 0", True), ("1, 1", "4, 8", "1, 0", True),
                                ("1, 1", "8, 4", "0, 1", False), ("1, 1", "16, 2", "1, 0", False),
                                ("1, 2", "16, 2", "1, 0", False), ("2, 1", "8, 4", "1, 0", True)]:
        assert shfl_layouts_ok(blocked % (spt, tpw, order) + asm % ("#blocked3", "#blocked3")) == ok, (spt, tpw, order)
    linear = ("#linear = #ttg.linear<{register = [[0, 0, 0, 1], [8, 0, 0, 0], [0, 1, 0, 0]], lane = [%s, [1, 0, 0, 0], "
              "[2, 0, 0, 0], [4, 0, 0, 0]], warp = [[16, 0, 0, 0]], block = []}>\n")
    sl = "#ttg.slice<{dim = 1, parent = #ttg.slice<{dim = 3, parent = #linear}>}>"
    assert shfl_layouts_ok(linear % "[0, 0, 1, 0], [0, 0, 2, 0]" + asm % (sl, sl))
    assert not shfl_layouts_ok(linear % "[0, 0, 2, 0], [0, 0, 1, 0]" + asm % (sl, sl))
    assert not shfl_layouts_ok(asm % ("#mma", "#mma"))  # unknown encodings fail closed
    assert shfl_layouts_ok("no shuffles here")


def test_kernel_compiles_for_sm90_without_spills():
    """Compile (no launch) the M3-shape kernels for sm_90 with the wheel's ptxas, in a process
    without TRITON_INTERPRET: catches what only the real compiler rejects (non-constexpr
    globals, unsupported ops), register spills, lost occupancy and shuffle layouts the
    lane-split top-k does not expect, on a machine without a GPU.  Covers the defaults, every
    tools.bench.index_topk.CANDIDATE_CONFIGS entry (bf16) and the small tiles of tiny sequences."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("the triton wheel has no ptxas")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    code = (
        "import json; from tools.bench.index_topk import compile_report; "
        "from tools.bench.index_topk import CANDIDATE_CONFIGS as C; "
        "print(json.dumps([compile_report() + compile_report(configs={'bf16': C, 'fp8': [], 'bf16_varlen': []}), "
        "compile_report(T=3, configs={'bf16': [None], 'fp8': [], 'bf16_varlen': []}) "
        "+ compile_report(T=8, G=1, configs={'bf16': [None], 'fp8': [None], 'bf16_varlen': []})]))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows, tiny = json.loads(res.stdout.strip().splitlines()[-1])
    assert {r["variant"] for r in rows} == {"bf16", "fp8", "bf16_varlen"}
    for r in tiny:  # tiny sequences (16- and 32-row tiles): other layouts, same shuffle contract
        assert r["shfl_layout_ok"] and r["stack"] == 0, r
    for r in rows:
        assert r["gmma"] > 0, r  # Hopper wgmma (HGMMA / QGMMA for fp8)
        assert r["async_copies"] + r["tma_copies"] > 0, r  # key tiles are software-pipelined
        assert r["shared"] <= 227 * 1024 and r["ctas_per_sm"] >= 1, r
        assert r["shfl_layout_ok"], r  # the quad shuffles read the right lanes
        cfg = r["config"] or {}
        if cfg.get("num_warps") == 4 and cfg.get("BLOCK_M") == 128 and not cfg.get("TMA"):
            assert r["stack"] <= 16, r  # 128 rows x 4 warps with cp.async addresses: a word or two
        else:
            assert r["stack"] == 0 and r["local_loads"] == 0, r  # no register spills
        if r["config"] is None and r["variant"] != "bf16_varlen":
            assert r["ctas_per_sm"] == 2, r  # the defaults overlap two CTAs per SM


def _nan_case():
    """Positive integer queries, integer keys; block 1's keys all NaN, token 40's key NaN, and
    (token 50, group 0)'s index query NaN.  Returns (q, k, the same with every NaN key replaced
    by a key that scores below every real one (-100s), the NaN block, the NaN query row)."""
    q, k = (t.cpu() for t in int_inputs(1, 64, 2, 16, torch.float32, 1, 4, seed=3))  # references on the CPU
    k = k - 2.0  # keys in [-1, 2]: scores of real keys >= -16 * 4
    bs, nan_block, nan_row = 16, 1, (50, 0)
    k_low = k.clone()
    k[0, nan_block * bs:(nan_block + 1) * bs] = float("nan")
    k[0, 40] = float("nan")
    k_low[0, nan_block * bs:(nan_block + 1) * bs] = -100.0
    k_low[0, 40] = -100.0
    q[0, nan_row[0], nan_row[1]] = float("nan")
    return q, k, k_low, bs, nan_block, nan_row


def _nan_expected(q, k_low, bs, nan_block, nan_row, **kw):
    """Row sets of the NaN case: the low-key reference's, less the NaN block where it is not
    forced; the NaN query row keeps its forced blocks only."""
    q_ok = q.nan_to_num(1.0)
    ref = index_topk_reference(q_ok, k_low, block_size=bs, **kw)
    want = []
    for g in range(q.shape[2]):
        for i in range(q.shape[1]):
            own = i // bs
            forced = {b for b in range(own - kw.get("local_blocks", 1) + 1, own + 1) if b >= 0}
            forced |= {b for b in range(kw.get("init_blocks", 0)) if b <= own}
            row = {int(x) for x in ref[0, g, i] if x >= 0}
            if (i, g) == nan_row:
                row = forced
            elif nan_block not in forced:
                row.discard(nan_block)
            want.append(((g, i), row))
    return want


def _rows_as_sets(sel):
    return {(g, i): {int(x) for x in sel[0, g, i] if x >= 0} for g in range(sel.shape[1]) for i in range(sel.shape[2])}


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's nanmax
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_nan_scores_are_never_selected(backend):
    """NaN in k_idx / q_idx never wins a slot (NaN scores count as -inf): an all-NaN block is left
    out unless forced, a NaN key token does not raise its block's score, a NaN query row keeps its
    forced blocks only; the kernel equals the reference exactly; check_finite raises instead."""
    q, k, k_low, bs, nan_block, nan_row = _nan_case()
    kw = dict(topk=3, local_blocks=1, init_blocks=1)
    got = index_topk(q.to(DEV), k.to(DEV), block_size=bs, backend=backend, **kw).cpu()
    sets = _rows_as_sets(got)
    for key, want in _nan_expected(q, k_low, bs, nan_block, nan_row, **kw):
        assert sets[key] == want, (key, sets[key], want)
    assert torch.equal(got, index_topk_reference(q, k, block_size=bs, **kw))
    with pytest.raises(ValueError, match="k_idx holds NaN"):
        index_topk(q.nan_to_num(0.0).to(DEV), k.to(DEV), block_size=bs, backend=backend, check_finite=True, **kw)
    with pytest.raises(ValueError, match="q_idx holds NaN"):
        index_topk(q.to(DEV), k.to(DEV), block_size=bs, backend=backend, check_finite=True, **kw)


@needs_kernel
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_nan_fp8_scoring_kernel_equals_reference():
    """fp8 scoring: a NaN in a k_idx row makes that token's scale and scores NaN (never selected)
    in the quantization kernel as in the reference; the selections are equal."""
    from msakit.ops.fp8 import quantize_fp8

    q, k = (t.cpu() for t in int_inputs(1, 96, 2, 32, torch.float32, -7, 7, seed=8))  # references on the CPU
    q[..., 0], k[..., 0] = 7.0, -7.0  # exact scales: the fp8 scores are exact
    k[0, 20, 5] = float("nan")  # one element: the whole token is out
    k[0, 32:48] = float("nan")  # block 2 (block_size 16) entirely
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    a, sa = quantize_fp8_rows(k)
    b, sb = quantize_fp8(k.to(DEV), backend="triton")
    assert torch.equal(torch.isnan(sa), torch.isnan(sb.cpu())) and bool(torch.isnan(sa[0, 20]))
    assert torch.equal(a.float().nan_to_num(9.0), b.cpu().float().nan_to_num(9.0))
    kw = dict(block_size=16, topk=4, local_blocks=1, init_blocks=0)
    got = index_topk(q.to(DEV), k.to(DEV), score_dtype="fp8", backend="triton", **kw).cpu()
    ref = index_topk(q, k, score_dtype="fp8", backend="reference", **kw)
    assert torch.equal(got, ref)
    own = torch.arange(96) // 16
    assert not ((ref == 2) & (own != 2).view(1, 1, -1, 1)).any()  # block 2 only where it is the own block
