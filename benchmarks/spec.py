"""DSpark speculative decoding end to end (issue: DSpark drafter and lossless speculative decoding).

1. Data: the Python standard library corpus (msakit.train: BPE tokenizer on part of the training
   files, hash split); held-out = the validation files (never trained on).
2. Target: an M3 "small" model (hidden 512, 8 layers, MSA + MoE) trained with msakit's trainer
   (full-attention warm-up, then sparse attention with the indexer KL) for a time budget and at
   most 4 epochs of the training split, or one
   loaded with --target (a run / checkpoint / model folder with tokenizer.json).
3. Drafters: DSpark (2 layers, Markov head rank 256, confidence head) for a time budget and the
   same drafter without the Markov head (the paper's ablation) for the same number of steps,
   against the frozen target (loss 0.1 CE + 0.9 TV + 1.0 BCE, exp(-k/4) position weights), on
   the corpus mixed with rows the target wrote itself (60% of the rows; a pool of 4096 rows from
   128-token prompts, half sampled at T 1, half greedy; --no-pool: corpus only).
4. Accepted length (tokens per verify step and row, bonus included) on held-out prompts with a
   block of 7 at temperature 0 and 1, for both drafters, with and without the confidence budget
   (DSpark's scheduler with the round cost profiled on this machine: fixed + per verified position).
5. Wall-clock tokens/s of speculative decoding against plain decoding at batch 1 and 8 (both
   temperatures): plain = `model.generate` (msakit.generate's KV-cached loop) and, for reference,
   plain decoding through the speculative engine's own cache / attention code (g = 0).

Bars: the Markov head raises the accepted length at temperature 1; speculative >= 2x plain
tokens/s at batch 1 on the H200.

    python benchmarks/spec.py                   # H200: ~7 minutes (--budget-s, default 400)
    python benchmarks/spec.py --tiny            # CPU smoke run, a few minutes
    python benchmarks/spec.py --target runs/train --budget-s 300
    python benchmarks/spec.py --recipe run17 --speed-batches 1   # run 17's training, step for step
    python benchmarks/spec.py --quick                             # GPU smoke run (~1.5 min)

Writes benchmarks/results/spec_<device>.json (and $OUT/ when set) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_run_args, env_info, gpu_tag, save_json  # noqa: E402
from msakit.generate import generate  # noqa: E402
from msakit.models import M3Config, M3ForCausalLM  # noqa: E402
import msakit.speculative as speculative  # noqa: E402
from msakit.speculative import DSparkConfig, DSparkDrafter, speculative_generate  # noqa: E402
from msakit.speculative.train import DrafterTrainConfig, DrafterTrainer, mix_streams, regenerate_pool  # noqa: E402
from msakit.train.data import PackedRows  # noqa: E402

# Step-matched recipes: the steps and sizes a reference run reached (its phases were fitted to
# time budgets), so a later run trains the same amount whatever its speed.
RECIPES = {
    # run 17: target 358 steps (133 dense warm-up), pool 2048 rows, DSpark 1597 steps, no ablation
    "run17": dict(target_steps=358, dense_warmup_steps=133, pool_rows=2048, drafter_steps=1597, no_ablation=True,
                  budgets="off"),
    # smoke run: the same pipeline, a fraction of the training (its speedups are not comparable)
    "quick": dict(target_steps=80, dense_warmup_steps=30, pool_rows=256, drafter_steps=200, no_ablation=True,
                  budgets="off", speed_batches=[1], speed_reps=2),
}

PRESETS = {
    # CPU smoke run: a very small target, short rows, few tokens
    "tiny": dict(target=dict(preset="tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, index_head_dim=16, rotary_dim=8,
                             dense_intermediate_size=128, intermediate_size=64, shared_intermediate_size=64,
                             index_block_size=16, index_topk_blocks=4),
                 drafter="tiny", vocab=512, context=128, tok_files=150, train_tokens=300_000, val_tokens=60_000,
                 target_batch=8, target_epochs=50.0, target_lr=3e-3, drafter_batch=4, anchors=16, drafter_lr=2e-3,
                 pool_rows=16, pool_share=0.5, pool_prompt=32, pool_batch=16, prompts=8, prompt_len=32, new_tokens=32,
                 reserve_s=150.0, budget_s=300.0),
    # H200: the "small" target (hidden 512, 8 layers, 16 experts top-4 + 1 shared), a 2-layer drafter
    "gpu": dict(target=dict(preset="small"), drafter="small", vocab=4096, context=512, tok_files=600,
                train_tokens=12_000_000, val_tokens=400_000, target_batch=32, target_epochs=4.0, target_lr=2e-3, drafter_batch=16,
                anchors=64, drafter_lr=1.5e-3, pool_rows=4096, pool_share=0.6, pool_prompt=128, pool_batch=512, prompts=32,
                prompt_len=128, new_tokens=128, reserve_s=110.0, budget_s=400.0),
}


def log(*a) -> None:
    print(*a, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(dev: torch.device, fn) -> float:
    """Wall seconds of one fn() between two device syncs (host work included; CPU too)."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# data and models
# ---------------------------------------------------------------------------------------------


def load_data(p: dict, tokenizer=None):
    from msakit.train.corpus import build_corpus
    from msakit.train.data import encode_files
    from msakit.train.tokenizer import train_tokenizer

    t0 = time.time()
    corpus = build_corpus(val_fraction=0.02)
    tok = tokenizer or train_tokenizer(corpus.train[: p["tok_files"]], p["vocab"])
    tr = encode_files(tok, corpus.train, max_tokens=p["train_tokens"], long_min_tokens=0)
    va = encode_files(tok, corpus.val, max_tokens=p["val_tokens"], long_min_tokens=0)
    info = dict(vocab=tok.vocab_size, train_tokens=len(tr), val_tokens=len(va), val_files=va.num_docs,
                prep_s=round(time.time() - t0, 1))
    return tok, PackedRows(tr, p["context"], tok.eos_id), PackedRows(va, p["context"], tok.eos_id), va, info


def heldout_prompts(stream, n: int, length: int, min_rest: int) -> torch.Tensor:
    """The first `length` tokens of up to n held-out files with at least `min_rest` more tokens."""
    out = []
    starts = stream.doc_starts
    for d in range(stream.num_docs):
        a, b = int(starts[d]), int(starts[d + 1])
        if b - a >= length + min_rest:
            out.append(torch.from_numpy(stream.tokens[a:a + length].astype("int64")))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"no held-out file has {length + min_rest} tokens")
    while len(out) < n:  # few long files: reuse with a shifted window
        out.append(out[len(out) % max(1, len(out))].roll(1))
    return torch.stack(out)


def train_target(p: dict, tok, train_rows, val_rows, dev, seconds: float, work: Path, *, steps: int | None = None,
                 dense_warmup_steps: int | None = None) -> tuple[M3ForCausalLM, dict]:
    """Trains the target for `seconds` (steps fitted to the pace; dense warm-up a third), or for
    exactly `steps` with `dense_warmup_steps` when given (a step-matched recipe)."""
    from msakit.train.trainer import TrainConfig, Trainer

    spec = dict(p["target"])
    preset = spec.pop("preset")
    cfg = M3Config.preset(preset, vocab_size=tok.vocab_size, **spec)
    torch.manual_seed(0)
    model = M3ForCausalLM(cfg)
    fixed = steps is not None
    tc = TrainConfig(steps=steps or 10**6, batch_size=p["target_batch"], lr=p["target_lr"], lr_warmup_steps=30,
                     dense_warmup_steps=((steps // 3 if dense_warmup_steps is None else dense_warmup_steps)
                                         if fixed else 10**6), log_every=10**6, eval_every=10**6, save_every=10**6,
                     eval_rows=32, recall_rows=0, keep_checkpoints=0)
    tr = Trainer(model, tc, train_rows, val_rows, out_dir=work / "target", device=dev, tokenizer=tok, progress=False)
    # at most p["target_epochs"] passes over the training split: more and the target memorizes
    # it (run 14: 8 epochs, train loss 0.77 against val 2.27), and a drafter trained on the
    # same rows then learns the data rather than the target's behaviour on new text
    max_steps = max(10, int(p["target_epochs"] * len(train_rows) / p["target_batch"]))
    t0 = time.time()
    marks: list[tuple[int, float]] = []
    switched = False
    while True:
        rec = tr.train_step()
        el = time.time() - t0
        marks.append((tr.step, el))
        if not fixed and (tr.step == 4 or (tr.step > 4 and tr.step % 10 == 0)):
            a = marks[max(1, len(marks) - 50)]  # recent pace (the first steps compile kernels)
            per = (el - a[1]) / max(1, tr.step - a[0])
            tc.steps = max(tr.step + 1, min(max_steps, tr.step + int((seconds - el) / max(per, 1e-6))))
            if not switched:
                tc.dense_warmup_steps = max(tr.step, tc.steps // 3)
        if not switched and tr.step >= tc.dense_warmup_steps:
            switched = True
        if tr.step % max(1, tc.steps // 8) == 0:
            log(f"  [target] step {tr.step}/{tc.steps} loss {rec['loss']:.3f} kl {rec['kl']:.3f} {rec['mode']} "
                f"{el:.0f}s")
        if tr.step >= tc.steps or (not fixed and el > 1.05 * seconds):
            break
    ev = tr.evaluate(mode="sparse")
    info = dict(preset=preset, params=sum(x.numel() for x in model.parameters()), steps=tr.step,
                dense_warmup_steps=tc.dense_warmup_steps, train_s=round(time.time() - t0, 1),
                final_train_loss=rec["loss"], val_loss=ev["loss"], val_kl=ev["kl"])
    log(f"  target: {info}")
    model.set_attention_mode("sparse")
    return model.eval(), info


def load_target(path: str, dev):
    from msakit.train import checkpoint as ckpt_mod
    from msakit.train.tokenizer import Tokenizer

    src = Path(path)
    folder = ckpt_mod.find_checkpoint(src) or src
    model = M3ForCausalLM.from_pretrained(folder, device=dev)
    for cand in (folder / "tokenizer.json", src / "tokenizer.json"):
        if cand.is_file():
            return model.eval(), Tokenizer.load(cand), str(folder)
    raise FileNotFoundError(f"no tokenizer.json beside {path}")


def train_drafter(p: dict, target, markov: bool, train_rows, val_rows, dev, seconds: float | None, work: Path,
                  steps: int | None = None):
    over = {} if markov else {"markov_rank": 0}
    dcfg = DSparkConfig.for_target(target.config, p["drafter"], **over)
    torch.manual_seed(1)
    drafter = DSparkDrafter(dcfg)
    cfg = DrafterTrainConfig(steps=steps or 10**6, batch_size=p["drafter_batch"], anchors=p["anchors"], lr=p["drafter_lr"],
                             log_every=10**6, eval_every=10**6, eval_rows=16, save_every=10**6, keep_checkpoints=0)
    name = "dspark" if markov else "no_markov"
    tr = DrafterTrainer(target, drafter, cfg, train_rows, val_rows, out_dir=work / name, device=dev, progress=False)
    t0 = time.time()
    tr.fit(max_seconds=seconds)
    ev = tr.evaluate()
    last = tr.history[-20:]
    info = dict(layers=dcfg.num_hidden_layers, taps=dcfg.target_layer_ids, markov_rank=dcfg.markov_rank,
                params=sum(x.numel() for x in drafter.parameters()), steps=tr.step,
                train_s=round(time.time() - t0, 1),
                final_train_loss=sum(r["loss"] for r in last) / len(last),
                val_loss=ev.get("loss"), val_alpha=ev.get("alpha"), val_top1=ev.get("top1"),
                val_implied_accept_len_t1=ev.get("accept_len"))
    log(f"  drafter {name}: steps {tr.step}, val loss {info['val_loss']:.4f}, implied accepted length (T=1, "
        f"teacher-forced) {info['val_implied_accept_len_t1']:.2f}, alpha {info['val_alpha']}")
    return drafter.eval(), info


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------


def prefilled_cache(target, drafter, prompt: torch.Tensor, dev):
    """A speculative cache after the prompt [B, T] (target keys, the drafter's context), with
    room for a few rounds past it."""
    from msakit.speculative.generate import SpecCache, draft_context_update, target_forward

    B, T = prompt.shape
    drafter.bind(target)
    cache = SpecCache(target.config.num_hidden_layers, drafter.config.num_hidden_layers, B,
                      T + 4 * (drafter.config.draft_block_size + 2), dev)
    _, tap = target_forward(target, cache, prompt, drafter.config.target_layer_ids)
    draft_context_update(drafter, cache, tap)
    cache.set_lengths(torch.full((B,), T, device=dev), [T] * B)
    return cache


@torch.no_grad()
def profile_round_cost(target, drafter, prompts: torch.Tensor, dev, reps: int = 5) -> tuple[float, float]:
    """(fixed, per verified position) seconds of a speculative round at this batch size: the
    drafter block + a target forward over B * w positions, timed at w = 1 and w = g + 1."""
    from msakit.speculative.generate import draft_hidden, target_forward

    B = prompts.shape[0]
    g = drafter.config.draft_block_size
    cache = prefilled_cache(target, drafter, prompts, dev)
    anchor = prompts[:, -1]

    def one_round(w: int) -> None:
        h = draft_hidden(drafter, cache, anchor)
        prop = drafter.propose(h, anchor, temperature=1.0)
        target_forward(target, cache, torch.cat([anchor.view(B, 1), prop.tokens[:, : w - 1]], 1),
                       drafter.config.target_layer_ids)

    def run(w: int) -> float:
        times = [timed(dev, lambda: one_round(w)) for _ in range(reps)]
        times.sort()
        return times[len(times) // 2]

    run(g + 1)  # warm-up
    t1, tw = run(1), run(g + 1)
    per = max(0.0, (tw - t1) / (B * g))
    return max(0.0, t1 - per * B), per


@torch.no_grad()
def acceptance(target, drafter, prompts, p, dev, *, temperature: float, budget: bool, cost, seed: int = 0) -> dict:
    bs = 16 if dev.type == "cuda" else 4
    tot = dict(tokens=0, row_rounds=0, accepted=0, verified=0)
    pos_acc = None
    pos_try = None
    t0 = time.time()
    for i in range(0, prompts.shape[0], bs):
        pr = prompts[i:i + bs].to(dev)
        _, st = speculative_generate(target, drafter, pr, p["new_tokens"], temperature=temperature,
                                     generator=torch.Generator().manual_seed(seed + i), confidence_budget=budget,
                                     budget_cost=cost, return_stats=True)
        tot["tokens"] += st.tokens
        tot["row_rounds"] += st.row_rounds
        tot["accepted"] += st.accepted_drafts
        tot["verified"] += st.verified_drafts
        pos_acc = st.position_accepts if pos_acc is None else [a + b for a, b in zip(pos_acc, st.position_accepts)]
        pos_try = st.position_tries if pos_try is None else [a + b for a, b in zip(pos_try, st.position_tries)]
    return dict(accepted_length=tot["tokens"] / max(1, tot["row_rounds"]),
                drafts_verified_per_round=tot["verified"] / max(1, tot["row_rounds"]),
                acceptance_rate=tot["accepted"] / max(1, tot["verified"]),
                position_acceptance=[round(a / t, 4) if t else None for a, t in zip(pos_acc, pos_try)],
                rounds=tot["row_rounds"], seconds=round(time.time() - t0, 2))


@torch.no_grad()
def speed(target, drafter, prompts, p, dev, *, batch: int, temperature: float, reps: int) -> dict:
    """Tokens/s of plain decoding (`model.generate`: paged KV cache, CUDA-graphed step; and the
    speculative engine's own plain loop) and of speculative decoding, over whole generations:
    each method generates m = 2 and n tokens from the same prompt and seed, decode tok/s =
    B (n - m) / (t(n) - t(m)), which removes the prefill and the one-time CUDA-graph captures of
    a call (an engine captures once, not per request) but keeps every round of the generation;
    summed over `reps` batches of held-out prompts (the acceptance phase's prompts and n).
    End-to-end tok/s of the n-token calls (prefill and captures included) are reported too.
    (Run 15 timed t(2n) - t(n), the second half of 2n-token generations only: greedy text of a
    small target loops there, so its accepted length, 6.7, was not the generation's, 2.5.)"""
    n, m = p["new_tokens"], 2
    res = {"batch": batch, "temperature": temperature, "new_tokens": n, "fixed_cost_tokens": m, "reps": reps}
    gen = lambda r: torch.Generator(device=dev).manual_seed(r)  # noqa: E731  (no per-token host copies)

    stats = []

    def spec(pr, k, r):
        _, st = speculative_generate(target, drafter, pr, k, temperature=temperature, generator=gen(r), return_stats=True)
        if k == n:
            stats.append(st)

    methods = {"plain": lambda pr, k, r: generate(target, pr, k, temperature=temperature, generator=gen(r))}
    engine = getattr(speculative, "autoregressive_generate", None)  # the engine's own plain loop, where it has one
    if engine is not None:
        methods["plain_engine"] = lambda pr, k, r: engine(target, pr, k, temperature=temperature, generator=gen(r))
    methods["spec"] = spec
    dt = {k: 0.0 for k in methods}
    tn = {k: 0.0 for k in methods}
    for r in range(reps):
        pr = prompts[(r * batch) % prompts.shape[0]:][:batch]
        if pr.shape[0] < batch:
            pr = prompts[:batch]
        pr = pr.to(dev)
        for name, fn in methods.items():
            if r == 0:  # warm-up at both lengths: kernels, cuDNN plans and autotuning per shape (the
                fn(pr, m, r)  # cache length depends on the request), kept out of the timed calls; run 16
                fn(pr, n, r)  # warmed up another length only and its t(n) - t(m) came out too small
            t_m = timed(dev, lambda: fn(pr, m, r))
            t_n = timed(dev, lambda: fn(pr, n, r))
            dt[name] += t_n - t_m
            tn[name] += t_n
    for name in methods:
        # (a non-positive difference -- possible only on a noisy CPU run -- is reported as NaN)
        res[f"{name}_tok_s"] = reps * batch * (n - m) / dt[name] if dt[name] > 0 else float("nan")
        res[f"{name}_tok_s_e2e"] = reps * batch * n / tn[name]
    res["accepted_length"] = sum(st.tokens for st in stats) / sum(st.row_rounds for st in stats)
    res["plain_cache"] = "auto (paged + CUDA graph on CUDA)"
    res["speedup_vs_generate"] = res["spec_tok_s"] / res["plain_tok_s"]
    if "plain_engine" in methods:
        res["speedup_vs_same_engine"] = res["spec_tok_s"] / res["plain_engine_tok_s"]
    res["speedup_vs_generate_e2e"] = res["spec_tok_s_e2e"] / res["plain_tok_s_e2e"]
    res["ms_per_plain_token"] = 1e3 * batch / res["plain_tok_s"]
    res["ms_per_spec_round"] = 1e3 * batch * res["accepted_length"] / res["spec_tok_s"]
    log(f"  speed B={batch} T={temperature}: plain {res['plain_tok_s']:.1f} tok/s (engine "
        f"{res.get('plain_engine_tok_s', float('nan')):.1f}), spec {res['spec_tok_s']:.1f} tok/s -> {res['speedup_vs_generate']:.2f}x "
        f"(end to end {res['speedup_vs_generate_e2e']:.2f}x; accepted length {res['accepted_length']:.2f}; "
        f"round {res['ms_per_spec_round']:.2f} ms vs plain token {res['ms_per_plain_token']:.2f} ms)")
    return res


@torch.no_grad()
def round_breakdown(target, drafter, prompt: torch.Tensor, dev, reps: int = 30) -> dict:
    """Wall ms per call (CUDA-graph replays, launch included, synced) of the parts of a round at
    this batch: the drafter block with greedy drafts, the engine's target forward over w = 1 and
    w = g + 1 positions, the whole fused greedy round (replayed without advancing), and
    `model.generate`'s paged decode step over 1 and g + 1 new tokens."""
    from msakit.generate import PagedDecoder
    from msakit.speculative.generate import StaticRounds

    B, T = prompt.shape
    g = drafter.config.draft_block_size
    taps = drafter.config.target_layer_ids

    def per_call(fn) -> float:
        fn()
        fn()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        return 1e3 * (time.perf_counter() - t0) / reps

    kw = dict(temperature=0.0, top_k=None, top_p=None, num_drafts=g)
    rounds = StaticRounds(target, drafter, prefilled_cache(target, drafter, prompt, dev), taps, g, True,
                           dict(kw, want_confidence=False))
    anchor = prompt[:, -1]
    drafts = torch.zeros(B, g, dtype=torch.long, device=dev)
    out = {"batch": B, "context": T,
           "drafter_block_ms": per_call(lambda: rounds.draft(anchor)),
           "target_w1_ms": per_call(lambda: rounds.verify_forward(drafts[:, :0])),
           f"target_w{g + 1}_ms": per_call(lambda: rounds.verify_forward(drafts))}
    fused = StaticRounds(target, drafter, prefilled_cache(target, drafter, prompt, dev), taps, g, True, None)
    fused.fused_setup(kw, lambda logits: logits.float(), anchor, [True] * B)
    out["fused_round_ms"] = per_call(lambda: fused.run("round", fused._round))
    for nq in (1, g + 1):
        dec = PagedDecoder(target, B, T + (reps + 4) * nq + 8, cuda_graph=True)
        dec.prefill(prompt)
        new = prompt[:, -nq:]
        out[f"paged_step_nq{nq}_ms"] = per_call(lambda: dec.step(new))
    out["graphs_disabled"] = [x for x in (rounds.run.disabled_reason, fused.run.disabled_reason) if x]
    log(f"  round breakdown (B={B}, {T}-token context): " + ", ".join(
        f"{k} {v:.3f}" for k, v in out.items() if k.endswith("_ms")))
    return out


# ---------------------------------------------------------------------------------------------


def apply_recipe(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Fills the flags a recipe sets and the user left at their defaults (argparse's)."""
    if args.quick:
        args.recipe = args.recipe or "quick"
    if not args.recipe:
        return
    for key, value in RECIPES[args.recipe].items():
        if getattr(args, key) == ap.get_default(key):
            setattr(args, key, value)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (small everything)")
    ap.add_argument("--target", default=None, help="use this trained target (run / checkpoint / model folder)")
    ap.add_argument("--budget-s", type=float, default=None, help="total wall-clock budget in seconds")
    ap.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help="target attention mode at decode")
    ap.add_argument("--device", default=None)
    ap.add_argument("--work-dir", default=None, help="where runs are written (default: a temporary folder)")
    ap.add_argument("--no-pool", action="store_true", help="train the drafters on the corpus only (no regeneration)")
    ap.add_argument("--target-s", type=float, default=None,
                    help="seconds of target training (default: half of what the budget leaves)")
    ap.add_argument("--pool-rows", type=int, default=None, help="rows of the regeneration pool")
    ap.add_argument("--drafter-s", type=float, default=None,
                    help="seconds of DSpark training (default: half of what the budget leaves)")
    ap.add_argument("--no-ablation", action="store_true",
                    help="skip the drafter without the Markov head (its time goes to DSpark; no Markov bar)")
    ap.add_argument("--budgets", default="off,profiled,synthetic",
                    help="confidence-budget settings of the acceptance table (comma-separated)")
    ap.add_argument("--target-steps", type=int, default=None, help="train the target for exactly these steps")
    ap.add_argument("--dense-warmup-steps", type=int, default=None,
                    help="with --target-steps: full-attention steps first (default a third)")
    ap.add_argument("--drafter-steps", type=int, default=None, help="train DSpark for exactly these steps")
    ap.add_argument("--speed-batches", type=int, nargs="*", default=None, help="batch sizes of the speed table (1 8)")
    ap.add_argument("--speed-reps", type=int, default=None, help="prompt batches per speed row (B 1: 8, B 8: 2)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                    help="step-matched training of a reference run (explicit flags win); 'quick' = smoke run")
    add_run_args(ap, "= --recipe quick")
    args = ap.parse_args(argv)
    apply_recipe(args, ap)
    p = dict(PRESETS["tiny" if args.tiny else "gpu"])
    if args.pool_rows is not None:
        p["pool_rows"] = args.pool_rows
    budget = args.budget_s or p["budget_s"]
    T0 = time.time()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="msakit-spec-"))
    info = env_info()
    log(f"device {dev} ({info.get('gpu')}), budget {budget:.0f}s, work dir {work}")
    payload: dict = {"env": info, "preset": "tiny" if args.tiny else "gpu", "budget_s": budget, "mode": args.mode,
                     "recipe": {"name": args.recipe, "target_steps": args.target_steps,
                                "dense_warmup_steps": args.dense_warmup_steps, "pool_rows": p["pool_rows"],
                                "drafter_steps": args.drafter_steps}}
    if args.recipe == "run17":
        payload["recipe"]["differs_from_run17"] = (
            "step counts fixed from the start (run 17 fitted them to 50 s / 80 s budgets as it went, so its "
            "target's LR schedule was stretched while the step count was being fitted); seeds, data, sizes and "
            "the rest of the pipeline as run 17")
        log(f"recipe run17: {payload['recipe']['differs_from_run17']}")

    tok = None
    target = None
    if args.target:
        target, tok, folder = load_target(args.target, dev)
        payload["target"] = {"loaded": folder, "params": sum(x.numel() for x in target.parameters())}
        p["context"] = min(p["context"], target.config.max_position_embeddings)
    tok, train_rows, val_rows, val_stream, dinfo = load_data(p, tok)
    payload["data"] = dinfo
    log(f"data: {dinfo}")
    left = budget - (time.time() - T0) - p["reserve_s"]
    if target is None:
        t_s = args.target_s if args.target_s is not None else max(20.0, 0.5 * left)
        target, tinfo = train_target(p, tok, train_rows, val_rows, dev, t_s, work, steps=args.target_steps,
                                     dense_warmup_steps=args.dense_warmup_steps if args.target_steps else None)
        payload["target"] = tinfo
        left = budget - (time.time() - T0) - p["reserve_s"]
    for prm in target.parameters():
        prm.requires_grad_(False)
    # regeneration: a pool of rows written by the target (half T 1, half greedy), pool_share of
    # the drafter's training rows
    t_pool = time.time()
    drafter_rows = train_rows
    if p["pool_rows"] and not args.no_pool:
        target.set_attention_mode(args.mode)
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
        with amp:
            # half sampled at T 1 (no truncation), half greedy: the two regimes measured below
            pool = regenerate_pool(target, train_rows, p["pool_rows"], p["pool_prompt"], batch=p["pool_batch"],
                                   temperatures=(1.0, 0.0), top_k=None, top_p=None, device=dev)
        drafter_rows = PackedRows(mix_streams(train_rows.stream, pool, p["pool_share"]), train_rows.context,
                                  train_rows.pad_id)
        payload["regen_pool"] = dict(rows=p["pool_rows"], prompt_tokens=p["pool_prompt"], share=p["pool_share"],
                                     temperatures=[1.0, 0.0], seconds=round(time.time() - t_pool, 1))
        log(f"regeneration pool: {payload['regen_pool']}")
    left = budget - (time.time() - T0) - p["reserve_s"]
    # DSpark for half the remaining time (all of it with --no-ablation), then the ablation (no
    # Markov head) for the same number of steps
    drafters, dinfo = {}, {}
    d_s = args.drafter_s if args.drafter_s is not None else (left if args.no_ablation else 0.5 * left)
    drafters["dspark"], dinfo["dspark"] = train_drafter(p, target, True, drafter_rows, val_rows, dev,
                                                        None if args.drafter_steps else max(10.0, d_s), work,
                                                        steps=args.drafter_steps)
    if not args.no_ablation:
        drafters["no_markov"], dinfo["no_markov"] = train_drafter(p, target, False, drafter_rows, val_rows, dev,
                                                                  None, work, steps=dinfo["dspark"]["steps"])
    payload["drafters"] = dinfo

    # decode in bf16 on the GPU (both paths), the target in its MSA mode
    target.set_attention_mode(args.mode)
    if dev.type == "cuda":
        target.to(torch.bfloat16)
        for d in drafters.values():
            d.to(torch.bfloat16)
    prompts = heldout_prompts(val_stream, p["prompts"], p["prompt_len"], p["new_tokens"])
    payload["prompts"] = dict(count=prompts.shape[0], length=prompts.shape[1], new_tokens=p["new_tokens"])

    acc_rows = []
    bs_acc = 16 if dev.type == "cuda" else 4
    g = drafters["dspark"].config.draft_block_size
    wanted = args.budgets.split(",")
    costs = {}
    if "profiled" in wanted:  # the round cost only feeds the profiled confidence budget
        try:
            for B in (1, 8, bs_acc):
                costs[B] = profile_round_cost(target, drafters["dspark"], prompts[:B].to(dev), dev)
            payload["round_cost_s"] = {str(k): {"fixed": v[0], "per_position": v[1]} for k, v in costs.items()}
            log(f"round cost (fixed s, per verified position s): {payload['round_cost_s']}")
        except Exception as e:  # the engine's internals changed: the profiled budget is left out
            log(f"round cost profile failed ({e!r}): no 'profiled' confidence budget")
            payload["round_cost_s"] = {"error": repr(e)[:300]}
            wanted.remove("profiled")
    # confidence budget with the round cost profiled here, and with a synthetic cost under which
    # verifying every draft costs twice as much as verifying none (a loaded server's regime)
    budgets = {"off": None, "profiled": costs.get(bs_acc), "synthetic": (1.0, 1.0 / (bs_acc * (g + 1)))}
    budgets = {k: v for k, v in budgets.items() if k in wanted}
    for name, d in drafters.items():
        for temp in (0.0, 1.0):
            for bname, cost in budgets.items():
                r = acceptance(target, d, prompts, p, dev, temperature=temp, budget=cost is not None, cost=cost)
                r.update(drafter=name, temperature=temp, confidence_budget=bname)
                acc_rows.append(r)
                log(f"  accept {name:9s} T={temp} budget={bname:9s}: accepted length "
                    f"{r['accepted_length']:.3f} (drafts verified/round {r['drafts_verified_per_round']:.2f}) "
                    f"per position {r['position_acceptance']}")
    payload["acceptance"] = acc_rows
    out_name = f"spec_{gpu_tag(info)}{'_tiny' if args.tiny else ''}{args.tag}.json"
    save_json(out_name, dict(payload, partial=True), args.out)  # in case the speed phase runs out of time

    speed_rows = []
    for B in args.speed_batches or (1, 8):
        for temp in (0.0, 1.0):  # B = 1: 8 prompts (CPU: 2); B = 8: 16 prompts in two batches
            reps = args.speed_reps or ((8 if dev.type == "cuda" else 2) if B == 1 else 2)
            speed_rows.append(speed(target, drafters["dspark"], prompts, p, dev, batch=B, temperature=temp, reps=reps))
            payload["speed"] = speed_rows
            save_json(out_name, dict(payload, partial=True), args.out)
    if dev.type == "cuda":  # where a round's time goes (CUDA graphs); a diagnostic of the engine's parts
        payload["round_breakdown"] = []
        for B in args.speed_batches or (1, 8):
            try:
                payload["round_breakdown"].append(round_breakdown(target, drafters["dspark"], prompts[:B].to(dev), dev))
            except Exception as e:  # the engine's internals changed: report, keep the speed table
                log(f"  round breakdown B={B} failed: {e!r}")
                payload["round_breakdown"].append({"batch": B, "error": repr(e)[:300]})

    def acc_of(name, temp, bud="off"):
        return next(r["accepted_length"] for r in acc_rows
                    if r["drafter"] == name and r["temperature"] == temp and r["confidence_budget"] == bud)

    b1 = [r for r in speed_rows if r["batch"] == 1]
    payload["bars"] = {} if args.no_ablation else {
        "markov_raises_accepted_length_t1": acc_of("dspark", 1.0) > acc_of("no_markov", 1.0),
        "markov_gain_t1": acc_of("dspark", 1.0) / acc_of("no_markov", 1.0)}
    payload["bars"] |= {
        "speedup_b1_t0": next(r["speedup_vs_generate"] for r in b1 if r["temperature"] == 0.0),
        "speedup_b1_t1": next(r["speedup_vs_generate"] for r in b1 if r["temperature"] == 1.0),
        "speedup_e2e_b1_t0": next(r["speedup_vs_generate_e2e"] for r in b1 if r["temperature"] == 0.0),
        "speedup_e2e_b1_t1": next(r["speedup_vs_generate_e2e"] for r in b1 if r["temperature"] == 1.0),
    }
    payload["bars"]["speedup_b1_ge_2x"] = min(payload["bars"]["speedup_b1_t0"], payload["bars"]["speedup_b1_t1"]) >= 2.0
    payload["total_s"] = round(time.time() - T0, 1)

    log("\naccepted length (tokens per verify step, bonus included; block of 7; held-out prompts)")
    log(f"{'drafter':10s} {'T':>4s} {'budget':>9s} {'acc.len':>8s} {'verified/round':>15s}")
    for r in acc_rows:
        log(f"{r['drafter']:10s} {r['temperature']:4.1f} {r['confidence_budget']:>9s} {r['accepted_length']:8.3f} "
            f"{r['drafts_verified_per_round']:15.2f}")
    log("\nspeed (tokens/s)")
    log(f"{'B':>3s} {'T':>4s} {'plain':>9s} {'plain/eng':>10s} {'spec':>9s} {'speedup':>8s} {'acc.len':>8s}")
    for r in speed_rows:
        log(f"{r['batch']:3d} {r['temperature']:4.1f} {r['plain_tok_s']:9.1f} {r.get('plain_engine_tok_s', float('nan')):10.1f} "
            f"{r['spec_tok_s']:9.1f} {r['speedup_vs_generate']:7.2f}x {r['accepted_length']:8.2f}")
    log(f"\nbars: {payload['bars']}  (total {payload['total_s']}s)")
    path = save_json(out_name, payload, args.out)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
