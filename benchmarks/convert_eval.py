"""The conversion study on Qwen2.5-Coder-0.5B (docs/convert.md): kernels at its shapes, the index
warm-up and the evaluation table, on one GPU.

Stages (each a subcommand; `all` runs them in order):

  ops      the MSA ops at the model's shapes (14 query / 2 KV heads of 64, index dim 64; block 64
           top-8 and block 128 top-16; 4K and 32K tokens, bf16): the Triton kernels against the
           chunked PyTorch path (index_topk: the selected blocks' score mass; sparse_attention and
           index_kl_loss: max error), and the KL over all tokens (chunked path) time and memory.
  build    the HF folder from the GGUF (tools/qwen_checkpoint.py --work WORK: WORK holds the GGUF).
  warmup   `msakit convert --train index` per init (random, qk): index branch only, batch 1,
           KL over all causal tokens (--kl-tokens), block 0 forced (--init-blocks 1), files of
           4K tokens or more held out; the converted model saved per init.
  eval     `msakit eval` of the dense model (dense, last1024, window, window0, oracle, msa
           untrained) and of each warmed model (msa), lengths 4K-32K; then the table.
  selections  issue 28's real selections: the qk-initialised, selected-KL warm-up of each
           budget (block 64 top-8, block 128 top-16; run as in `warmup` when its model is not
           under --work), in sparse mode on held-out standard-library documents of 16K and 32K
           tokens: every layer's selection statistics (tools/bench/selection_stats.py) and the
           raw block_idx of four layers (int16 torch files, `selections_b<bs>_<T>_L<layer>.pt`).

    python benchmarks/convert_eval.py all --work DIR --out DIR [--tokens N] [--lengths 4096,...]
    python benchmarks/convert_eval.py selections --work DIR --out $OUT [--time-budget 70]

Writes convert_eval_<gpu>.json (every stage's numbers, the table rows and the environment) and the
warmed index weights (index_<init>.safetensors, bf16: small enough to bring back, so that the
CPU can evaluate the same indexer) into --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import env_info, gpu_tag, save_json  # noqa: E402

QWEN = dict(Hq=14, G=2, D=64, Di=64)
BUDGETS = ((64, 8), (128, 16))
# files of at least this many tokens are held out of the warm-up's rows: every document the
# eval reads (>= its shortest length, 4K) is then unseen by the indexer
HELD_OUT_MIN = 4096
DEVICE = os.environ.get("MSAKIT_DEVICE", "cuda")  # "cpu" for a dry run of the script


def log(msg: str) -> None:
    print(f"[convert_eval {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _timed(row: dict, name: str, fn):
    """Run fn twice, synchronised; record the first call (compilation included) and the second."""
    out = None
    for tag in ("first", "second"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        row[f"{name}_{tag}_s"] = round(time.perf_counter() - t0, 4)
        log(f"  {name} {tag} call {row[f'{name}_{tag}_s']:.3f}s")
    return out


def stage_ops(lengths=(4096, 32768)) -> list[dict]:
    """Kernels vs the chunked path at the model's shapes; every op's first and second call timed
    (and logged at once, so that a slow compilation or a hang shows which op it is)."""
    from msakit import ops
    from msakit.ops.index_kl.chunked import index_kl_loss_chunked
    from msakit.ops.sparse_attention.chunked import sparse_attention_chunked

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in lengths:
        for bs, k in BUDGETS:
            Hq, G, D, Di = QWEN["Hq"], QWEN["G"], QWEN["D"], QWEN["Di"]
            q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
            kk = torch.randn(1, T, G, D, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(1, T, G, D, device="cuda", dtype=torch.bfloat16, generator=g)
            qi = torch.randn(1, T, G, Di, device="cuda", dtype=torch.bfloat16, generator=g)
            ki = torch.randn(1, T, Di, device="cuda", dtype=torch.bfloat16, generator=g)
            row = dict(T=T, block_size=bs, topk=k)
            log(f"ops T={T} block {bs} top-{k}")
            try:
                sel = dict(block_size=bs, topk=k, local_blocks=1, init_blocks=1)
                bi = _timed(row, "index_topk", lambda: ops.index_topk(qi, ki, **sel))
                if T <= 8192:
                    ref = _timed(row, "index_topk_reference", lambda: ops.index_topk(qi, ki, **sel, backend="reference"))
                    row["topk_same_sets"] = float((bi.sort(-1).values == ref.sort(-1).values).all(-1).float().mean())
                o = _timed(row, "sparse_attention", lambda: ops.sparse_attention(q, kk, v, bi, block_size=bs))
                oc = _timed(row, "sparse_attention_chunked", lambda: sparse_attention_chunked(q, kk, v, bi, block_size=bs))
                row["sparse_attention_max_err"] = float((o.float() - oc.float()).abs().max())
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, v))
                _timed(row, "sparse_attention_fwd_bwd",
                       lambda: ops.sparse_attention(qg, kg, vg, bi, block_size=bs).float().square().mean().backward())
                qi_g, ki_g = qi.clone().requires_grad_(), ki.clone().requires_grad_()
                kl = _timed(row, "index_kl_fwd_bwd", lambda: _fwd_bwd(ops.index_kl_loss(q, kk, qi_g, ki_g, bi, block_size=bs)))
                klc = _timed(row, "index_kl_chunked", lambda: index_kl_loss_chunked(q, kk, qi, ki, bi, block_size=bs))
                row["index_kl"] = float(kl)
                row["index_kl_rel_err"] = float((kl.float() - klc.float()).abs() / klc.float().abs().clamp_min(1e-12))
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                _timed(row, "kl_all_fwd_bwd",
                       lambda: _fwd_bwd(ops.index_kl_loss(q, kk, qi_g, ki_g, None, block_size=bs, over="all")))
                row["kl_all_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                row["ok"] = bool(row["sparse_attention_max_err"] < 0.05 and row["index_kl_rel_err"] < 1e-2
                                 and row.get("topk_same_sets", 1.0) > 0.99)
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                row["ok"] = False
            log(json.dumps(row))
            rows.append(row)
            del q, kk, v, qi, ki
            torch.cuda.empty_cache()
    return rows


def _fwd_bwd(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def run(cmd: list[str], timeout: float, log_file: Path | None = None) -> dict:
    """Run `cmd`, streaming its output line by line (and into `log_file`); past `timeout` the child
    gets SIGABRT first, so that its faulthandler prints where it was, then SIGKILL."""
    log("$ " + " ".join(cmd))
    t0 = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    fh = log_file.open("a") if log_file else None

    def stop() -> None:  # SIGABRT: the child's faulthandler prints its stack; then kill
        p.send_signal(signal.SIGABRT)
        time.sleep(5)
        p.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    try:
        for line in p.stdout:
            print(line, end="", flush=True)
            lines.append(line)
            if fh:
                fh.write(line)
                fh.flush()
        p.wait()
    finally:
        timer.cancel()
        if fh:
            fh.close()
    tail = "".join(lines)[-3000:]
    return dict(cmd=cmd, rc=p.returncode, seconds=time.time() - t0, tail=tail[-1500:])


def stage_build(work: Path) -> dict:
    out = work / "qwen2.5-coder-0.5b-instruct"
    return dict(folder=str(out), **run([sys.executable, "tools/qwen_checkpoint.py", "--out", str(out), "--work",
                                        str(work / "downloads")], 900, None))


def stage_warmup(work: Path, out: Path, tokens: int, context: int, budget: tuple[int, int], inits: list[str],
                 lr: float, time_budget: float, kl_tokens: str = "all") -> list[dict]:
    src = work / "qwen2.5-coder-0.5b-instruct"
    res = []
    bs, k = budget
    for init in inits:
        run_dir = work / warm_name(init, kl_tokens, bs)
        cmd = [sys.executable, "-m", "msakit", "convert", str(src), "--out", str(run_dir), "--train", "index",
               "--index-init", init, "--init-blocks", "1", "--kl-tokens", kl_tokens, "--block-size", str(bs),
               "--topk", str(k), "--context", str(context), "--long-min-tokens", str(HELD_OUT_MIN), "--batch-size", "1",
               "--max-tokens", str(tokens), "--max-train-tokens", str(tokens), "--eval-rows", "2", "--time-budget", str(time_budget), "--index-lr", str(lr),
               "--device", DEVICE, "--dtype", "bfloat16", "--no-progress", "--log-every", "2"]
        r = run(cmd, time_budget + 300, out / f"log_{run_dir.name}.txt")
        r.update(init=init, kl_tokens=kl_tokens, name=run_dir.name, run_dir=str(run_dir), model=str(run_dir / "model"))
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            r["metrics"] = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()][-40:]
        res.append(r)
    return res


def stage_eval(work: Path, out: Path, lengths: str, samples: int, warmed: list[dict], budget: tuple[int, int],
               models: list[str], base_policies: str) -> list[dict]:
    bs, k = budget
    src = work / "qwen2.5-coder-0.5b-instruct"
    common = ["--tasks", "loss,passkey,niah,vt", "--lengths", lengths, "--depths", "0.1,0.5,0.9",
              "--budget", f"block{bs}-top{k}", "--samples", str(samples), "--seed", "0", "--device", DEVICE,
              "--dtype", "bfloat16", "--no-progress"]
    jobs = []
    if "base" in models:
        jobs.append((f"base_b{bs}", src, base_policies, ["--init-blocks", "1"]))  # warm-up names carry _b<bs> too
    jobs += [(w["name"], Path(w["model"]), "msa", []) for w in warmed
             if w.get("rc") == 0 and ("warm" in models or w["name"] in models)]
    res = []
    for name, model, policies, extra in jobs:
        eval_dir = work / f"eval_{name}"
        resume = ["--resume"] if (eval_dir / "results.jsonl").is_file() else []  # a cut call continues
        r = run([sys.executable, "-m", "msakit", "eval", "--model", str(model), "--policies", policies,
                 "--out", str(eval_dir), *common, *extra, *resume], 1800, out / f"log_{eval_dir.name}.txt")
        r["name"] = name
        summ = eval_dir / "summary.json"
        if summ.is_file():
            r["summary"] = json.loads(summ.read_text())
            for f in ("summary.json", "table.md", "results.jsonl", "plot.png"):
                if (eval_dir / f).is_file():
                    (out / f"{eval_dir.name}_{f}").write_bytes((eval_dir / f).read_bytes())
        res.append(r)
    return res


SELECTION_LENGTHS = (16384, 32768)
SELECTION_LAYERS = (0, 8, 16, 23)  # raw selections kept of these layers (Qwen2.5-0.5B has 24)


def stage_selections(work: Path, out: Path, tokens: int, time_budget: float, lr: float,
                     lengths=SELECTION_LENGTHS, layers=SELECTION_LAYERS) -> list[dict]:
    """Selections of the warmed Qwen model per budget and length: statistics of every layer, raw
    block_idx of `layers`.  A budget whose warm-up is missing under --work is warmed up first
    (qk init, KL over the selected tokens, 16K context, as in docs/convert.md's run 2)."""
    from tokenizers import Tokenizer

    from msakit.eval.documents import long_documents
    from msakit.eval.tasks import encoder
    from msakit.models.convert import MSAWrappedModel
    from tools.bench.selection_stats import selection_stats

    src = work / "qwen2.5-coder-0.5b-instruct"
    encode = encoder(Tokenizer.from_file(str(src / "tokenizer.json")))
    docs = {T: long_documents(encode, T, 1)[0] for T in lengths}
    res = []
    for bs, k in BUDGETS:
        model_dir = work / warm_name("qk", "selected", bs) / "model"
        row: dict = {"block_size": bs, "topk": k, "model": str(model_dir)}
        if not model_dir.is_dir():
            row["warmup"] = stage_warmup(work, out, tokens, 16384, (bs, k), ["qk"], lr, time_budget, "selected")
        if not model_dir.is_dir():
            row["error"] = "warm-up produced no model"
            res.append(row)
            continue
        model = MSAWrappedModel.from_pretrained(model_dir, device=DEVICE, dtype=torch.bfloat16).eval()
        model.set_attention_mode("sparse")
        for T in lengths:
            doc = docs[T]
            ids = torch.tensor([doc.ids], device=DEVICE)
            t0 = time.time()
            with torch.no_grad():
                outp = model(ids, compute_kl=False, return_attn_inputs=True)
            sels = [None if a is None else a.get("block_idx") for a in (outp.attn_inputs or [])]
            del outp
            stats = {}
            for layer, bi in enumerate(sels):
                if bi is None:
                    continue
                stats[layer] = selection_stats(bi, bs)
                if layer in layers:
                    torch.save({"block_idx": bi.to("cpu", torch.int16), "block_size": bs, "layer": layer,
                                "document": doc.name, "T": T}, out / f"selections_b{bs}_{T}_L{layer}.pt")
            row[str(T)] = {"document": doc.name, "seconds": time.time() - t0, "stats": stats}
            log(f"selections b{bs} T={T}: {len(stats)} layers, jaccard "
                f"{[round(s['jaccard']['mean'], 3) for s in stats.values()]}")
            del sels
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
        res.append(row)
    return res


def warm_name(init: str, kl_tokens: str, block_size: int) -> str:
    """The warm-up run's folder name under --work: warm_<init>_<kl tokens>_b<block size>."""
    return f"warm_{init}_{kl_tokens}_b{block_size}"


def export_index(warmed: list[dict], out: Path) -> None:
    """The warmed index weights (bf16) for the CPU evaluation."""
    from safetensors.torch import load_file, save_file

    for w in warmed:
        folder = Path(w["model"])
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            tensors.update({n: t for n, t in load_file(str(f)).items() if ".self_attn.index_" in n})
        if tensors:
            save_file({n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()},
                      str(out / f"index_{w['name']}.safetensors"))
            cfg = folder / "config.json"
            if cfg.is_file():
                (out / f"index_{w['name']}_config.json").write_text(cfg.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("ops", "build", "warmup", "eval", "selections", "all"))
    ap.add_argument("--work", type=Path, default=Path("~/msakit_convert").expanduser())
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/convert_eval")))
    ap.add_argument("--tokens", type=int, default=2_000_000, help="warm-up tokens per init")
    ap.add_argument("--context", type=int, default=4096, help="warm-up sequence length")
    ap.add_argument("--time-budget", type=float, default=150.0, help="warm-up seconds per init")
    ap.add_argument("--index-lr", type=float, default=1e-3)
    ap.add_argument("--kl-tokens", default="all", choices=("all", "selected"), help="the warm-up's KL tokens")
    ap.add_argument("--inits", default="random,qk")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--budget", default="64,8")
    ap.add_argument("--models", default="base,warm",
                    help="what the eval stage evaluates: base, warm (every warm-up of the budget) or warm-up names")
    ap.add_argument("--base-policies", default="dense,last1024,window0,window,oracle,msa",
                    help="the policies of the base model's eval")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    budget = tuple(int(x) for x in args.budget.split(","))
    result: dict = dict(env=env_info(), budget=budget, args={k: str(v) for k, v in vars(args).items()})
    path = args.out / f"convert_eval_{gpu_tag()}_{args.stage}.json"
    stages = ["ops", "build", "warmup", "eval"] if args.stage == "all" else [args.stage]
    try:
        for st in stages:
            t0 = time.time()
            if st == "ops":
                faulthandler.dump_traceback_later(60, repeat=True)  # a hang shows where it is
                try:
                    result["ops"] = stage_ops()
                finally:
                    faulthandler.cancel_dump_traceback_later()
            elif st == "build":
                result["build"] = stage_build(args.work)
            elif st == "warmup":
                result["warmup"] = stage_warmup(args.work, args.out, args.tokens, args.context, budget,
                                                args.inits.split(","), args.index_lr, args.time_budget, args.kl_tokens)
                export_index(result["warmup"], args.out)
            elif st == "selections":
                if not (args.work / "qwen2.5-coder-0.5b-instruct").is_dir():
                    result["build"] = stage_build(args.work)
                result["selections"] = stage_selections(args.work, args.out, args.tokens, args.time_budget,
                                                        args.index_lr)
            elif st == "eval":
                warmed = result.get("warmup")
                if warmed is None:  # every warm-up of this block size found under --work
                    warmed = [dict(name=d.name, rc=0, model=str(d / "model"))
                              for d in sorted(args.work.glob(f"warm_*_b{budget[0]}")) if (d / "model").is_dir()]
                result["eval"] = stage_eval(args.work, args.out, args.lengths, args.samples, warmed, budget,
                                            args.models.split(","), args.base_policies)
            result.setdefault("seconds", {})[st] = time.time() - t0
    finally:
        save_json(path, result)
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
