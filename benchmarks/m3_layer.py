"""The seeds' "nearly three times faster": MiniMax-M3 against M3.1-Flash, composed from one decoder
layer at M3's exact shapes (random weights) measured on one GPU.

Layer kinds (msakit's `M3DecoderLayer` from the M3 config fixture, hidden 6144, 64 / 4 heads of
128, index branch 4 x 128, 128 experts of width 3072 top-4 + one shared expert of 3072, dense MLP
12288), built as a one-layer `M3ForCausalLM` directly on the GPU:

    m3_dense         dense GQA attention + dense MLP, BF16           (M3 layers 0-2)
    m3_msa_moe       MSA + MoE, BF16                                 (M3 layers 3-59)
    bf16_msa_dense   MSA + dense MLP, BF16                           (M3 with MSA everywhere: the
                                                                      first change alone)
    flash_msa_dense  MSA + dense MLP, MXFP8                          (M3.1-Flash layers 0-2)
    flash_msa_moe    MSA + MoE: NVFP4 routed experts, MXFP8 the rest (M3.1-Flash layers 3-59)

The quantized kinds are `msakit.quant.convert(..., recipe="m3.1-flash")` of the BF16 ones (router
FP32; embeddings and head BF16 in both models).  Per kind:

* decode: msakit's own decode step (what `generate` captures and replays as a CUDA graph: the
  one-layer model's forward over a `PagedDecoder`'s static buffers, `PagedDecoder.static_step`:
  embedding, norms, projections, RoPE, the cache write, the attention, routing, experts, the final
  norm and the 256-row head) for B rows of nq new tokens (nq = 1; nq = 8 for the verify forward
  of DSpark) over a paged cache holding a context of N tokens per row.  The cache is plain
  storage: its pools are filled with random K / V / index keys directly and each row's pages
  are a random permutation (no prefill runs).  MSA layers attend through `msa_decode` over the N
  tokens.  The dense-attention kind (m3_dense) runs its step at a context of one page (msakit's
  dense paged path gathers every page, a reference path; a serving engine runs flash decoding),
  plus SDPA's flash backend over N tokens measured alone.  Each step is captured with
  `msakit.graphs.capture_graph` (a warm-up under torch's sync check, any host sync an error) and
  timed as CUDA-graph replays (`tools.bench.decode.graph_ms`) with a 256 MiB L2 flush before each
  step, subtracted (a layer sees its weights and cache cold after the other 59 layers ran).  A
  step that cannot be captured is timed eagerly, says why, and is marked "eager" in the JSON's
  `timing` (its time is then host overhead, not GPU work);
* prefill: the layer forward over one sequence of T tokens without a cache (MSA prefill kernels
  / dense attention; validation and plans read the host there, as prefill does), eager, median
  of the calls.

Composition (60 layers): M3 = 3 x m3_dense + 57 x m3_msa_moe; "M3, MSA everywhere" = 3 x
bf16_msa_dense + 57 x m3_msa_moe; M3.1-Flash = 3 x flash_msa_dense + 57 x flash_msa_moe; each
plus the BF16 LM head (200,064 x 6144) over the rows that need logits (timed on its own; the
one-layer models' 256-row head, embedding lookup and final norm are inside each layer's step, a
few microseconds).  Decode tokens/s = B / (sum of the layers' decode steps at context N, the
dense kind's step plus its attention over N, + head).  Prefill seconds = sum of the layers'
prefill times.

DSpark: "M3.1-Flash + DSpark" applies the accepted length (tokens per verify step and row, bonus
included, block of 7) that msakit's trained drafter reached in benchmarks/results/
spec_NVIDIA_H200_run17.json (the `acceptance` rows, DSpark, budget off, T = 0 and T = 1; a small
target and drafter trained on the stdlib corpus, docs/spec.md) -- not M3.1-Flash's own drafter.
A round = the drafter (the DSpark config fixture: 5 BF16 layers of dense attention over a sliding
window of 4096 + dense MLP 12288, timed as m3_dense steps of 8 tokens per row plus SDPA over
4096) + the target's verify forward over 8 positions per row (the Flash layers' decode steps of
8 tokens per row at context N, `msa_decode` with 8 queries) + the head over 8 + 7 positions.  Tokens/s
= B * accepted length / round time.  M3 has no drafter here: msakit does not build M3's
multi-token-prediction modules.

Each change's share of the speedup: the factors MSA everywhere (M3 -> M3 with MSA everywhere),
4/8-bit weights (-> M3.1-Flash) and DSpark (-> M3.1-Flash + DSpark, T = 0) multiply to the
total; a change's share is log(its factor) / log(total).

    python benchmarks/m3_layer.py [--quick] [--B 1 8 32] [--N 32768 131072 1048576] [--T 32768 131072]
    python benchmarks/m3_layer.py --tiny        # CPU smoke run of the whole pipeline (tiny shapes)

Run time on one H100 (a check of this code): --quick 100 s on a fresh machine, then the full
run 90 s (Triton's cache warm; add ~30 s cold) without B = 32 at 1M, whose cache (~75 GiB of
bf16 K / V / index keys for the one layer, plus the layer's weights) fits an H200 only; a step
whose cache does not fit the free memory is skipped (NaN, said in `timing`).  Writes
benchmarks/results/m3_layer_<gpu>.json and a PNG (and $OUT/), prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, add_run_args, copy_out, env_info, gpu_tag, print_rows, save_json  # noqa: E402
from msakit.models import M3Config, M3ForCausalLM  # noqa: E402
from msakit.quant import convert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "minimax-m3" / "config.json"
DRAFTER_FIXTURE = ROOT / "tests" / "fixtures" / "minimax-m3.1-flash" / "dspark" / "config.json"
SPEC_JSON = RESULTS / "spec_NVIDIA_H200_run17.json"
LAYERS, DENSE_LAYERS = 60, 3
VERIFY = 8  # anchor + 7 drafts
DRAFT_BLOCK = 7

KINDS = {  # name: (sparse attention, MoE, quantized)
    "m3_dense": (False, False, False),
    "m3_msa_moe": (True, True, False),
    "bf16_msa_dense": (True, False, False),
    "flash_msa_dense": (True, False, True),
    "flash_msa_moe": (True, True, True),
}
MODELS = {  # name: ((kind, count, attention over the context) per layer group)
    "M3": (("m3_dense", DENSE_LAYERS, "dense"), ("m3_msa_moe", LAYERS - DENSE_LAYERS, "msa")),
    "M3, MSA everywhere": (("bf16_msa_dense", DENSE_LAYERS, "msa"), ("m3_msa_moe", LAYERS - DENSE_LAYERS, "msa")),
    "M3.1-Flash": (("flash_msa_dense", DENSE_LAYERS, "msa"), ("flash_msa_moe", LAYERS - DENSE_LAYERS, "msa")),
}


# ----------------------------------------------------------------------------------- timing
def timed_ms(fn, device: torch.device, *, graph: bool = True) -> tuple[float, bool]:
    """(ms per call, graphed): a CUDA-graph replay (tools.bench.decode.graph_ms) when the capture
    works, else the median of eager calls (host wall time on CPU).  For single ops (the head, SDPA)
    and the eager prefill; decode steps go through `step_ms`."""
    if device.type == "cuda":
        from benchmarks.common import bench_ms
        from tools.bench.decode import graph_ms

        if graph:
            try:
                return graph_ms(fn), True
            except Exception as e:  # a host sync inside fn: time it eagerly
                print(f"    (no CUDA graph: {type(e).__name__}: {str(e)[:100]})")
                torch.cuda.synchronize()
        return bench_ms(fn, max_s=30.0), False
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), False


def step_ms(fn, device: torch.device, unsupported: str | None = None) -> tuple[float, str]:
    """(ms per decode step, how it was timed) of fn (a decode step over static buffers).

    CUDA: one eager call first (Triton compilation and autotuning read the host), then
    `msakit.graphs.capture_graph` (the warm-up under torch's sync check, then the capture: what
    `generate` does) and, when that works, `tools.bench.decode.graph_ms(fn, flush=True)`: CUDA-graph
    replays, 10 steps per graph, a 256 MiB L2 flush before each step, subtracted -> "graphed".  A
    step that cannot be captured (`unsupported`: the decoder's own pre-check, or the capture's
    error) is timed eagerly with `bench_ms` after printing why -> "eager: <why>".  CPU: the median
    of 3 eager calls -> "eager (CPU)"."""
    if device.type != "cuda":
        return timed_ms(fn, device, graph=False)[0], "eager (CPU)"
    from benchmarks.common import bench_ms
    from msakit.graphs import GraphCaptureError, capture_graph
    from tools.bench.decode import graph_ms

    why = unsupported
    if why is None:
        fn()
        torch.cuda.synchronize()
        try:
            graph = capture_graph(fn, device)[1]
            del graph
        except GraphCaptureError as e:
            why = e.describe("the decode step")
        torch.cuda.synchronize()
    if why is None:
        return graph_ms(fn, flush=True), "graphed"
    print(f"    NOT GRAPHED, timed eagerly (host overhead included): {why}", flush=True)
    return bench_ms(fn, max_s=10.0), f"eager: {why}"


# ----------------------------------------------------------------------------------- the layers
def layer_config(sparse: bool, moe: bool, tiny: bool) -> M3Config:
    """One layer of M3's shapes (the fixture), or a tiny stand-in (--tiny), vocabulary 256 (the
    head is timed on its own)."""
    cfg = M3Config.from_dict(json.loads(FIXTURE.read_text()))
    if tiny:
        cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                  rotary_dim=64, dense_intermediate_size=512, intermediate_size=128,
                                  shared_intermediate_size=128, num_local_experts=16, index_n_heads=4,
                                  index_head_dim=128)
    return dataclasses.replace(cfg, num_hidden_layers=1, vocab_size=256, moe_layer_freq=[int(moe)],
                               sparse_attention_freq=[int(sparse)])


def build_layer(kind: str, device: torch.device, tiny: bool, dtype: torch.dtype = torch.bfloat16):
    """The one-layer model of `kind` in `dtype` on `device` (random weights), converted to the
    M3.1-Flash formats for the quantized kinds; returns (model, its decoder layer)."""
    sparse, moe, quant = KINDS[kind]
    cfg = layer_config(sparse, moe, tiny)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = M3ForCausalLM(cfg, mode="sparse")
    finally:
        torch.set_default_dtype(old)
    model.eval()
    if quant:
        convert(model, recipe="m3.1-flash")
    return model, model.model.layers[0]


def layer_fn(layer, B: int, T: int, device: torch.device, hidden: int):
    """The layer's forward over B rows of T tokens without a cache (the prefill path)."""
    h = torch.randn(B, T, hidden, device=device, dtype=torch.bfloat16)

    def run():
        with torch.no_grad():
            return layer(h, None, compute_kl=False)[0]

    return run


# ----------------------------------------------------------------------------------- decode steps
def cache_bytes(model, B: int, context: int, nq: int) -> int:
    """Bytes of the paged pools a `DecodeSteps` of (B, context, nq) allocates (bf16 K / V, and
    the index keys of an MSA layer)."""
    attn = model.model.layers[0].self_attn
    c = attn.cfg
    ps = c.selection.block_size
    pages = B * -(-(context + nq) // ps)
    per_page = 2 * c.num_kv_heads * ps * c.head_dim + (ps * c.index_dim if attn.index_branch else 0)
    return pages * per_page * 2


class DecodeSteps:
    """msakit's decode step of a one-layer model for B rows at a context of N tokens: a
    `PagedDecoder` (the state `generate` decodes with) whose pools are filled directly with random
    K / V / index keys (the cache is plain storage), each row's pages a random permutation of the
    pool.  `fn(nq)` is the step that `generate` captures (`PagedDecoder.static_step`) over static
    buffers staged for nq new tokens per row at positions N .. N + nq - 1 (`stage`)."""

    def __init__(self, model, B: int, N: int, max_nq: int, *, seed: int = 0) -> None:
        from msakit.generate import PagedDecoder

        device = model.device
        self.model, self.B, self.N = model, B, N
        self.dec = PagedDecoder(model, B, N + max_nq, kv_dtype=model.dtype)
        cache = self.dec.cache
        self.gen = torch.Generator(device=device).manual_seed(seed)
        for pool in (cache.k, cache.v, cache.k_idx):
            if pool is not None:
                pool.normal_(generator=self.gen)
        W = self.dec.graph_width
        perm = torch.randperm(cache.num_pages, device=device, generator=self.gen)[: B * W]
        self.table = perm.to(torch.int32).view(B, W)
        self.unsupported = self.dec.graph_unsupported_reason() if device.type == "cuda" else None

    def stage(self, nq: int):
        """The decoder's static buffers for nq new tokens per row, filled: random token ids,
        positions N .. N + nq - 1, their slots in each row's pages, the page table, lengths N + nq."""
        g = self.dec.static_buffers(nq)
        ps = self.dec.cache.page_size
        dev = g.ids.device
        pos = self.N + torch.arange(nq, device=dev)
        g.ids.copy_(torch.randint(self.model.config.vocab_size, (self.B, nq), device=dev, generator=self.gen))
        g.positions.copy_(pos.expand(self.B, nq))
        g.slots.copy_((self.table[:, pos // ps].long() * ps + pos % ps).reshape(-1))
        g.page_table.copy_(self.table)
        g.seq_lens.fill_(self.N + nq)
        return g

    def fn(self, nq: int):
        """The step for nq new tokens per row, under no_grad as `generate` runs it (with autograd
        on, the MoE takes its training paths: no pairs kernel, no packed expert kernel)."""
        g = self.stage(nq)

        def step():
            with torch.no_grad():
                return self.dec.static_step(g)

        return step


def step_contexts(kind: str, Ns, page: int) -> list[int]:
    """The contexts a kind's decode step is timed at: every N for MSA layers, one page for the
    dense-attention kind (its attention over N is SDPA's, timed alone)."""
    return list(Ns) if KINDS[kind][0] else [page]


def step_nqs(kind: str) -> tuple[int, ...]:
    """New tokens per row a kind's step is timed with: 8 too for the Flash kinds (DSpark's verify)
    and the dense kind (the drafter's layers)."""
    return (1, VERIFY) if kind == "m3_dense" or KINDS[kind][2] else (1,)


# ----------------------------------------------------------------------------------- attention alone
def dense_attention_ms(B: int, N: int, nq: int, device: torch.device) -> float:
    """Dense decode attention of nq new tokens per row over N keys through SDPA's flash backend (the
    16 query heads of a group times nq as query rows over that group's K / V, B * G as the batch:
    the nq tokens see every key, an upper bound of the causal cost); cold (L2 flushed, subtracted)
    CUDA-graph replays on CUDA.  SDPA's default dispatch picks cuDNN here, ~20x slower at 1M
    (tools.bench.decode.dense_ms), so the flash backend is named."""
    from tools.bench.decode import HQ, D, G

    q = torch.randn(B * G, 1, (HQ // G) * nq, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B * G, 1, N, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if device.type != "cuda":
        return timed_ms(lambda: F.scaled_dot_product_attention(q, k, v), device)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tools.bench.decode import graph_ms

    def fn():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    return graph_ms(fn, flush=True)


def head_ms(rows: int, device: torch.device, vocab: int, hidden: int) -> float:
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    return timed_ms(lambda: F.linear(x, w), device)[0]


# ----------------------------------------------------------------------------------- acceptance
def dspark_acceptance(path: Path = SPEC_JSON) -> dict:
    """{temperature: accepted length} of the DSpark drafter, confidence budget off, from a spec.py
    result file (its `acceptance` rows)."""
    data = json.loads(path.read_text())
    out = {}
    for row in data.get("acceptance", []):
        if row.get("drafter") == "dspark" and row.get("confidence_budget") == "off":
            out[float(row["temperature"])] = float(row["accepted_length"])
    if not out:
        raise ValueError(f"{path}: no DSpark acceptance rows (drafter 'dspark', budget off)")
    return out


# ----------------------------------------------------------------------------------- composition
def layer_decode_ms(steps: dict, dense_attn: dict, kind: str, akind: str, B: int, N: int, nq: int, page: int) -> float:
    """One layer's decode time at context N: its step at N (MSA), or its step at one page plus
    SDPA over N (dense attention)."""
    if akind == "msa":
        return steps[(kind, B, N, nq)]
    return steps[(kind, B, page, nq)] + dense_attn[(B, N, nq)]


def compose(steps: dict, dense_attn: dict, heads: dict, Bs, Ns, accept: dict, drafter: dict, page: int) -> list[dict]:
    """Decode tokens/s per model, batch and context from the measured parts (see the module doc)."""
    rows = []
    for B in Bs:
        for N in Ns:
            per = {}
            for model, groups in MODELS.items():
                ms = heads[(B, 1)]
                for kind, count, akind in groups:
                    ms += count * layer_decode_ms(steps, dense_attn, kind, akind, B, N, 1, page)
                per[model] = {"ms_per_step": ms, "tok_s": B / ms * 1e3}
            verify = heads[(B, VERIFY)]
            for kind, count, akind in MODELS["M3.1-Flash"]:
                verify += count * layer_decode_ms(steps, dense_attn, kind, akind, B, N, VERIFY, page)
            round_ms = verify + drafter[B]
            for temp, acc in sorted(accept.items()):
                per[f"M3.1-Flash + DSpark (T={temp:g})"] = {"ms_per_round": round_ms, "accepted_length": acc,
                                                            "tok_s": B * acc / round_ms * 1e3}
            for model, r in per.items():
                rows.append({"model": model, "B": B, "N": N, **r, "vs_M3": r["tok_s"] / per["M3"]["tok_s"]})
    return rows


def shares(rows: list[dict], B: int, N: int, temp: float) -> dict:
    """The factor and the log-share of each change at (B, N)."""
    t = {r["model"]: r["tok_s"] for r in rows if r["B"] == B and r["N"] == N}
    spec = f"M3.1-Flash + DSpark (T={temp:g})"
    f = {"MSA everywhere": t["M3, MSA everywhere"] / t["M3"],
         "4/8-bit weights": t["M3.1-Flash"] / t["M3, MSA everywhere"],
         "DSpark": t[spec] / t["M3.1-Flash"]}
    total = t[spec] / t["M3"]
    lt = math.log(total) if total > 0 and total != 1 else float("nan")
    return {"B": B, "N": N, "temperature": temp, "total": total,
            "factors": f, "shares": {k: math.log(v) / lt for k, v in f.items()}}


def plot(decode_rows: list[dict], prefill: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in decode_rows))
    cases = sorted({(r["B"], r["N"]) for r in decode_rows}, key=lambda x: (x[1], x[0]))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(cases) + 5), 4.2),
                                 gridspec_kw={"width_ratios": [3, 1]})
    w = 0.8 / len(models)
    for j, m in enumerate(models):
        ys = [next(r["tok_s"] for r in decode_rows if r["model"] == m and (r["B"], r["N"]) == c) for c in cases]
        a1.bar([i + j * w for i in range(len(cases))], ys, w, label=m)
    a1.set_xticks([i + 0.4 - w / 2 for i in range(len(cases))])
    a1.set_xticklabels([f"B={b}\n{n // 1024}K" for b, n in cases], fontsize=8)
    a1.set_yscale("log")
    a1.set_ylabel("decode tokens/s (60 layers + head)")
    a1.legend(fontsize=7)
    Ts = sorted({T for (_, T) in prefill})
    pm = [m for m in MODELS if all((m, T) in prefill for T in Ts)]
    w2 = 0.8 / max(1, len(pm))
    for j, m in enumerate(pm):
        a2.bar([i + j * w2 for i in range(len(Ts))], [prefill[(m, T)] for T in Ts], w2, label=m)
    a2.set_xticks([i + 0.4 - w2 / 2 for i in range(len(Ts))])
    a2.set_xticklabels([f"{T // 1024}K" for T in Ts])
    a2.set_ylabel("prefill seconds (60 layers)")
    a2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------- main
def free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def measure_layers(device: torch.device, Bs, Ns, Ts, tiny: bool) -> tuple[dict, dict, dict, int]:
    """{(kind, B, context, new tokens per row): decode step ms}, {(kind, T): prefill ms}, notes
    {"kind B=.. N=.. nq=..": "graphed" | "eager: why" | "skipped: why"}, and the page size (the
    dense kind's step context)."""
    steps, prefill_ms, notes, page = {}, {}, {}, 0
    for kind in KINDS:
        t0 = time.perf_counter()
        model, layer = build_layer(kind, device, tiny)
        hidden = model.config.hidden_size
        page = model.model.layers[0].self_attn.cfg.selection.block_size  # one page = one selection block
        print(f"{kind}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        nqs = step_nqs(kind)
        for B in Bs:
            for N in step_contexts(kind, Ns, page):
                need, free = cache_bytes(model, B, N, max(nqs)), free_bytes(device)
                keys = [f"{kind} B={B} N={N} nq={nq}" for nq in nqs]
                if free is not None and need + (2 << 30) > free:
                    why = f"skipped: its cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                    print(f"  decode B={B} N={N}: {why}", flush=True)
                    for nq, key in zip(nqs, keys):
                        steps[(kind, B, N, nq)], notes[key] = float("nan"), why
                    continue
                t1 = time.perf_counter()
                ds = None
                try:
                    ds = DecodeSteps(model, B, N, max(nqs))
                    for nq, key in zip(nqs, keys):
                        steps[(kind, B, N, nq)], notes[key] = step_ms(ds.fn(nq), device, ds.unsupported)
                        print(f"  decode B={B} N={N} x{nq}: {steps[(kind, B, N, nq)]:.3f} ms ({notes[key].split(':')[0]})",
                              flush=True)
                except torch.OutOfMemoryError as e:
                    for nq, key in zip(nqs, keys):
                        if (kind, B, N, nq) not in steps:
                            steps[(kind, B, N, nq)], notes[key] = float("nan"), f"skipped: out of memory ({str(e)[:80]})"
                    print(f"  decode B={B} N={N}: out of memory ({str(e)[:80]})", flush=True)
                del ds
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"  ({time.perf_counter() - t1:.1f} s)", flush=True)
        for T in Ts:
            try:
                ms, _ = timed_ms(layer_fn(layer, 1, T, device, hidden), device, graph=False)
            except torch.OutOfMemoryError as e:
                print(f"  prefill T={T}: out of memory ({str(e)[:80]})")
                continue
            prefill_ms[(kind, T)] = ms
            print(f"  prefill T={T}: {ms:.1f} ms", flush=True)
        del model, layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return steps, prefill_ms, notes, page


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, "B 1 and 8, contexts 32K and 128K, prefill 32K")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny layers, short contexts")
    ap.add_argument("--B", type=int, nargs="+", default=None)
    ap.add_argument("--N", type=int, nargs="+", default=None, help="decode contexts")
    ap.add_argument("--T", type=int, nargs="+", default=None, help="prefill lengths")
    ap.add_argument("--spec-json", default=str(SPEC_JSON), help="spec.py result with the DSpark acceptance")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("m3_layer.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    if args.tiny:
        Bs, Ns, Ts = args.B or [1, 2], args.N or [512, 1024], args.T or [256]
    elif args.quick:
        Bs, Ns, Ts = args.B or [1, 8], args.N or [32768, 131072], args.T or [32768]
    else:
        Bs, Ns, Ts = args.B or [1, 8, 32], args.N or [32768, 131072, 1 << 20], args.T or [32768, 131072]
    spec_path = Path(args.spec_json)
    accept = dspark_acceptance(spec_path)
    info = env_info()
    t_start = time.perf_counter()
    steps, prefill_ms, notes, page = measure_layers(device, Bs, Ns, Ts, args.tiny)
    dcfg = json.loads(DRAFTER_FIXTURE.read_text())["text_config"]
    d_layers, window = int(dcfg["num_hidden_layers"]), int(dcfg.get("sliding_window") or 4096)
    window = min(window, max(Ns))
    dense_attn = {}
    for B in Bs:
        for N, nq in [(N, 1) for N in Ns] + [(window, VERIFY)]:
            try:
                dense_attn[(B, N, nq)] = dense_attention_ms(B, N, nq, device)
            except torch.OutOfMemoryError as e:
                dense_attn[(B, N, nq)] = float("nan")
                print(f"  dense attention B={B} N={N} nq={nq}: out of memory ({str(e)[:80]})")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"dense attention (SDPA flash) B={B} N={N} nq={nq}: {dense_attn[(B, N, nq)]:.3f} ms", flush=True)
    hidden = layer_config(False, False, args.tiny).hidden_size
    vocab = json.loads(FIXTURE.read_text())["text_config"]["vocab_size"] if not args.tiny else 4096
    heads = {(B, r): head_ms(B * r, device, vocab, hidden) for B in Bs for r in (1, VERIFY, DRAFT_BLOCK)}
    drafter = {B: d_layers * (steps[("m3_dense", B, page, VERIFY)] + dense_attn[(B, window, VERIFY)])
               + heads[(B, DRAFT_BLOCK)] for B in Bs}
    decode_rows = compose(steps, dense_attn, heads, Bs, Ns, accept, drafter, page)
    prefill = {}
    for model, groups in MODELS.items():
        for T in Ts:
            if all((k, T) in prefill_ms for k, _, _ in groups):
                prefill[(model, T)] = sum(c * prefill_ms[(k, T)] for k, c, _ in groups) / 1e3
    print_rows(decode_rows, [("model", "model", ""), ("B", "B", "d"), ("N", "N", "d"), ("tok/s", "tok_s", ".1f"),
                             ("vs M3", "vs_M3", ".2f")])
    print("\nprefill seconds (60 layers):")
    for (m, T), s in sorted(prefill.items(), key=lambda x: (x[0][1], x[0][0])):
        base = prefill.get(("M3", T))
        print(f"  {m:<22} T={T}: {s:.2f} s" + (f"  ({base / s:.2f}x M3)" if base else ""))
    share_rows = [shares(decode_rows, B, N, min(accept)) for B in Bs for N in Ns]
    for s in share_rows:
        print(f"B={s['B']} N={s['N']}: total {s['total']:.2f}x; factors "
              + ", ".join(f"{k} {v:.2f}x ({s['shares'][k]:.0%})" for k, v in s["factors"].items()))
    at = {r["model"]: r for r in decode_rows if r["B"] == 1 and r["N"] == 131072}
    bars = {}
    if at:
        bars["flash_vs_m3_128k_b1"] = at["M3.1-Flash"]["vs_M3"]
        bars["flash_dspark_vs_m3_128k_b1"] = {k: r["vs_M3"] for k, r in at.items() if "DSpark" in k}
    if ("M3", 131072) in prefill:
        bars["prefill_ratio_128k"] = prefill[("M3", 131072)] / prefill[("M3.1-Flash", 131072)]
    print("\nbars:", bars)
    eager = {k: v for k, v in notes.items() if v != "graphed"}
    if device.type == "cuda" and eager:
        print(f"\nWARNING: {len(eager)} decode step(s) not timed as CUDA-graph replays (their rows above are not "
              "GPU work):")
        for k, v in eager.items():
            print(f"  {k}: {v[:200]}")
    payload = {
        "env": info, "tiny": args.tiny, "quick": args.quick, "layers": LAYERS, "dense_layers": DENSE_LAYERS,
        "page": page,
        "layer_decode_ms": [{"kind": k, "B": B, "context": N, "tokens_per_row": t, "ms": v}
                            for (k, B, N, t), v in steps.items()],
        "layer_prefill_ms": [{"kind": k, "T": T, "ms": v} for (k, T), v in prefill_ms.items()],
        "dense_attention_ms": [{"B": B, "N": N, "nq": q, "ms": v, "what": "SDPA flash backend"}
                               for (B, N, q), v in dense_attn.items()],
        "head_ms": [{"B": B, "rows_per_row": r, "ms": v} for (B, r), v in heads.items()],
        "drafter_round_ms": drafter, "timing": notes,
        "dspark_acceptance": {"source": str(spec_path.relative_to(ROOT)) if spec_path.is_relative_to(ROOT) else str(spec_path),
                              "accepted_length": accept,
                              "what": "msakit's DSpark drafter on the small preset (docs/spec.md), not M3.1-Flash's"},
        "decode": decode_rows, "prefill_s": [{"model": m, "T": T, "s": s} for (m, T), s in prefill.items()],
        "shares": share_rows, "bars": bars, "total_s": time.perf_counter() - t_start,
        "note": "M3 runs without a drafter: msakit does not build M3's multi-token-prediction modules.",
    }
    tag = "cpu_tiny" if args.tiny else gpu_tag(info)
    path = save_json(f"m3_layer_{tag}{args.tag}.json", payload, args.out)
    png = RESULTS / f"m3_layer_{tag}{args.tag}.png"
    plot(decode_rows, prefill, png, f"M3 vs M3.1-Flash composed from one M3-shaped layer ({info['gpu'] or 'cpu'})")
    copy_out(png, args.out)
    print(f"wrote {path} and {png.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
