"""Does MSA keep quality?  The paper's claims reproduced at small scale (issue: "Does MSA keep quality?").

Models of equal size (msakit's ``small`` preset: hidden 512, 8 layers, MoE) trained from scratch on the
Python standard-library corpus with the same token budget (same steps x batch x context, same data
order), context 8192.  Selection: block 64, top-8 -> 512 selected keys per query = 6.25% of a full
8192-token context (local block 1, no init block).  Sub-runs:

  dense    full attention for all of training (``set_attention_mode("dense")``, KL off)
  msa      MSA from scratch: full-attention warm-up for the first 20% of steps (the indexer learns by
           KL meanwhile), then sparse (KL coefficient 1)
  convert  msakit's convert path from dense's final checkpoint: the dense weights are loaded into a
           dense-attention M3 (no index branch), ``convert_dense_to_msa`` adds a fresh index branch,
           then EXTRA steps: indexer warm-up with the main branch dense (40%), then sparse
  dense_ext  the token-matched control of convert: dense's final checkpoint continued for the same
           EXTRA steps in dense mode (same LR schedule, same data order as convert); convert is
           compared against it (requested together with convert)
  window   FLOP-matched sliding window: each query attends block 0 plus its own block and the topk-2
           blocks before it (topk x block = 512 keys, the same count as MSA), trained so from step 0
           (no warm-up, KL off).  Implemented in this script by patching the decoder layers (below)
  bs32, bs64, bs128  MSA from scratch with block 32 / 64 / 128 and topk = 512 / block (16 / 8 / 4);
           bs64 is the msa run itself (identical settings), not trained twice

Measured per sub-run (in its evaluation mode: dense for dense/dense_ext, sparse for the others):
validation loss on the held-out files; loss on the long held-out files (>= 32K tokens,
``msakit.train.corpus``) in context-sized windows by target position bucket (0-1K, 1-2K, 2-4K, 4-8K);
the retrieval probe (`build_probes`: identifiers defined by ``def NAME`` / ``class NAME`` / a
module-level ``NAME =`` whose previous occurrence is more than 4K tokens before a later use, the
definition inside the same 8K window; the loss on the use's tokens); the trainer's indexer recall.

    python benchmarks/quality.py --runs dense,msa,convert,window,bs32,bs64,bs128 --budget-s 480 --device cuda
    python benchmarks/quality.py --report            # only aggregates what exists
    python benchmarks/quality.py --tiny --budget-s 600   # CPU plumbing check; its numbers mean nothing

Resumable: each sub-run lives in ``<root>/<name>/`` (root ``runs/quality``, ``runs/quality-tiny`` with
--tiny) with its own checkpoints; a sub-run with ``result.json`` is finished and skipped; an
interrupted one resumes from its last checkpoint (Trainer.resume).  Training stops when the budget is
spent (a checkpoint is written), leaving time for the evaluation; rerun the same command to continue.
The tokenizer / token cache is ``<root>/cache`` unless $MSAKIT_CACHE is set.

Writes ``benchmarks/results/quality_<gpu>.json`` (save_json; ``quality_cpu-tiny.json`` for --tiny),
``quality_<gpu>_loss.png`` beside it, and prints the claims table.
"""

from __future__ import annotations

import argparse
import bisect
import builtins
import json
import keyword
import os
import re
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, env_info, save_json  # noqa: E402

ALL_RUNS = ("dense", "msa", "convert", "window", "bs32", "bs64", "bs128")
RESULT_FILE = "result.json"

PRESETS = {
    # H200.  512 selected keys of an 8192 context = 6.25%.
    "gpu": dict(model="small", layers=8, context=8192, block=64, selected=512, batch=4, steps=300, lr=2e-3,
                warmup_frac=0.2, extra=100, extra_warmup=40, ext_lr=6e-4, max_train_tokens=None,
                max_val_tokens=None, eval_rows=64, train_eval_rows=8, long_windows=64, probes=256, min_gap=4096,
                eval_every=100, save_every=50, bs_scale=1, eval_reserve_s=75.0),
    # CPU plumbing check: 64 selected keys of 512 = 12.5%; bsN means block N/4 (8 / 16 / 32)
    "tiny": dict(model="tiny", layers=2, context=512, block=16, selected=64, batch=4, steps=40, lr=3e-3,
                 warmup_frac=0.2, extra=16, extra_warmup=6, ext_lr=1e-3, max_train_tokens=600_000,
                 max_val_tokens=60_000, eval_rows=8, train_eval_rows=4, long_windows=8, probes=32, min_gap=256,
                 eval_every=20, save_every=10, bs_scale=4, eval_reserve_s=20.0),
}


def log(*a) -> None:
    print(*a, flush=True)


# =============================================================================================
# The retrieval probe (pure)
# =============================================================================================

_DEF_RE = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_]\w*)", re.M)
_ASSIGN_RE = re.compile(r"^([A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=(?!=)", re.M)  # module-level NAME = / NAME: T =
_SKIP_NAMES = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


@dataclass(frozen=True)
class Probe:
    name: str
    def_token: int  # first token of the name in its definition
    prev_token: int  # last token of the occurrence before the use (the definition or an earlier use)
    use_start: int  # tokens [use_start, use_end) cover the use's characters
    use_end: int


def build_probes(text: str, offsets: Sequence[tuple[int, int]], *, min_gap: int, max_span: int,
                 min_len: int = 4, max_probes: int | None = None) -> list[Probe]:
    """Retrieval probes of one file.

    ``offsets[t] = (start, end)`` character span of token t (a tokenizer's offsets).  For each name
    defined by ``def NAME`` / ``class NAME`` (any indent) or a module-level ``NAME =`` (first
    definition only; names shorter than `min_len`, keywords and builtins skipped), the first later
    occurrence (``\\bNAME\\b``) whose previous occurrence of the name ends at least `min_gap` tokens
    before it, and whose last token is less than `max_span` tokens after the definition's first token
    (so one window of `max_span` tokens holds both).  At most one probe per name, sorted by use position.
    """
    if not offsets:
        return []
    starts = [s for s, _ in offsets]

    def tok_at(c: int) -> int:
        return max(0, bisect.bisect_right(starts, c) - 1)

    defs: dict[str, int] = {}  # name -> char position of the name in its first definition
    for rx in (_DEF_RE, _ASSIGN_RE):
        for m in rx.finditer(text):
            name = m.group(1)
            if len(name) < min_len or name in _SKIP_NAMES:
                continue
            pos = m.start(1)
            if name not in defs or pos < defs[name]:
                defs[name] = pos
    probes = []
    for name, dpos in defs.items():
        d_tok = tok_at(dpos)
        prev_end = tok_at(dpos + len(name) - 1)
        for m in re.finditer(r"\b" + re.escape(name) + r"\b", text):
            if m.start() <= dpos:
                continue
            u0, u1 = tok_at(m.start()), tok_at(m.end() - 1) + 1
            if u0 - prev_end >= min_gap:
                if u1 - d_tok <= max_span and u0 >= 1:
                    probes.append(Probe(name, d_tok, prev_end, u0, u1))
                break
            prev_end = u1 - 1
    probes.sort(key=lambda p: (p.use_start, p.name))
    return probes[:max_probes] if max_probes is not None else probes


def encode_with_offsets(tok, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets with msakit's Tokenizer (the `tokenizers` object inside)."""
    enc = tok._tok.encode(text, add_special_tokens=False)
    return list(enc.ids), [tuple(o) for o in enc.offsets]


# =============================================================================================
# The sliding-window baseline: a selection function patched into the attention modules
# =============================================================================================


def window_block_idx(T: int, block_size: int, topk: int, *, batch: int = 1, groups: int = 1,
                     device: Any = None) -> torch.Tensor:
    """block_idx int32 [batch, groups, T, topk] of the FLOP-matched sliding window: query i (block
    own = i // block_size) gets {0} U {own, own-1, ..., own-(topk-2)} (ids < 0 dropped, no duplicate),
    valid ids first in descending order, -1 padding -- the layout of ``ops.index_topk``."""
    if topk < 2:
        raise ValueError(f"the window needs topk >= 2 (block 0 + own block), got {topk}")
    own = torch.arange(T, device=device) // block_size  # [T]
    local = own.view(-1, 1) - torch.arange(topk - 1, device=device).view(1, -1)  # [T, topk-1]
    local = torch.where(local >= 0, local, torch.full_like(local, -1))
    first = torch.where(own - (topk - 2) > 0, torch.zeros_like(own), torch.full_like(own, -1)).view(-1, 1)
    idx = torch.cat([local, first], dim=1).sort(dim=1, descending=True).values.to(torch.int32)
    return idx.view(1, 1, T, topk).expand(batch, groups, T, topk).contiguous()


def enable_window(model) -> None:
    """Make every MSA layer of `model` attend the sliding window instead of the indexer's top-k when
    its mode is "sparse" (dense mode stays full attention), through the model's selection policy
    (`set_selection_policy`; per document when rows are packed).  Train with KL off: the indexer is
    not used in sparse mode and the recall metric compares the indexer with the oracle only."""

    def window(layer, q, k, q_idx, k_idx, sel):
        return window_block_idx(q.shape[1], sel.block_size, sel.topk, batch=q.shape[0], groups=k.shape[2],
                                device=q.device)

    model.set_selection_policy(window)


# =============================================================================================
# Sub-run specifications
# =============================================================================================


def run_specs(p: dict) -> dict[str, dict]:
    B, S, steps = p["block"], p["selected"], p["steps"]
    warm = max(1, int(round(p["warmup_frac"] * steps)))
    specs = {
        "dense": dict(kind="scratch", block=B, topk=S // B, warmup=steps, kl=0.0, window=False, eval_mode="dense"),
        "msa": dict(kind="scratch", block=B, topk=S // B, warmup=warm, kl=1.0, window=False, eval_mode="sparse"),
        "window": dict(kind="scratch", block=B, topk=S // B, warmup=0, kl=0.0, window=True, eval_mode="sparse"),
        "convert": dict(kind="convert", block=B, topk=S // B, warmup=p["extra_warmup"], kl=1.0, window=False,
                        eval_mode="sparse", source="dense"),
        "dense_ext": dict(kind="extend", block=B, topk=S // B, warmup=p["extra"], kl=0.0, window=False,
                          eval_mode="dense", source="dense"),
    }
    for nominal in (32, 64, 128):
        b = nominal // p["bs_scale"]
        specs[f"bs{nominal}"] = dict(kind="scratch", block=b, topk=S // b, warmup=warm, kl=1.0, window=False,
                                     eval_mode="sparse")
    for name, s in specs.items():
        if name.startswith("bs") and {k: v for k, v in s.items()} == specs["msa"]:
            s["alias"] = "msa"  # identical settings: the msa run serves
    return specs


def expand_runs(names: Sequence[str], specs: dict) -> list[str]:
    """Requested names in a working order: dependencies (dense before convert / dense_ext), dense_ext
    with convert, aliases resolved to their target."""
    out: list[str] = []

    def add(n: str) -> None:
        if n not in specs:
            raise ValueError(f"unknown run {n!r}; known: {', '.join(ALL_RUNS)}")
        n = specs[n].get("alias", n)
        src = specs[n].get("source")
        if src:
            add(src)
        if n not in out:
            out.append(n)
        if n == "convert" and "dense_ext" not in out:
            out.append("dense_ext")

    for n in names:
        add(n)
    return out


# =============================================================================================
# Model building and training
# =============================================================================================


def base_config(p: dict, vocab: int, block: int, topk: int):
    from msakit.models import M3Config

    return M3Config.preset(p["model"], vocab_size=vocab, num_hidden_layers=p["layers"],
                           max_position_embeddings=max(p["context"], 1024), index_block_size=block,
                           index_topk=topk, index_local_blocks=1, index_init_blocks=0)


def train_config(p: dict, spec: dict):
    from msakit.train.trainer import TrainConfig

    scratch = spec["kind"] == "scratch"
    steps = p["steps"] if scratch else p["extra"]
    return TrainConfig(steps=steps, batch_size=p["batch"], lr=p["lr"] if scratch else p["ext_lr"],
                       lr_warmup_steps=min(20, steps // 5) if scratch else min(10, steps // 5),
                       kl_coef=spec["kl"], dense_warmup_steps=spec["warmup"], log_every=max(1, min(10, steps // 10)),
                       eval_every=p["eval_every"], eval_rows=p["train_eval_rows"],
                       recall_rows=0 if spec["window"] or spec["kl"] == 0 else 1, save_every=p["save_every"],
                       keep_checkpoints=1, seed=p.get("seed", 0) + (0 if scratch else 1))


def final_checkpoint(run_dir: Path) -> Path | None:
    from msakit.train import checkpoint as ckpt_mod

    return ckpt_mod.find_checkpoint(run_dir)


def build_model(name: str, spec: dict, p: dict, vocab: int, root: Path):
    """The model a sub-run starts from (before any resume)."""
    from msakit.models import M3ForCausalLM
    from msakit.models.convert import convert_dense_to_msa
    from msakit.train.trainer import load_model_weights

    cfg = base_config(p, vocab, spec["block"], spec["topk"])
    if spec["kind"] == "scratch":
        torch.manual_seed(p.get("seed", 0))
        model = M3ForCausalLM(cfg)
    else:
        src = final_checkpoint(root / spec["source"])
        if src is None or not (root / spec["source"] / RESULT_FILE).is_file():
            raise RuntimeError(f"{name} needs the finished {spec['source']} run")
        dense = M3ForCausalLM(cfg)
        load_model_weights(dense, src)
        if spec["kind"] == "extend":
            model = dense
        else:
            # msakit's convert path: a dense-attention M3 (no index branch) with the dense run's weights
            # (its never-trained index branch dropped), then convert_dense_to_msa adds a fresh one
            plain = M3ForCausalLM(cfg.replace(sparse_attention_freq=[0] * cfg.num_hidden_layers))
            sd = {k: v for k, v in dense.state_dict().items() if ".index_" not in k}
            plain.load_state_dict(sd, strict=True)
            model = convert_dense_to_msa(plain, block_size=spec["block"], topk=spec["topk"],
                                         local_blocks=1, init_blocks=0, seed=p.get("seed", 0))
    if spec["window"]:
        enable_window(model)
    return model


def train_run(name: str, spec: dict, p: dict, data, root: Path, device: torch.device, deadline: float) -> bool:
    """Train (or resume) one sub-run until done or `deadline`; True when its steps are complete."""
    from msakit.train.trainer import Trainer

    out = root / name
    cfg = train_config(p, spec)
    model = build_model(name, spec, p, data.tokenizer.vocab_size, root)
    trainer = Trainer(model, cfg, data.train, data.val, out_dir=out, device=device, progress=False,
                      meta={"kind": "quality", "run": name, "spec": spec})
    ck = final_checkpoint(out)
    if ck is not None:
        trainer.resume(ck)
        log(f"[{name}] resumed {ck} at step {trainer.step}/{cfg.steps}")
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps({"spec": spec, "train": asdict(cfg)}, indent=1))
        n = sum(x.numel() for x in model.parameters())
        log(f"[{name}] start: {n / 1e6:.2f}M parameters, {cfg.steps} steps x {cfg.batch_size} x "
            f"{data.train.context} tokens, dense warm-up {cfg.dense_warmup_steps} steps, KL {cfg.kl_coef}, "
            f"block {spec['block']} top-{spec['topk']}{' (sliding window)' if spec['window'] else ''}")
    t0, s0 = time.time(), trainer.step
    if trainer.step < cfg.steps:
        trainer.fit(deadline=deadline)
        if final_checkpoint(out) is None or _ckpt_step(final_checkpoint(out)) != trainer.step:
            trainer.save()
    dt = time.time() - t0
    done = trainer.step >= cfg.steps
    if trainer.step > s0:
        tps = (trainer.step - s0) * cfg.batch_size * data.train.context / max(dt, 1e-9)
        log(f"[{name}] step {trainer.step}/{cfg.steps} in {dt:.0f}s ({tps:,.0f} tokens/s)"
            + ("" if done else " -- budget spent, rerun to resume"))
        _append_timing(out, trainer.step - s0, dt, tps)
    return done


def _ckpt_step(ck: Path) -> int:
    try:
        return int(json.loads((ck / "manifest.json").read_text()).get("step", -1))
    except Exception:
        m = re.search(r"(\d+)$", ck.name)
        return int(m.group(1)) if m else -1


def _append_timing(out: Path, steps: int, dt: float, tps: float) -> None:
    with open(out / "timing.jsonl", "a") as fh:
        fh.write(json.dumps({"steps": steps, "seconds": dt, "tokens_per_s": tps}) + "\n")


# =============================================================================================
# Evaluation
# =============================================================================================


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """ids [B, T] -> float32 [B, T-1]: -log p(ids[:, t+1] | ids[:, :t+1])."""
    from msakit.train.metrics import autocast_for

    ids = ids.to(device)
    with autocast_for(device):
        logits = model(ids, labels=None, compute_kl=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -lp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def bucket_edges(context: int) -> list[int]:
    return [0, context // 8, context // 4, context // 2, context]


def bucket_label(a: int, b: int) -> str:
    f = lambda x: f"{x // 1024}K" if x % 1024 == 0 and x else str(x)  # noqa: E731
    return f"{f(a)}-{f(b)}"


def long_windows(long_tokens: list[list[int]], context: int, max_windows: int) -> list[list[int]]:
    """Non-overlapping context-sized windows of the long files, round-robin over files."""
    per_file = [[t[i:i + context] for i in range(0, len(t) - context + 1, context)] for t in long_tokens]
    out, r = [], 0
    while len(out) < max_windows and any(r < len(w) for w in per_file):
        for w in per_file:
            if r < len(w) and len(out) < max_windows:
                out.append(w[r])
        r += 1
    return out


@torch.no_grad()
def position_losses(model, windows: list[list[int]], context: int, device: torch.device, batch: int) -> dict:
    edges = bucket_edges(context)
    tot = torch.zeros(len(edges) - 1, dtype=torch.float64)
    cnt = torch.zeros(len(edges) - 1, dtype=torch.float64)
    pos = torch.arange(1, context)  # target positions
    bucket = torch.bucketize(pos, torch.tensor(edges[1:-1]), right=True)
    for i in range(0, len(windows), batch):
        nll = token_nll(model, torch.tensor(windows[i:i + batch], dtype=torch.long), device).double().cpu()
        tot.index_add_(0, bucket, nll.sum(0))
        cnt.index_add_(0, bucket, torch.full((context - 1,), float(nll.shape[0]), dtype=torch.float64))
    res = {bucket_label(a, b): float(tot[j] / cnt[j]) if cnt[j] else float("nan")
           for j, (a, b) in enumerate(zip(edges[:-1], edges[1:]))}
    return {"buckets": res, "all": float(tot.sum() / cnt.sum()) if cnt.sum() else float("nan"),
            "windows": len(windows), "tokens": int(cnt.sum())}


def probe_rows(files_tokens: list[tuple[list[int], list[Probe]]], context: int, max_probes: int) -> list[tuple[list[int], int, int]]:
    """(window token ids, use_start, use_end relative to the window) per probe, round-robin over files."""
    out, r = [], 0
    while len(out) < max_probes and any(r < len(ps) for _, ps in files_tokens):
        for ids, ps in files_tokens:
            if r < len(ps) and len(out) < max_probes:
                pr = ps[r]
                ws = max(0, pr.use_end - context)
                out.append((ids[ws:ws + context], pr.use_start - ws, pr.use_end - ws))
        r += 1
    return out


@torch.no_grad()
def probe_loss(model, rows: list[tuple[list[int], int, int]], device: torch.device, batch: int) -> dict:
    by_len: dict[int, list] = {}
    for r in rows:
        by_len.setdefault(len(r[0]), []).append(r)
    tot, n, per = 0.0, 0, []
    for _, group in sorted(by_len.items()):
        for i in range(0, len(group), batch):
            chunk = group[i:i + batch]
            nll = token_nll(model, torch.tensor([c[0] for c in chunk], dtype=torch.long), device).cpu()
            for j, (_, u0, u1) in enumerate(chunk):
                x = nll[j, u0 - 1:u1 - 1]  # logits at t-1 predict token t
                tot += float(x.sum())
                n += x.numel()
                per.append(float(x.mean()))
    return {"loss": tot / n if n else float("nan"), "mean_per_probe": sum(per) / len(per) if per else float("nan"),
            "probes": len(rows), "tokens": n}


class EvalSets:
    """Validation batches, long-file windows and probe rows, built once per process."""

    def __init__(self, p: dict, data) -> None:
        from msakit.train.data import eval_batches

        C = p["context"]
        self.val = eval_batches(data.val, p["batch"], p["eval_rows"])
        tok = data.tokenizer
        long_tok = [tok.encode(f.read()) for f in data.corpus.long]
        self.windows = long_windows(long_tok, C, p["long_windows"])
        files = []
        for f in list(data.corpus.long) + list(data.corpus.val):
            text = f.read()
            if len(text) < p["min_gap"]:
                continue
            ids, offs = encode_with_offsets(tok, text)
            ps = build_probes(text, offs, min_gap=p["min_gap"], max_span=C)
            if ps:
                files.append((ids, ps))
        self.probes = probe_rows(files, C, p["probes"])
        log(f"eval sets: {len(self.val)} validation batches, {len(data.corpus.long)} long files -> "
            f"{len(self.windows)} windows of {C}, {len(self.probes)} retrieval probes from {len(files)} files")


def evaluate_run(name: str, spec: dict, p: dict, data, sets: EvalSets, root: Path, device: torch.device) -> dict:
    from msakit.train.metrics import evaluate
    from msakit.train.trainer import load_model_weights, read_metrics

    out = root / name
    ck = final_checkpoint(out)
    model = build_model(name, spec, p, data.tokenizer.vocab_size, root)
    load_model_weights(model, ck)
    model.to(device).eval()
    mode = spec["eval_mode"]
    model.set_attention_mode(mode)
    t0 = time.time()
    want_recall = mode == "sparse" and not spec["window"]
    ev = evaluate(model, sets.val, device, mode=mode, compute_kl=False, recall_rows=2 if want_recall else 0)
    res: dict[str, Any] = {"name": name, "spec": spec, "eval_mode": mode, "checkpoint": str(ck),
                           "step": _ckpt_step(ck), "val_loss": ev["loss"], "val_tokens": ev["tokens"]}
    if want_recall and ev.get("layers"):
        L = ev["layers"]
        mean = lambda k: sum(x[k] for x in L) / len(L)  # noqa: E731
        res["recall"] = {k: mean(k) for k in ("recall", "oracle", "recall_far", "oracle_far")}
        res["recall_per_layer"] = [x["recall"] for x in L]
    res["long"] = position_losses(model, sets.windows, p["context"], device, p["batch"]) if sets.windows else None
    res["probe"] = probe_loss(model, sets.probes, device, p["batch"]) if sets.probes else None
    recs = read_metrics(out / "metrics.jsonl")
    evals = [r for r in recs if r.get("kind") == "eval" and r.get("recall_per_layer")]
    if evals:
        r = evals[-1]["recall_per_layer"]
        res["trainer_recall_last_eval"] = sum(r) / len(r)
    timing = [json.loads(x) for x in (out / "timing.jsonl").read_text().splitlines()] if (out / "timing.jsonl").is_file() else []
    res["train_seconds"] = sum(t["seconds"] for t in timing)
    res["tokens_per_s"] = timing[-1]["tokens_per_s"] if timing else None
    res["eval_seconds"] = time.time() - t0
    (out / RESULT_FILE).write_text(json.dumps(res, indent=1))
    b = res["long"]["buckets"] if res["long"] else {}
    log(f"[{name}] eval ({mode}): val {res['val_loss']:.4f}, long {b}, probe "
        f"{res['probe']['loss'] if res['probe'] else float('nan'):.4f}" +
        (f", recall {res['recall']['recall']:.3f}" if "recall" in res else ""))
    return res


# =============================================================================================
# Report
# =============================================================================================


def load_results(root: Path) -> dict[str, dict]:
    out = {}
    if root.is_dir():
        for d in sorted(root.iterdir()):
            f = d / RESULT_FILE
            if f.is_file():
                try:
                    out[d.name] = json.loads(f.read_text())
                except json.JSONDecodeError:
                    continue
    return out


def _rel(a: float, b: float) -> float:
    return (a - b) / b


def claims(res: dict[str, dict], context: int) -> list[dict]:
    """The paper's claims as bars: name, value, bar, PASS/FAIL (or n/a when a run is missing)."""
    rows = []
    far = bucket_label(context // 2, context)

    def row(claim, value, bar, ok):
        rows.append({"claim": claim, "value": value, "bar": bar, "verdict": "n/a" if ok is None else ("PASS" if ok else "FAIL")})

    v = lambda n: res[n]["val_loss"] if n in res else None  # noqa: E731
    if v("msa") is not None and v("dense") is not None:
        d = _rel(v("msa"), v("dense"))
        row("MSA from scratch vs full attention (val loss)", f"{d:+.2%}", "<= +1%", d <= 0.01)
    else:
        row("MSA from scratch vs full attention (val loss)", None, "<= +1%", None)
    if v("convert") is not None and v("dense_ext") is not None:
        d = _rel(v("convert"), v("dense_ext"))
        row("MSA converted vs full attention, token-matched (dense_ext)", f"{d:+.2%}", "<= +1%", d <= 0.01)
    else:
        row("MSA converted vs full attention, token-matched (dense_ext)", None, "<= +1%", None)
    fl = lambda n: (res[n].get("long") or {}).get("buckets", {}).get(far) if n in res else None  # noqa: E731
    if fl("msa") is not None and fl("window") is not None:
        row(f"MSA vs sliding window, far-context loss ({far})", f"{fl('msa'):.4f} vs {fl('window'):.4f}", "MSA lower",
            fl("msa") < fl("window"))
    else:
        row(f"MSA vs sliding window, far-context loss ({far})", None, "MSA lower", None)
    pl = lambda n: (res[n].get("probe") or {}).get("loss") if n in res else None  # noqa: E731
    if pl("msa") is not None and pl("window") is not None:
        row("MSA vs sliding window, retrieval probe loss", f"{pl('msa'):.4f} vs {pl('window'):.4f}", "MSA lower",
            pl("msa") < pl("window"))
    else:
        row("MSA vs sliding window, retrieval probe loss", None, "MSA lower", None)
    bs = {n: v(n) for n in ("bs32", "msa", "bs128") if v(n) is not None}
    if len(bs) == 3:
        spread = (max(bs.values()) - min(bs.values())) / min(bs.values())
        row("block sizes 32 / 64 / 128 at equal selected tokens (val loss spread)", f"{spread:.2%}", "<= 1%", spread <= 0.01)
    else:
        row("block sizes 32 / 64 / 128 at equal selected tokens (val loss spread)", None, "<= 1%", None)
    return rows


def table_text(res: dict[str, dict], context: int, rows: list[dict]) -> str:
    edges = bucket_edges(context)
    labels = [bucket_label(a, b) for a, b in zip(edges[:-1], edges[1:])]
    head = ["run", "mode", "step", "val loss"] + [f"long {x}" for x in labels] + ["probe loss", "recall (far)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = ["dense", "dense_ext", "msa", "convert", "window", "bs32", "bs128"]
    for n in order + [n for n in res if n not in order]:
        if n not in res:
            continue
        r = res[n]
        b = (r.get("long") or {}).get("buckets", {})
        rec = r.get("recall")
        nm = "msa (= bs64)" if n == "msa" else n
        cells = [nm, r["eval_mode"] + (" (window)" if r["spec"].get("window") else ""), str(r["step"]),
                 f"{r['val_loss']:.4f}"] + [f"{b[x]:.4f}" if x in b else "-" for x in labels] + [
            f"{r['probe']['loss']:.4f} ({r['probe']['probes']})" if r.get("probe") else "-",
            f"{rec['recall']:.3f} ({rec['recall_far']:.3f})" if rec else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| claim | value | bar | verdict |", "|---|---|---|---|"]
    for c in rows:
        lines.append(f"| {c['claim']} | {c['value'] if c['value'] is not None else '-'} | {c['bar']} | {c['verdict']} |")
    return "\n".join(lines)


def plot_curves(root: Path, res: dict[str, dict], path: Path, p: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from msakit.train.trainer import read_metrics

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    tok_per_step = p["batch"] * p["context"]
    for n in res:
        recs = read_metrics(root / n / "metrics.jsonl")
        off = p["steps"] if res[n]["spec"]["kind"] != "scratch" else 0
        tr = [(r["step"] + off, r["loss"]) for r in recs if r.get("kind") == "train"]
        ev = [(r["step"] + off, r["val_loss"]) for r in recs if r.get("kind") == "eval"]
        if tr:
            a1.plot([s * tok_per_step / 1e6 for s, _ in tr], [x for _, x in tr], label=n, lw=1)
        if ev:
            a2.plot([s * tok_per_step / 1e6 for s, _ in ev], [x for _, x in ev], marker="o", label=n, lw=1)
    for a, t in ((a1, "train loss"), (a2, "validation loss (training-time eval)")):
        a.set_xlabel("tokens (M)")
        a.set_title(t)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylim(top=min(a1.get_ylim()[1], 8))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def mean_results(per_seed: list[dict[str, dict]], context: int) -> dict[str, dict]:
    """Every sub-run finished under at least one seed, with val loss, long-file buckets, probe loss and
    recall averaged over the seeds that have it (``seeds``: how many; ``val_loss_seeds``: each)."""
    import copy

    names = sorted(set().union(*(set(r) for r in per_seed))) if per_seed else []
    out = {}
    for n in names:
        rs = [r[n] for r in per_seed if n in r]
        m = copy.deepcopy(rs[0])
        m["val_loss"] = _mean([x["val_loss"] for x in rs])
        m["val_loss_seeds"] = [x["val_loss"] for x in rs]
        m["seeds"] = len(rs)
        far = bucket_label(context // 2, context)
        if all(x.get("long") for x in rs):
            m["long_far_seeds"] = [x["long"]["buckets"].get(far) for x in rs if far in x["long"]["buckets"]]
            m["long"]["buckets"] = {k: _mean([x["long"]["buckets"][k] for x in rs]) for k in rs[0]["long"]["buckets"]}
        if all(x.get("probe") for x in rs):
            m["probe"]["loss"] = _mean([x["probe"]["loss"] for x in rs])
            m["probe"]["loss_seeds"] = [x["probe"]["loss"] for x in rs]
        if all(x.get("recall") for x in rs):
            for k in ("recall", "recall_far"):
                m["recall"][k] = _mean([x["recall"][k] for x in rs])
        out[n] = m
    return out


def plot_seeds(res: dict[str, dict], path: Path, context: int) -> Path | None:
    """Per sub-run: each seed's value (dots) and the mean (bar) of val loss, far-context loss and probe loss."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    order = [n for n in ("dense", "msa", "window", "bs32", "bs128", "dense_ext", "convert") if n in res]
    far = bucket_label(context // 2, context)
    panels = [("validation loss", lambda r: r["val_loss_seeds"]),
              (f"long files, far bucket ({far})", lambda r: r.get("long_far_seeds") or []),
              ("retrieval probe loss", lambda r: (r.get("probe") or {}).get("loss_seeds") or [])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (title, get) in zip(axes, panels):
        for i, n in enumerate(order):
            ys = get(res[n])
            if not ys:
                continue
            ax.bar(i, sum(ys) / len(ys), color="#9ecae1" if n not in ("window",) else "#fdae6b", width=0.6)
            ax.plot([i] * len(ys), ys, "o", color="k", ms=4)
        ax.set_xticks(range(len(order)), ["msa (bs64)" if n == "msa" else n for n in order], rotation=30)
        lo = min((min(get(res[n])) for n in order if get(res[n])), default=0)
        hi = max((max(get(res[n])) for n in order if get(res[n])), default=1)
        ax.set_ylim(lo - 0.1 * (hi - lo + 1e-3), hi + 0.1 * (hi - lo + 1e-3))
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("quality sub-runs: mean over seeds (bar) and each seed (dots); lower is better")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def report_seeds(roots: list[Path], p: dict, device: torch.device) -> int:
    """The claims on seed-averaged results, and each seed's own verdicts (is a claim's sign stable?)."""
    per_seed = [load_results(r) for r in roots]
    per_seed = [r for r in per_seed if r]
    if len(per_seed) < 2:
        log(f"need finished sub-runs under at least two roots, got {len(per_seed)}")
        return 1
    # claims on the mean over the seeds that finished every sub-run (a run averaged over more seeds
    # than another would mix seed noise into the comparison); the table below lists all seeds
    needed = {n for n in ALL_RUNS if not run_specs(p)[n].get("alias")} | {"dense_ext"}
    complete = [r for r in per_seed if needed <= set(r)] or per_seed
    res = mean_results(complete, p["context"])
    rows = claims(res, p["context"])
    res_all = mean_results(per_seed, p["context"])
    seed_rows = [claims(r, p["context"]) for r in per_seed]
    for row, *each in zip(rows, *seed_rows):
        row["per_seed"] = [f"{e['value']} {e['verdict']}" for e in each]
    text = table_text(res, p["context"], rows)
    text += "\n\nper seed (" + ", ".join(str(r) for r in roots) + "):\n" + "\n".join(
        f"- {r['claim']}: " + " | ".join(r["per_seed"]) for r in rows)
    text = (f"claims and table: mean over the {len(complete)} seed(s) that finished every sub-run\n\n" + text
            + "\n\nval loss per seed (all seeds):\n" + "\n".join(
                f"- {n}: " + ", ".join(f"{v:.4f}" for v in res_all[n]["val_loss_seeds"]) for n in sorted(res_all)))
    info = env_info()
    gpu = "cpu" if device.type != "cuda" else (info.get("gpu") or "gpu").replace(" ", "_")
    payload = {"issue": "Does MSA keep quality? Reproduce the paper's claims at small scale (seed average)",
               "env": info, "preset": p, "roots": [str(r) for r in roots], "seeds": len(per_seed),
               "complete_seeds": len(complete), "mean_results": res, "mean_results_all_seeds": res_all, "claims": rows, "per_seed_results": per_seed, "table": text}
    path = save_json(f"quality_{gpu}_seeds.json", payload)
    png = plot_seeds(res_all, RESULTS / f"quality_{gpu}_seeds.png", p["context"])
    log(text)
    log(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0


def report(root: Path, p: dict, tiny: bool, device: torch.device) -> int:
    res = load_results(root)
    if not res:
        log(f"no finished sub-runs under {root} (no */{RESULT_FILE}); nothing to report. "
            f"Run e.g. `python benchmarks/quality.py --runs dense,msa` first.")
        return 0
    info = env_info()
    gpu = "cpu-tiny" if tiny else ("cpu" if device.type != "cuda" else (info.get("gpu") or "gpu").replace(" ", "_"))
    rows = claims(res, p["context"])
    text = table_text(res, p["context"], rows)
    gpu += f"_seed{p['seed']}" if p.get("seed") else ""
    png = plot_curves(root, res, RESULTS / f"quality_{gpu}_loss.png", p)
    specs = run_specs(p)
    payload = {
        "issue": "Does MSA keep quality? Reproduce the paper's claims at small scale",
        "env": info, "tiny": tiny, "preset": p,
        "selection": {"context": p["context"], "selected_tokens": p["selected"],
                      "share": p["selected"] / p["context"],
                      "runs": {n: f"block {s['block']} x top-{s['topk']}" for n, s in specs.items()}},
        "notes": ["convert is compared with dense_ext: dense's final checkpoint continued for the same "
                  f"{p['extra']} steps in dense mode (same LR schedule and data order), so the comparison is token-matched",
                  "bs64 is the msa run (identical settings)",
                  "window: block 0 + own block + the topk-2 previous blocks, trained windowed from step 0, KL off",
                  "probe: identifier tokens at a use whose previous occurrence of the name is >= "
                  f"{p['min_gap']} tokens earlier, the definition inside the same {p['context']}-token window"]
                 + (["--tiny on CPU: plumbing check only, the numbers mean nothing"] if tiny else []),
        "missing": [n for n in ALL_RUNS + ("dense_ext",) if specs[n].get("alias", n) not in res],
        "results": res, "claims": rows, "table": text, "loss_png": str(png) if png else None,
    }
    path = save_json(f"quality_{gpu}.json", payload)
    log(text)
    log(f"\nwrote {path}" + (f" and {png}" if png else ""))
    if tiny:
        log("NOTE: --tiny CPU numbers mean nothing (tiny model, 40 steps); they only prove the plumbing.")
    return 0


# =============================================================================================
# Main
# =============================================================================================


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default=",".join(ALL_RUNS), help=f"comma-separated sub-runs ({', '.join(ALL_RUNS)})")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of this call (s)")
    ap.add_argument("--tiny", action="store_true", help="CPU plumbing check at tiny sizes")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--report", action="store_true", help="only aggregate the finished sub-runs")
    ap.add_argument("--root", default=None, help="folder of the sub-runs (default runs/quality[-tiny])")
    ap.add_argument("--steps", type=int, default=None, help="override the from-scratch steps (all runs must agree)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0,
                    help="initialisation / data-order seed (default root runs/quality-seedN for N > 0)")
    ap.add_argument("--seed-roots", default=None,
                    help="with --report: comma-separated roots of the same runs under different seeds; "
                         "report seed-averaged claims")
    args = ap.parse_args(argv)
    t_start = time.time()
    p = dict(PRESETS["tiny" if args.tiny else "gpu"])
    if args.steps:
        p["steps"] = args.steps
    if args.batch_size:
        p["batch"] = args.batch_size
    repo = Path(__file__).resolve().parents[1]
    p["seed"] = args.seed
    sfx = f"-seed{args.seed}" if args.seed else ""
    root = Path(args.root) if args.root else repo / "runs" / (("quality-tiny" if args.tiny else "quality") + sfx)
    from msakit.train.trainer import resolve_device

    device = resolve_device(args.device) if not args.report else torch.device("cpu")
    if args.report and args.seed_roots:
        return report_seeds([Path(x) for x in args.seed_roots.split(",") if x],
                            p, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if args.report:
        return report(root, p, args.tiny, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    specs = run_specs(p)
    todo = expand_runs([x.strip() for x in args.runs.split(",") if x.strip()], specs)
    pending = [n for n in todo if not (root / n / RESULT_FILE).is_file()]
    log(f"runs: {', '.join(todo)}; pending: {', '.join(pending) or 'none'}; root {root}; device {device}")
    if pending:
        root.mkdir(parents=True, exist_ok=True)
        (root / "preset.json").write_text(json.dumps(p, indent=1))
        from msakit.train.data import prepare_data

        cache = os.environ.get("MSAKIT_CACHE") or str(root / "cache")
        data = prepare_data(None, stdlib=True, vocab_size=4096, context=p["context"], cache_dir=cache,
                            max_train_tokens=p["max_train_tokens"], max_val_tokens=p["max_val_tokens"])
        log(f"data: {data.summary()} ({time.time() - t_start:.0f}s)")
        sets = None
        deadline = t_start + args.budget_s
        for n in pending:
            spec = specs[n]
            if time.time() > deadline - p["eval_reserve_s"]:
                log(f"budget spent before {n}; rerun the same command to continue")
                break
            done = train_run(n, spec, p, data, root, device, deadline - p["eval_reserve_s"])
            if not done:
                break
            if sets is None:
                sets = EvalSets(p, data)
            evaluate_run(n, spec, p, data, sets, root, device)
        left = [n for n in todo if not (root / n / RESULT_FILE).is_file()]
        log(f"finished this call in {time.time() - t_start:.0f}s; still pending: {', '.join(left) or 'none'}")
    return report(root, p, args.tiny, device)


if __name__ == "__main__":
    sys.exit(main())
