"""`msakit train-drafter`: train a DSpark drafter (speculative decoding) for a trained target

Train a DSpark drafter against a frozen target: the target's tap-layer states are captured on the fly (no disk
cache), several anchored blocks per row, loss 0.1 CE + 0.9 TV + 1.0 BCE (confidence) with position weights
exp(-k/4). Logs metrics.jsonl, writes atomic checkpoints under OUT/checkpoints (each a drafter folder:
config.json + model.safetensors).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

from msakit.commands import command_parser

DEFAULT_STEPS = 1000
RESUME_OPTIONS = frozenset({"out", "resume", "steps", "time_budget", "tokenizer", "device", "no_progress", "cache_dir"})


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from msakit.train.run import NONNEG_INT, POS_FLOAT, POS_INT, SEED, Number, add_data_args, add_device_arg

    p = command_parser(subparsers, __doc__)
    p.add_argument("target", metavar="TARGET", help="the target: run folder (latest checkpoint), checkpoint or model folder")
    p.add_argument("--out", default="runs/drafter", metavar="DIR", help="run folder (default runs/drafter)")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CKPT",
                   help="continue the drafter run in --out (or from CKPT) with its recorded settings; only --steps "
                        "(to train further), --time-budget, --tokenizer, --device, --cache-dir and --no-progress "
                        "may be given with it")
    d = p.add_argument_group("drafter")
    d.add_argument("--size", choices=("tiny", "small", "full"), default="small",
                   help="draft layers: tiny 1, small 2, full 5 (the released M3.1 drafter's depth)")
    d.add_argument("--config", metavar="PATH", help="a DSpark config.json instead of a size preset")
    d.add_argument("--layers", type=POS_INT, default=None, metavar="N", help="number of draft layers (default: --size)")
    d.add_argument("--block-size", type=POS_INT, default=None, metavar="G", help="drafts per block (default 7)")
    d.add_argument("--markov-rank", type=NONNEG_INT, default=None, metavar="R",
                   help="Markov head rank (0 = no Markov head; default: the size preset's)")
    d.add_argument("--no-markov", action="store_true", help="no Markov head (the paper's ablation)")
    d.add_argument("--no-confidence", action="store_true", help="no confidence head")
    d.add_argument("--taps", default=None, metavar="L1,L2,...", help="target layers to tap (default: spread)")
    d.add_argument("--noise-token-id", type=NONNEG_INT, default=None, metavar="ID", help="mask token id (default vocab-1)")
    add_data_args(p, vocab=False)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=POS_INT, default=None, metavar="N", help=f"optimizer steps (default {DEFAULT_STEPS})")
    t.add_argument("--time-budget", type=POS_FLOAT, default=None, metavar="SECONDS",
                   help="fit the number of steps (and the LR schedule) into this many seconds")
    t.add_argument("--batch-size", type=POS_INT, default=8, metavar="N", help="rows per step")
    t.add_argument("--anchors", type=POS_INT, default=64, metavar="N", help="anchored blocks per row")
    t.add_argument("--lr", type=POS_FLOAT, default=6e-4, help="peak learning rate (AdamW)")
    t.add_argument("--warmup-frac", type=Number(float, 0, 1, hi_open=True), default=0.04, metavar="F",
                   help="share of the steps spent in the linear lr warm-up")
    t.add_argument("--grad-clip", type=Number(float, 0), default=1.0, help="gradient-norm clip (0 = no clipping)")
    t.add_argument("--weight-decay", type=Number(float, 0), default=0.0, help="AdamW weight decay")
    t.add_argument("--regenerate", action="store_true",
                   help="train on text the target writes itself (prefix kept; T 0.7, top-p 0.8, top-k 20)")
    t.add_argument("--regen-prompt-tokens", type=POS_INT, default=32, metavar="N",
                   help="prompt tokens kept from each corpus row when the target rewrites it")
    t.add_argument("--regen-pool", type=NONNEG_INT, default=0, metavar="ROWS",
                   help="before training, let the target write ROWS rows once (half T 0.7 / top-p 0.8 / top-k 20, "
                        "half greedy) and mix them into the corpus (saved as OUT/regen_pool.npz)")
    t.add_argument("--regen-share", type=Number(float, 0, 1, lo_open=True, hi_open=True), default=0.5, metavar="F",
                   help="share of rows from the pool")
    t.add_argument("--log-every", type=POS_INT, default=10, metavar="N", help="steps per metrics.jsonl record")
    t.add_argument("--eval-every", type=POS_INT, default=200, metavar="N", help="steps per evaluation")
    t.add_argument("--eval-rows", type=NONNEG_INT, default=16, metavar="N",
                   help="validation rows per evaluation (0 = no evaluation)")
    t.add_argument("--save-every", type=POS_INT, default=500, metavar="N", help="steps per checkpoint")
    t.add_argument("--keep", type=NONNEG_INT, default=2, metavar="N", help="checkpoints kept (0 = keep all)")
    t.add_argument("--seed", type=SEED, default=0, help="seed of the initialisation and the data order")
    add_device_arg(t)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
    return p


def _target_folder(path: Path) -> Path:
    from msakit.train.run import folder_kind, model_folder

    folder = model_folder(path, "target")
    if folder_kind(folder) == "drafter":
        raise ValueError(f"the target {path} is a DSpark drafter; pass the model the drafter is for")
    return folder


def _load_target(folder: Path, device):
    from msakit.models import M3ForCausalLM

    try:
        return M3ForCausalLM.from_pretrained(folder, device=device)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # safetensors errors on a damaged folder
        raise ValueError(f"cannot load the target in {folder}: {str(e).splitlines()[0]}") from None


def _tokenizer(args, folder: Path, target_arg: Path):
    from msakit.train.tokenizer import Tokenizer

    if args.tokenizer:
        return Tokenizer.load(args.tokenizer)
    for cand in (folder / "tokenizer.json", target_arg / "tokenizer.json"):
        if cand.is_file():
            return Tokenizer.load(cand)
    raise FileNotFoundError(f"no tokenizer.json beside the target {target_arg}; pass --tokenizer")


def _drafter_config(args, target_cfg):
    from msakit.speculative import DSparkConfig

    if args.config:
        cfg = DSparkConfig.from_pretrained(args.config)
    else:
        cfg = DSparkConfig.for_target(target_cfg, args.size)
    over: dict[str, Any] = {}
    if args.layers is not None:
        over["num_hidden_layers"] = args.layers
    if args.block_size is not None:
        over["block_size"] = args.block_size
    if args.markov_rank is not None:
        over["markov_rank"] = args.markov_rank
    if args.no_markov:
        over["markov_rank"] = 0
    if args.no_confidence:
        over["enable_confidence_head"] = False
    if args.taps:
        try:
            over["target_layer_ids"] = [int(x) for x in args.taps.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--taps must be comma-separated layer indices, got {args.taps!r}") from None
    if args.noise_token_id is not None:
        over["noise_token_id"] = args.noise_token_id
    cfg = cfg.replace(**over) if over else cfg
    cfg.check_target(target_cfg)
    return cfg


def _with_pool(args, meta: dict, target, rows, out: Path, device):
    """The training rows, with the target-written pool mixed in when the run uses one (written
    once and saved beside the run, so a resume sees the same rows)."""
    import numpy as np

    from msakit.speculative.train import mix_streams, regenerate_pool
    from msakit.train.data import PackedRows, TokenStream

    spec = meta.get("regen_pool")
    if not spec:
        return rows
    path = out / "regen_pool.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            pool = TokenStream(z["tokens"].astype(np.int32), z["doc_starts"].astype(np.int64),
                               [f"regen/{i}" for i in range(len(z["doc_starts"]) - 1)], [])
    else:
        if args.resume:
            raise FileNotFoundError(f"the run's regeneration pool {path} is missing; cannot resume the same run")
        print(f"regenerating {spec['rows']} rows with the target ...", flush=True)
        pool = regenerate_pool(target.to(device), rows, spec["rows"], spec["prompt_tokens"], device=device)
        out.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=pool.tokens, doc_starts=pool.doc_starts)
    return PackedRows(mix_streams(rows.stream, pool, spec["share"]), rows.context, rows.pad_id)


def _run(args: argparse.Namespace) -> int:
    import torch

    from msakit.speculative import DSparkConfig, DSparkDrafter
    from msakit.speculative.train import DrafterTrainConfig, DrafterTrainer
    from msakit.train.run import (DEFAULT_CONTEXT, check_context, check_data_options, check_new_out,
                                  check_resume_options, data_options, new_run_dir, open_resume, prepare)
    from msakit.train.trainer import resolve_device

    t0 = time.time()
    out = Path(args.out)
    device = resolve_device(args.device)
    if args.resume:
        check_resume_options(args, RESUME_OPTIONS)
        point = open_resume(args, out, DrafterTrainConfig.from_dict, drafter=True)
        if point is None:
            return 0
        ck, state, cfg = point
        meta = state.get("meta", {})
        target_path = Path(meta.get("target", args.target))
        folder = _target_folder(target_path)
        target = _load_target(folder, device)
        tok = _tokenizer(args, folder, target_path)
        pd = prepare(meta["data"], tokenizer=tok, cache_dir=args.cache_dir)
        drafter = DSparkDrafter(DSparkConfig.from_pretrained(ck))
        guard = contextlib.nullcontext()
    else:
        check_new_out(out, "drafter run")
        given = set(getattr(args, "given", ()))
        if "regen_share" in given and not args.regen_pool:
            raise ValueError("--regen-share applies to a --regen-pool only")
        if "regen_prompt_tokens" in given and not (args.regenerate or args.regen_pool):
            raise ValueError("--regen-prompt-tokens applies with --regenerate or --regen-pool only")
        target_path = Path(args.target)
        folder = _target_folder(target_path)
        target = _load_target(folder, device)
        # everything is validated before the (slower) data preparation
        dcfg = _drafter_config(args, target.config)
        tok = _tokenizer(args, folder, target_path)
        if tok.vocab_size > target.config.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the target's vocabulary is "
                             f"{target.config.vocab_size}")
        maxpos = target.config.max_position_embeddings
        context = args.context if args.context is not None else min(DEFAULT_CONTEXT, maxpos)
        check_context(target.config, context)
        opts = data_options(args, context)
        check_data_options(opts)
        cfg = DrafterTrainConfig(
            steps=args.steps if args.steps is not None else DEFAULT_STEPS, batch_size=args.batch_size,
            anchors=args.anchors, lr=args.lr, warmup_frac=args.warmup_frac, weight_decay=args.weight_decay,
            grad_clip=args.grad_clip, regenerate=args.regenerate, regen_prompt_tokens=args.regen_prompt_tokens,
            log_every=args.log_every, eval_every=args.eval_every, eval_rows=args.eval_rows,
            save_every=args.save_every, keep_checkpoints=args.keep, seed=args.seed)
        meta = {"target": str(target_path.resolve()), "data": opts}
        if args.regenerate or args.regen_pool:
            if not 1 <= args.regen_prompt_tokens < context:
                raise ValueError(f"--regen-prompt-tokens must be in [1, context={context}), got "
                                 f"{args.regen_prompt_tokens}")
        if args.regen_pool:
            meta["regen_pool"] = {"rows": args.regen_pool, "share": args.regen_share,
                                  "prompt_tokens": args.regen_prompt_tokens}
        guard = new_run_dir(out, "drafter run")
    with guard:  # a fresh run that fails before its first checkpoint leaves nothing behind
        if not args.resume:
            pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
            torch.manual_seed(args.seed)
            drafter = DSparkDrafter(dcfg)
        train_rows = _with_pool(args, meta, target, pd.train, out, device)
        trainer = DrafterTrainer(target, drafter, cfg, train_rows, pd.val, out_dir=out, device=device, tokenizer=tok,
                                 progress=not args.no_progress, meta=meta)
        if args.resume:
            trainer.resume(ck)
            print(f"resumed {ck} at step {trainer.step}")
        dc = drafter.config
        n = sum(p.numel() for p in drafter.parameters())
        print(f"drafter: {n / 1e6:.2f}M parameters, {dc.num_hidden_layers} layers, taps {dc.target_layer_ids}, "
              f"block {dc.block_size}, Markov rank {dc.markov_rank}; target {folder} on {trainer.device}; "
              f"{cfg.steps} steps x {cfg.batch_size} rows x {cfg.anchors} anchors", flush=True)
        trainer.fit(max_seconds=args.time_budget)
    ev = trainer.last_eval or {}
    last = trainer.history[-1] if trainer.history else {}
    msg = f"done: step {trainer.step}"
    if "loss" in last:
        msg += f", loss {last['loss']:.4f}"
    if ev:
        msg += f", val loss {ev.get('val_loss', float('nan')):.4f}, implied accepted length (T=1) " \
               f"{ev.get('val_accept_len', float('nan')):.2f}"
    print(msg + f" ({time.time() - t0:.0f}s); checkpoints in {out / 'checkpoints'}")
    print(f"speculative generation: msakit generate {target_path} --drafter {out}")
    return 0
