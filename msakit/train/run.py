"""What `msakit train`, `msakit convert` and `msakit generate` do (argument groups + entry points).

Every user error (missing or unreadable data, a corrupt or mismatching checkpoint, an unsupported
config, an empty corpus, a context beyond the model's positions, an output folder that already
holds a run) is raised as ValueError / FileNotFoundError / PermissionError before anything is
written, so the CLI prints one line and exits with status 2 and nothing is overwritten.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from msakit.train.corpus import DEFAULT_LONG_MIN_TOKENS, DEFAULT_VAL_FRACTION

DEFAULT_CONTEXT = 512


# ----------------------------------------------------------------------------- argument groups
def add_data_args(p: argparse.ArgumentParser, *, vocab: bool = True) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="PATH", default=None,
                   help="extra files or folders for the corpus (beside the standard library's sources)")
    g.add_argument("--no-stdlib", action="store_true", help="leave Python's standard library out of the corpus")
    if vocab:
        g.add_argument("--vocab-size", type=int, default=4096, metavar="N", help="BPE vocabulary size (default 4096)")
    g.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer.json instead of training one")
    g.add_argument("--context", type=int, default=None, metavar="N", help=f"tokens per row (default {DEFAULT_CONTEXT})")
    g.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
                   help="share of files (by path hash) held out for validation (default 0.02)")
    g.add_argument("--long-min-tokens", type=int, default=DEFAULT_LONG_MIN_TOKENS, metavar="N",
                   help="files with at least N tokens are held out for long-context evaluation (default 32768)")
    g.add_argument("--max-train-tokens", type=int, default=None, metavar="N",
                   help="encode only the first N training tokens (of the hash-shuffled files)")
    g.add_argument("--cache-dir", metavar="DIR", help="tokenizer / token cache (default $MSAKIT_CACHE or ~/.cache/msakit)")


def add_optim_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    d = {**_OPTIM_DEFAULTS, **defaults}
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, metavar="N", help=f"optimizer steps (default {d['steps']})")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], metavar="N", help="rows per step")
    g.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, metavar="F", help="final lr / peak lr (cosine)")
    g.add_argument("--lr-warmup-steps", type=int, default=d["lr_warmup_steps"], metavar="N", help="linear lr warm-up")
    g.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help="full-attention warm-up steps before sparse attention is switched on "
                        f"(default {d['dense_warmup_steps']})")
    g.add_argument("--kl-coef", type=float, default=1.0, metavar="LAMBDA", help="weight of the indexer KL terms")
    g.add_argument("--kl-every", type=int, default=d["kl_every"], metavar="N",
                   help="compute the indexer KL every N-th step (1 = always; larger saves CPU time)")
    g.add_argument("--routing-bias-rate", type=float, default=1e-3, metavar="R", help="MoE balancing bias step")
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--log-every", type=int, default=10, metavar="N")
    g.add_argument("--eval-every", type=int, default=d["eval_every"], metavar="N")
    g.add_argument("--eval-rows", type=int, default=32, metavar="N", help="validation rows per evaluation")
    g.add_argument("--save-every", type=int, default=d["save_every"], metavar="N")
    g.add_argument("--keep", type=int, default=2, metavar="N", help="checkpoints kept (default 2)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--doc-attention", action="store_true",
                   help="keep attention inside documents (packed rows through the cu_seqlens path)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


_OPTIM_DEFAULTS = dict(steps=1000, batch_size=8, lr=3e-3, lr_warmup_steps=20, dense_warmup_steps=300, kl_every=1,
                       eval_every=100, save_every=200)


def optim_config(args: argparse.Namespace, *, steps_default: int, warmup_default: int):
    from msakit.train.trainer import TrainConfig

    steps = args.steps if args.steps is not None else steps_default
    warm = args.warmup_steps if args.warmup_steps is not None else min(warmup_default, steps)
    return TrainConfig(
        steps=steps, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        lr_warmup_steps=min(args.lr_warmup_steps, steps), weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        kl_coef=args.kl_coef, kl_every=args.kl_every, dense_warmup_steps=warm, routing_bias_rate=args.routing_bias_rate,
        log_every=args.log_every, eval_every=args.eval_every, eval_rows=args.eval_rows, save_every=args.save_every,
        keep_checkpoints=args.keep, seed=args.seed, doc_attention=args.doc_attention,
    )


def data_options(args: argparse.Namespace, context: int) -> dict:
    """The data settings a run records (and a resume replays)."""
    return {
        "data": [str(Path(d)) for d in (args.data or [])],
        "stdlib": not args.no_stdlib,
        "vocab_size": getattr(args, "vocab_size", None),
        "context": context,
        "val_fraction": args.val_fraction,
        "long_min_tokens": args.long_min_tokens,
        "max_train_tokens": args.max_train_tokens,
    }


def _check_data_options(opts: dict) -> None:
    if opts["context"] is not None and opts["context"] < 2:
        raise ValueError(f"--context must be at least 2, got {opts['context']}")
    if not 0 <= opts["val_fraction"] < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {opts['val_fraction']}")
    if opts["max_train_tokens"] is not None and opts["max_train_tokens"] < 1:
        raise ValueError("--max-train-tokens must be positive")
    if not opts["stdlib"] and not opts["data"]:
        raise ValueError("empty corpus: --no-stdlib given and no --data paths")


def prepare(opts: dict, *, tokenizer=None, cache_dir=None, log=print):
    from msakit.train.data import prepare_data

    _check_data_options(opts)
    t0 = time.time()
    pd = prepare_data(opts["data"] or None, stdlib=opts["stdlib"], vocab_size=opts["vocab_size"] or 4096,
                      context=opts["context"], tokenizer=tokenizer, cache_dir=cache_dir,
                      val_fraction=opts["val_fraction"], long_min_tokens=opts["long_min_tokens"],
                      max_train_tokens=opts["max_train_tokens"])
    log(f"data: {pd.summary()} ({time.time() - t0:.1f}s)")
    return pd


# ----------------------------------------------------------------------------- model helpers
def check_context(model_config: Any, context: int) -> None:
    maxpos = getattr(model_config, "max_position_embeddings", None)
    if maxpos is not None and context > int(maxpos):
        raise ValueError(f"context {context} is longer than the model's max_position_embeddings ({maxpos})")


def model_config(preset: str | None, config_path: str | None, vocab_size: int, *, attention: str = "msa", **overrides):
    from msakit.models import M3Config

    if config_path:
        p = Path(config_path)
        if not p.exists():
            raise FileNotFoundError(f"config not found: {config_path}")
        cfg = M3Config.from_pretrained(p)
        cfg = cfg.replace(vocab_size=vocab_size, **overrides)
    else:
        cfg = M3Config.preset(preset or "tiny", vocab_size=vocab_size, **overrides)
    if attention == "dense":  # a plain GQA model (no index branch): the source for `msakit convert`
        cfg = cfg.replace(sparse_attention_freq=[0] * cfg.num_hidden_layers)
    return cfg


def load_model_folder(folder: Path, device=None):
    """Any model folder msakit can train: an M3 checkpoint, a converted (wrapped) HF model."""
    from msakit.train import checkpoint as ckpt_mod

    from msakit.models.convert import load_for_conversion

    try:
        return load_for_conversion(folder, device=device)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # safetensors / transformers errors on a damaged folder
        raise ckpt_mod.CheckpointError(f"cannot load the model in {folder}: {str(e).splitlines()[0]}") from None


def _refuse_existing_run(out: Path) -> None:
    from msakit.train import checkpoint as ckpt_mod

    if ckpt_mod.find_checkpoint(out) is not None:
        raise ValueError(f"{out} already holds a training run; pass --resume to continue it or choose another --out")


def _summary(trainer, t0: float, log=print) -> None:
    from msakit.train import checkpoint as ckpt_mod

    ev = trainer.last_eval or {}
    hist = trainer.history
    last = hist[-1]["loss"] if hist else float("nan")
    msg = f"done: step {trainer.step}, train loss {last:.3f}"
    if "val_loss" in ev:
        msg += f", val loss {ev['val_loss']:.3f}"
    if ev.get("recall_per_layer"):
        r = ev["recall_per_layer"]
        o = ev["oracle_per_layer"]
        msg += f", indexer recall {sum(r) / len(r):.3f} (oracle {sum(o) / len(o):.3f})"
    ck = ckpt_mod.find_checkpoint(trainer.out_dir)
    log(f"{msg}; {time.time() - t0:.0f}s; checkpoint {ck}")


# ----------------------------------------------------------------------------- msakit train
def run_train(args: argparse.Namespace) -> int:
    import torch

    from msakit.train import checkpoint as ckpt_mod
    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import TrainConfig, Trainer, resolve_device

    t0 = time.time()
    out = Path(args.out)
    device = resolve_device(args.device)
    if args.resume:
        src = out if args.resume is True else Path(args.resume)
        ck = ckpt_mod.resolve_checkpoint(src)
        state, _, _, _ = ckpt_mod.load_checkpoint_state(ck)  # verifies the manifest
        meta = state.get("meta", {})
        opts = meta.get("data")
        if not opts:
            raise ckpt_mod.CheckpointError(f"{ck} does not record its data settings; cannot resume")
        cfg = TrainConfig.from_dict(state["config"])
        if args.steps is not None:
            if args.steps < state["step"]:
                raise ValueError(f"--steps {args.steps} is below the checkpoint's step {state['step']}")
            cfg.steps = args.steps
        tok = Tokenizer.load(ck)
        pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
        model = load_model_folder(ck)
        trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                          progress=not args.no_progress, meta=meta)
        trainer.resume(ck, load_weights=lambda _: None)
        print(f"resumed {ck} at step {trainer.step}")
    else:
        _refuse_existing_run(out)
        opts = data_options(args, args.context or DEFAULT_CONTEXT)
        _check_data_options(opts)
        if args.vocab_size < 257:
            raise ValueError(f"--vocab-size must be at least 257, got {args.vocab_size}")
        tok = Tokenizer.load(args.tokenizer) if args.tokenizer else None
        if args.init:
            model = load_model_folder(_model_folder(Path(args.init)))
            if tok is None:
                tok = _tokenizer_beside(Path(args.init))
            check_context(model.config, opts["context"])
        else:
            # validate the model config and the context before the (slower) data preparation
            cfg0 = model_config(args.preset, args.config, tok.vocab_size if tok else args.vocab_size,
                                attention=args.attention)
            check_context(cfg0, opts["context"])
        pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
        tok = pd.tokenizer
        if not args.init:
            mcfg = model_config(args.preset, args.config, tok.vocab_size, attention=args.attention)
            check_context(mcfg, opts["context"])
            from msakit.models import M3ForCausalLM

            torch.manual_seed(args.seed)
            model = M3ForCausalLM(mcfg)
        _check_vocab(model, tok)
        cfg = optim_config(args, steps_default=1000, warmup_default=300)
        meta = {"kind": "train", "data": opts, "preset": args.preset, "config": args.config, "init": args.init,
                "long_files": [f.name for f in pd.corpus.long]}
        trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                          progress=not args.no_progress, meta=meta)
        tok.save(out)
    n = sum(p.numel() for p in trainer.model.parameters())
    print(f"model: {n / 1e6:.2f}M parameters on {trainer.device}; {trainer.cfg.steps} steps "
          f"(full attention for the first {trainer.cfg.dense_warmup_steps}), batch {trainer.cfg.batch_size} x "
          f"{trainer.train_rows.context} tokens")
    trainer.fit()
    _summary(trainer, t0)
    return 0


def _check_vocab(model, tok) -> None:
    V = getattr(model.config, "vocab_size", None)
    if V is not None and tok.vocab_size > int(V):
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {V}")


def _model_folder(path: Path, what: str = "model") -> Path:
    """A checkpoint / run folder (verified against its manifest) or a plain model folder; `what`
    names it in the error for a missing path."""
    from msakit.train import checkpoint as ckpt_mod

    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    ck = ckpt_mod.find_checkpoint(path)
    if ck is not None:
        ckpt_mod.verify_checkpoint(ck)
        return ck
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint or config.json in {path}")
    return path


def _tokenizer_beside(path: Path):
    from msakit.train.tokenizer import Tokenizer

    folder = _model_folder(path)
    for cand in (folder / "tokenizer.json", path / "tokenizer.json"):
        if cand.is_file():
            eos = None
            cfgp = folder / "config.json"
            if cfgp.is_file():
                try:
                    e = json.loads(cfgp.read_text()).get("eos_token_id")
                    eos = e[0] if isinstance(e, list) and e else (e if isinstance(e, int) else None)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass
            try:
                return Tokenizer.load(cand)
            except ValueError:
                if eos is None:
                    raise
                return Tokenizer.load(cand, eos_id=eos)
    raise FileNotFoundError(f"no tokenizer.json beside {path}; pass --tokenizer")


# ----------------------------------------------------------------------------- msakit convert
def run_convert(args: argparse.Namespace) -> int:
    from msakit.models.convert import convert_dense_to_msa
    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import Trainer, resolve_device

    t0 = time.time()
    out = Path(args.out)
    device = resolve_device(args.device)
    _refuse_existing_run(out)
    folder = _model_folder(Path(args.source))
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else _tokenizer_beside(Path(args.source))
    opts = data_options(args, args.context or DEFAULT_CONTEXT)
    opts["vocab_size"] = tok.vocab_size
    _check_data_options(opts)
    src = load_model_folder(folder)
    model = convert_dense_to_msa(src, index_head_dim=args.index_dim, block_size=args.block_size,
                                 topk_blocks=args.topk, seed=args.seed)
    check_context(model.config, opts["context"])
    _check_vocab(model, tok)
    pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
    cfg = optim_config(args, steps_default=300, warmup_default=100)
    meta = {"kind": "convert", "data": opts, "source": str(args.source), "long_files": [f.name for f in pd.corpus.long]}
    trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                      progress=not args.no_progress, meta=meta)
    tok.save(out)
    before_d = trainer.evaluate(mode="dense", recall_rows=0, compute_kl=False)["loss"]
    before_s = trainer.evaluate(mode="sparse", recall_rows=0, compute_kl=False)["loss"]
    print(f"converted {folder}: validation loss dense {before_d:.3f}, sparse with the untrained indexer {before_s:.3f}; "
          f"indexer warm-up (dense) for {cfg.dense_warmup_steps} steps, then sparse to step {cfg.steps}")
    trainer.fit()
    after_d = trainer.evaluate(mode="dense", recall_rows=0, compute_kl=False)["loss"]
    after_s = trainer.evaluate(mode="sparse", recall_rows=0, compute_kl=False)["loss"]
    print(f"after conversion: validation loss dense {after_d:.3f}, sparse {after_s:.3f}")
    _summary(trainer, t0)
    return 0


# ----------------------------------------------------------------------------- msakit generate
class TextStreamer:
    """`streamer(tokens [B])` for `model.generate`: decodes row 0 incrementally to a text stream
    (holding back an incomplete UTF-8 sequence until its last byte arrives); stops at EOS."""

    def __init__(self, tokenizer, stream=None, eos_id: int | None = None) -> None:
        self.tok = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.eos_id = eos_id
        self.ids: list[int] = []
        self.printed = 0
        self.done = False

    def __call__(self, tokens) -> None:
        if self.done:
            return
        t = int(tokens.reshape(-1)[0])
        if self.eos_id is not None and t == self.eos_id:
            self.done = True
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed:])
        self.stream.flush()
        self.printed = len(text)

    def text(self) -> str:
        return self.tok.decode(self.ids)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import resolve_device

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    prompt = args.prompt
    if args.prompt_file is not None:
        prompt = Path(args.prompt_file).read_text(encoding="utf-8", errors="replace")
    if prompt is None:
        prompt = ""
    device = resolve_device(args.device)
    folder = _model_folder(Path(args.checkpoint))
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else _tokenizer_beside(Path(args.checkpoint))
    model = load_model_folder(folder, device=device)
    _check_vocab(model, tok)
    model.set_attention_mode(args.mode)
    ids = tok.encode(prompt) if prompt else []
    if not ids:
        ids = [tok.eos_id]  # an empty prompt starts a new document
    check_context(model.config, len(ids) + args.max_new_tokens)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    streamer = TextStreamer(tok, sys.stdout, eos_id=tok.eos_id)
    from msakit.train.metrics import autocast_for

    with torch.no_grad(), autocast_for(device):
        model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       generator=gen, streamer=streamer, eos_token_id=tok.eos_id)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
