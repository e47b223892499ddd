"""The training loop: AdamW, warm-up + cosine, clipping, the MSA recipe, metrics, checkpoints.

Loss = LM cross-entropy + ``kl_coef`` x (sum of the MSA layers' KL terms, ``out.kl``).  The seed's
recipe: steps ``< dense_warmup_steps`` run full attention (``set_attention_mode("dense")``; the
indexer still learns through the KL over its own selection), later steps run ``"sparse"``.  After
every optimizer step the MoE routing bias moves toward balance (auxiliary-loss-free:
``model.update_routing_bias(out.expert_load, rate)``).  bf16 autocast on CUDA, float32 on CPU.

``train="index"`` (the conversion's cheapest recipe): only the index branches train
(``model.index_parameters()``), by the KL alone, with full attention throughout; every other
parameter is frozen (``requires_grad`` False, no optimizer state, no routing-bias update), and the
training forward keeps only the last position's logits (``logits_to_keep=1``, no labels), so the
[T, vocab] logits are never built.  ``index_lr`` sets the index branches' peak learning rate (in
``train="all"`` a separate parameter group, the same schedule); ``kl_tokens`` ("selected" / "all")
is passed to ``model.set_kl_tokens``.  ``lora_rank`` > 0 (``train="all"`` only): the backbone
trains through peft LoRA adapters of that rank (`msakit.train.lora.apply_lora`, scale
``lora_alpha`` / rank) and the index branch fully; nothing else is trainable or in the optimizer.
Such a run writes no resumable checkpoints (the adapters are merged into the model folder its
caller saves at the end, `msakit.train.lora.merge_lora`).  ``fit(max_tokens=, budget_s=)`` stops early and finishes
the run at that step as at its last (log, evaluation, checkpoint).

Everything a step depends on is a function of the step number or is checkpointed (learning rate,
attention mode, data-loader position, optimizer moments, RNG states, routing bias in the weights),
so N steps straight and N/2 + resume + N/2 give the same losses (bit-identical on CPU).

Several ranks (torchrun; ``Trainer(..., parallel=msakit.distributed.Parallel, fsdp=...)``): every
rank reads the same global batch and trains on its share (its rows; under context parallelism its
part of each sequence), gradients are averaged over the ranks (FSDP2 or an all-reduce), and the
logged loss is the global one, equal to one process's.  Rank 0 alone logs, shows the progress bar
and writes plots; checkpoints are sharded (DCP, ``<run>/sharded/step-N``) and resume on any number
of ranks.  See docs/distributed.md.

``compile=True`` (``--compile``): every decoder layer runs under torch.compile (`compile_layers`:
torchtitan's per-block compile, in place, so names and checkpoints are unchanged); the loss, the
optimizer and evaluation stay eager.  Not with ``doc_attention`` or context parallelism.

Ctrl-C: the loop stops at once; a checkpoint being written is discarded (its temporary folder is
removed) and ``checkpoints/latest`` keeps naming the last complete one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from msakit.distributed.checkpoint import is_sharded_checkpoint, load_sharded, save_sharded
from msakit.distributed.fsdp import allreduce_gradients, full_norm, shard_model, sync_expert_load
from msakit.distributed.launch import rank_seed
from msakit.distributed.step import loss_shares, reduce_sum, set_attention_context
from msakit.models.interface import MSAModel
from msakit.models.modeling import M3DecoderLayer
from msakit.nn.attention import KL_TOKENS
from msakit.ops.dispatch import triton_available
from msakit.train import checkpoint as ckpt_mod
from msakit.train.data import Batch, PackedRows, RowLoader, eval_batches
from msakit.train.lora import apply_lora, has_lora
from msakit.train.jsonl import METRICS_FILE, append_metrics, read_metrics
from msakit.train.metrics import autocast_for, evaluate, load_balance, model_forward
from msakit.train.plots import write_plots

TRAIN_WHAT = ("all", "index")  # TrainConfig.train
SHARDED_DIR = ckpt_mod.SHARDED_DIR  # DCP checkpoints of runs on several ranks: <run>/sharded/step-N


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    kl_coef: float = 1.0  # lambda in L = L_LM + lambda * sum_layers KL
    kl_every: int = 1  # compute the KL term (the indexer's only signal) every n-th step: a CPU compute knob
    dense_warmup_steps: int = 100  # full-attention warm-up (the indexer learns by KL meanwhile)
    routing_bias_rate: float = 1e-3
    log_every: int = 10
    eval_every: int = 100
    eval_rows: int = 32
    recall_rows: int = 2
    save_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    doc_attention: bool = False  # feed packed rows through the cu_seqlens path (attention stays inside documents)
    train: str = "all"  # "all": every parameter, LM + kl_coef * KL; "index": the index branches only, by the KL
    index_lr: float | None = None  # peak learning rate of the index branches (None: lr)
    kl_tokens: str = "selected"  # the KL over the indexer's selected tokens or over "all" causal tokens
    compile: bool = False  # torch.compile each decoder layer (`compile_layers`); evaluation stays eager
    lora_rank: int = 0  # > 0: the backbone trains through LoRA adapters of this rank (train="all"), the index fully
    lora_alpha: float | None = None  # LoRA scale alpha / rank (None: rank, a scale of 1)

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if self.compile and self.doc_attention:
            raise ValueError("compile does not take doc_attention: each packed batch's document boundaries are "
                             "Python values that would compile the layers anew")
        if self.train not in TRAIN_WHAT:
            raise ValueError(f"train must be one of {TRAIN_WHAT}, got {self.train!r}")
        if self.kl_tokens not in KL_TOKENS:
            raise ValueError(f"kl_tokens must be one of {KL_TOKENS}, got {self.kl_tokens!r}")
        if self.index_lr is not None and not self.index_lr > 0:
            raise ValueError(f"index_lr must be positive, got {self.index_lr}")
        if self.train == "index" and self.index_lr is not None:  # only the index trains: its lr is the run's
            self.lr, self.index_lr = self.index_lr, None
        if self.train == "index" and self.kl_every != 1:
            raise ValueError(f"kl_every must be 1 when only the index branch trains (the KL is its only loss), "
                             f"got {self.kl_every}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_rank and self.train != "all":
            raise ValueError("lora_rank applies to train='all' (with train='index' the backbone is frozen)")
        if self.lora_alpha is not None and not (self.lora_rank and self.lora_alpha > 0):
            raise ValueError(f"lora_alpha must be positive and needs lora_rank > 0, got {self.lora_alpha}")
        for name in ("steps", "batch_size", "log_every", "eval_every", "save_every", "kl_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lr_warmup_steps", "dense_warmup_steps", "eval_rows", "recall_rows", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.kl_coef < 0 or self.grad_clip < 0 or self.routing_bias_rate < 0:
            raise ValueError("kl_coef, grad_clip and routing_bias_rate must be >= 0")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return config_from_dict(cls, d)


def config_from_dict(cls: Any, d: dict) -> Any:
    """A config dataclass from a dict (a checkpoint's recorded settings), ignoring keys that are not
    its fields.  ValueError naming the setting for a value whose type differs from its field's
    default (an int, float, bool or str default; a float field also takes an int)."""
    if not isinstance(d, dict):
        raise ValueError(f"the recorded {cls.__name__} is not an object: {d!r}")
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
    out = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        want = kinds.get(type(f.default))
        if want is not None and not (isinstance(v, want) and (bool in want or not isinstance(v, bool))):
            raise ValueError(f"the recorded setting {f.name!r} must be {type(f.default).__name__}, got {v!r}")
        out[f.name] = v
    return cls(**out)


def warmup_cosine(lr: float, min_lr_ratio: float, warmup: int, steps: int, step: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr down to lr * min_lr_ratio at `steps`."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over lr_warmup_steps, then cosine from lr down to lr * min_lr_ratio at cfg.steps."""
    return warmup_cosine(cfg.lr, cfg.min_lr_ratio, cfg.lr_warmup_steps, cfg.steps, step)


def mode_at(cfg: TrainConfig, step: int) -> str:
    """The attention mode of a step: dense during the warm-up (always, when only the index trains)."""
    return "dense" if cfg.train == "index" or step < cfg.dense_warmup_steps else "sparse"


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}: expected cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def make_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float, weight_decay: float,
               betas: tuple[float, float], eps: float, device: torch.device,
               scaled: Callable[[str], bool] | None = None, lr_scale: float = 1.0,
               ) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over the trainable parameters, matrices decayed and the rest not, and the parameter
    names in the optimizer's order (what the checkpoint mapping needs).  With `scaled` (a test on
    the parameter name) the parameters it names form two more groups whose learning rate is
    `lr_scale` x the schedule's (``optimizer_step`` reads each group's ``lr_scale``)."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    parts = [params] if scaled is None else [[x for x in params if not scaled(x[0])], [x for x in params if scaled(x[0])]]
    groups: list[dict] = []
    names: list[str] = []
    for i, part in enumerate(parts):
        for decayed in (True, False):
            sel = [(n, p) for n, p in part if (p.dim() >= 2) == decayed]
            g = {"params": [p for _, p in sel], "weight_decay": weight_decay if decayed else 0.0}
            if i:
                g["lr_scale"] = float(lr_scale)
            groups.append(g)
            names += [n for n, _ in sel]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=device.type == "cuda")
    return opt, names


def compile_layers(model: torch.nn.Module, *, fullgraph: bool | None = None, backend: str = "inductor",
                   mode: str | None = None) -> int:
    """torch.compile every `M3DecoderLayer` of `model` in place (torchtitan's per-block compile):
    `nn.Module.compile`, so parameter names, checkpoints and hooks stay as they are; returns the
    number of layers compiled.

    Layers of one structure share their compiled code (one graph per layer kind -- dense MLP or
    MoE, with or without an index branch -- per attention mode and KL setting); shapes are static
    (`dynamic=False`: training batches have one shape).  `fullgraph` None: one graph per layer
    (fullgraph=True) when msakit's ops there are custom ops -- on CUDA with Triton,
    `sparse_attention`, `index_topk` and `index_kl_loss` are `torch.library` custom ops with fake
    kernels and registered autograd -- else False: an MSA layer on CPU runs the ops' chunked
    PyTorch paths, whose data-dependent shapes break the graph there (the rest compiles)."""

    layers = [m for m in model.modules() if isinstance(m, M3DecoderLayer)]
    if not layers:
        raise ValueError(f"compile: {type(model).__name__} has no M3DecoderLayer to compile (an M3 model is needed)")
    if fullgraph is None:
        msa = any(layer.self_attn.index_branch for layer in layers)
        dev = next(model.parameters()).device
        fullgraph = not msa or (dev.type == "cuda" and triton_available())
    for layer in layers:
        layer.compile(fullgraph=bool(fullgraph), dynamic=False, backend=backend, mode=mode)
    return len(layers)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr (x its ``lr_scale`` when it has one), step, and clear the gradients."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def restore_optimizer(optimizer: torch.optim.Optimizer, param_names: list[str], ot: Any, os_: Any,
                      device: torch.device) -> None:
    """Load a checkpoint's optimizer files (when it has them) and move the moments to `device`."""
    if ot is None:
        return
    ckpt_mod.optimizer_from_files(optimizer, param_names, ot, os_)
    for st in optimizer.state.values():  # move moments beside their parameters
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and k != "step":
                st[k] = v.to(device)


@contextmanager
def progress_bar(enabled: bool, *, total: int, initial: int, desc: str, out_dir: Path,
                 step: Callable[[], int]) -> Iterator[Any]:
    """A tqdm bar (None when not enabled) for a training loop, closed on exit; on Ctrl-C it says
    the step and the last checkpoint, then re-raises."""
    bar = None
    if enabled:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=False)
    try:
        yield bar
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        last = ckpt_mod.find_checkpoint(out_dir)
        print(f"\ninterrupted at step {step()}; last checkpoint: {last if last else 'none'}", flush=True)
        raise
    finally:
        if bar is not None:
            bar.close()


class Trainer:
    """Owns the optimizer, the loop, logging, evaluation and checkpoints of one run folder."""

    def __init__(
        self,
        model,
        cfg: TrainConfig,
        train_rows: PackedRows,
        val_rows: PackedRows | None,
        *,
        out_dir: str | os.PathLike,
        device: torch.device | str | None = None,
        tokenizer=None,
        callbacks: Sequence[Callable[["Trainer", dict], None]] = (),
        progress: bool = True,
        meta: dict | None = None,
        parallel: Any = None,
        fsdp: bool = False,
        activation_checkpointing: bool = False,
        eval_both_modes: bool = False,
    ) -> None:
        self.cfg = cfg
        # eval_both_modes: every evaluation also reports the other attention mode's loss (val_loss_dense /
        # val_loss_sparse) and prints one line (what `msakit convert` shows)
        self.eval_both_modes = bool(eval_both_modes)
        # parallel: a msakit.distributed.Parallel (torchrun: data / context parallel ranks) or None (one process)
        self.parallel = parallel
        if parallel is not None:
            device = parallel.env.device
            if cfg.batch_size % parallel.dp:
                raise ValueError(f"--batch-size {cfg.batch_size} is not a multiple of the data-parallel size "
                                 f"{parallel.dp}")
        self.device = resolve_device(device) if not isinstance(device, torch.device) else device
        if cfg.train == "index" and parallel is not None:
            raise ValueError("--train index runs in one process (no --cp / --fsdp / torchrun yet)")
        if cfg.lora_rank and parallel is not None:
            raise ValueError("--lora runs in one process (no --cp / --fsdp / torchrun yet)")
        self.model = model.to(self.device)
        index_names = self._setup_index_training(model)
        self.fsdp = bool(fsdp)
        if activation_checkpointing and not fsdp:
            model.gradient_checkpointing_enable(True)
        if cfg.compile:  # after activation checkpointing, before FSDP sharding (torchtitan's order)
            if parallel is not None and parallel.cp > 1:
                raise ValueError("--compile does not take context parallelism (--cp) yet")
            compile_layers(self.model)
        if fsdp:
            if parallel is None or parallel.fsdp_mesh is None:
                raise ValueError("--fsdp needs a process group: launch with torchrun")

            shard_model(self.model, parallel.fsdp_mesh, activation_checkpointing=activation_checkpointing)
        self.is_main = parallel is None or parallel.env.is_main
        self.out_dir = Path(out_dir)
        self.tokenizer = tokenizer
        self.callbacks = list(callbacks)
        self.progress = progress
        self.meta = dict(meta or {})
        self.train_rows = train_rows
        self.val_rows = val_rows
        self.loader = RowLoader(train_rows, cfg.batch_size, seed=cfg.seed, shuffle=True)
        self._val = eval_batches(val_rows, cfg.batch_size, cfg.eval_rows) if val_rows is not None else []
        # param order inside the optimizer matches param_names for the checkpoint mapping
        scaled = None if cfg.index_lr is None else index_names.__contains__
        self.optimizer, self.param_names = make_adamw(
            model.named_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps, device=self.device, scaled=scaled, lr_scale=(cfg.index_lr or cfg.lr) / cfg.lr)
        self.step = 0
        self.history: list[dict] = []  # per-step records (loss, kl, lr, ...)
        self.last_eval: dict | None = None
        self._acc: dict[str, Any] = {}
        self._lora_noted = False  # the note that a LoRA run writes no checkpoints is said once
        self._t0 = time.time()
        self.tokens_seen = 0
        seed = cfg.seed
        if parallel is not None:  # per-rank randomness; weights and data order use cfg.seed on every rank
            seed = rank_seed(cfg.seed, parallel.env.rank)
        torch.manual_seed(seed)

    def _setup_index_training(self, model) -> set[str]:
        """Apply kl_tokens and, for train="index", freeze everything but the index branches (with
        lora_rank, put LoRA adapters on the backbone: `apply_lora`); returns the index parameters'
        names (empty when the model has none to name)."""
        cfg = self.cfg
        if not isinstance(model, MSAModel):  # a plain torch model: the LM loss only
            if cfg.kl_tokens != "selected":
                raise ValueError(f"kl_tokens={cfg.kl_tokens!r}: {type(model).__name__} is not an MSA model "
                                 "(msakit.models.interface.MSAModel: no set_kl_tokens)")
            if cfg.train == "index" or cfg.index_lr is not None or cfg.lora_rank:
                raise ValueError(f"{type(model).__name__} has no index_parameters(): cannot train its index branch "
                                 "alone, give it its own learning rate or train it beside LoRA")
            return set()
        model.set_kl_tokens(cfg.kl_tokens)
        names = {n for n, _ in model.index_parameters()}
        if (cfg.train == "index" or cfg.index_lr is not None or cfg.lora_rank) and not names:
            raise ValueError("the model has no index-branch parameters (no MSA layer)")
        if cfg.train == "index":
            for n, p in model.named_parameters():
                p.requires_grad_(n in names)
        elif cfg.lora_rank and not has_lora(model):
            apply_lora(model, cfg.lora_rank, cfg.lora_alpha)
        return names

    # ------------------------------------------------------------------ one step
    def _index_kl(self, batch: Batch):
        """train="index": (None, KL, KL) of one batch, the logits of the last position only."""
        cfg, model = self.cfg, self.model
        with autocast_for(self.device):
            out = model_forward(model, batch, doc_attention=cfg.doc_attention, compute_kl=True, lm=False)
        kl = torch.as_tensor(out.kl, device=self.device, dtype=torch.float32).float()
        if not kl.requires_grad:
            raise ValueError("the index KL carries no gradient: the model computed no KL term in training mode")
        return None, kl.detach(), kl, None, None

    def _losses(self, batch: Batch, with_kl: bool):
        """(LM loss, KL, what to back-propagate, expert load, CP communication) of one batch.

        One process: the model's own mean losses.  Several ranks (`self.parallel`): every rank
        reads the same global batch, takes its share (msakit.distributed.step) and back-propagates
        world_size x that share (gradients are averaged over the ranks); the LM loss and KL
        returned are the global ones, equal to one process's."""
        cfg, model, par = self.cfg, self.model, self.parallel
        with autocast_for(self.device):
            if par is None:
                out = model_forward(model, batch, doc_attention=cfg.doc_attention, compute_kl=with_kl)
                lm = out.loss
                kl = torch.as_tensor(out.kl, device=lm.device, dtype=torch.float32) if out.kl is not None \
                    else lm.new_zeros(())
                loss = lm.float() + cfg.kl_coef * kl.float()
                return lm.detach(), kl.detach(), loss, getattr(out, "expert_load", None), None

            sh = loss_shares(model, batch.input_ids, batch.labels, par,
                             cu_seqlens=batch.cu_seqlens if cfg.doc_attention else None, compute_kl=with_kl)
            loss = (sh.lm + cfg.kl_coef * sh.kl) * par.world_size
        return reduce_sum(sh.lm, par), reduce_sum(sh.kl, par), loss, sh.expert_load, sh.comm

    def train_step(self) -> dict:
        cfg, model, par = self.cfg, self.model, self.parallel
        t0 = time.time()
        mode = mode_at(cfg, self.step)
        model.set_attention_mode(mode)
        model.train()
        batch = self.loader.next_batch().to(self.device)
        index_only = cfg.train == "index"
        with_kl = index_only or (cfg.kl_coef > 0 and self.step % cfg.kl_every == 0)
        lm, kl, loss, el, comm = self._index_kl(batch) if index_only else self._losses(batch, with_kl)
        if not torch.isfinite(loss.detach().float()):
            lm_s = "no" if lm is None else f"{float(lm):.4g}"
            raise FloatingPointError(f"loss is not finite at step {self.step} ({lm_s} LM, {float(kl):.4g} KL)")
        loss.backward()
        if par is not None and par.cp > 1:

            set_attention_context(model, None)
        params = optimizer_params(self.optimizer)
        if par is not None and par.env.distributed and not self.fsdp:

            allreduce_gradients(params)
        if par is not None:  # a DTensor norm under FSDP2, made whole

            gn = full_norm(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
        else:
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else \
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        lr = lr_at(cfg, self.step)
        optimizer_step(self.optimizer, lr)
        if el is not None and el.numel():
            if par is not None:

                el = sync_expert_load(el)
            if cfg.routing_bias_rate > 0:
                model.update_routing_bias(el.detach(), rate=cfg.routing_bias_rate)
        self.step += 1
        self.tokens_seen += batch.num_targets
        rec = {"step": self.step, "loss": None if lm is None else float(lm), "kl": float(kl) if with_kl else None,
               "lr": lr,
               "grad_norm": float(gn), "mode": mode, "time_s": time.time() - t0}
        if comm:
            rec["cp_comm_bytes"] = comm["all_gather_bytes"]
        if el is not None and el.numel():
            acc = self._acc.get("load")
            self._acc["load"] = el.detach().float() if acc is None else acc + el.detach().float()
        self.history.append(rec)
        return rec

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, mode: str | None = None, batches: list[Batch] | None = None, recall_rows: int | None = None,
                 compute_kl: bool = True) -> dict:
        """Validation (`msakit.train.metrics.evaluate`); eager under `compile` (an evaluation's
        no-grad, eval-mode calls would otherwise compile every layer kind again)."""
        with torch.compiler.set_stance("force_eager") if self.cfg.compile else nullcontext():
            return evaluate(self.model, self._val if batches is None else batches, self.device, mode=mode,
                            doc_attention=self.cfg.doc_attention, compute_kl=compute_kl,
                            recall_rows=self.cfg.recall_rows if recall_rows is None else recall_rows)

    # ------------------------------------------------------------------ logging
    def _log(self, record: dict) -> None:
        if self.is_main:
            append_metrics(self.out_dir, record)

    def _interval_record(self, recent: list[dict]) -> dict:
        r = {
            "kind": "train",
            "step": self.step,
            "loss": _mean([x["loss"] for x in recent if x["loss"] is not None]),
            "kl": _mean([x["kl"] for x in recent if x["kl"] is not None]),
            "lr": recent[-1]["lr"],
            "grad_norm": recent[-1]["grad_norm"],
            "mode": recent[-1]["mode"],
            "tokens": self.tokens_seen,
            "elapsed_s": round(time.time() - self._t0, 3),
        }
        lb = load_balance(self._acc.pop("load", None))
        if lb:
            r["load_balance"] = lb
            r["load_balance_max"] = max(lb)
        return r

    def eval_record(self, mode: str | None = None) -> dict:
        """Validation in `mode` (default the mode of the last step) with the KL and the per-layer
        recall; with `eval_both_modes` also the other mode's loss (val_loss_dense / val_loss_sparse)."""
        mode = mode or mode_at(self.cfg, max(0, self.step - 1))
        ev = self.evaluate(mode=mode)
        rec = {"kind": "eval", "step": self.step, "mode": mode, "val_loss": ev["loss"], "val_kl": ev["kl"]}
        if self.eval_both_modes:
            other = "sparse" if mode == "dense" else "dense"
            rec[f"val_loss_{mode}"] = ev["loss"]
            rec[f"val_loss_{other}"] = self.evaluate(mode=other, recall_rows=0, compute_kl=False)["loss"]
        if ev.get("layers"):
            rec["kl_per_layer"] = [x["kl"] for x in ev["layers"]]
            rec["recall_per_layer"] = [x["recall"] for x in ev["layers"]]
            rec["oracle_per_layer"] = [x["oracle"] for x in ev["layers"]]
            rec["recall_far_per_layer"] = [x["recall_far"] for x in ev["layers"]]
            rec["oracle_far_per_layer"] = [x["oracle_far"] for x in ev["layers"]]
        if ev.get("load_balance"):
            rec["val_load_balance"] = ev["load_balance"]
        self.last_eval = rec
        return rec

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        return {
            "config": asdict(self.cfg),
            "loader": self.loader.state_dict(),
            "tokens_seen": self.tokens_seen,
            "meta": self.meta,
        }

    def save(self, _hook=None) -> Path | None:
        """A checkpoint of the step (None for a LoRA run: its adapters are merged into the model
        folder saved at the end instead; said once)."""
        if self.cfg.lora_rank:
            if self.is_main and not self._lora_noted:
                self._lora_noted = True
                print("note: a --lora run writes no resumable checkpoints; the model folder saved at its end holds "
                      "the merged weights", flush=True)
            return None
        if self.parallel is not None and self.parallel.env.distributed:
            return self._save_sharded()
        return ckpt_mod.save_checkpoint(
            self.out_dir, self.step, model=self.model, optimizer=self.optimizer, param_names=self.param_names,
            state=self.state(), tokenizer=self.tokenizer, keep=self.cfg.keep_checkpoints, _hook=_hook)

    def _save_sharded(self) -> Path:
        """A DCP checkpoint under out_dir/sharded/step-N (every rank writes its shards; rank 0 the rest)."""

        root = self.out_dir / SHARDED_DIR
        path = save_sharded(root / f"step-{self.step:08d}", self.model, self.optimizer,
                            state={**self.state(), "step": self.step})
        if self.is_main:
            if self.tokenizer is not None:
                self.tokenizer.save(path)
            tmp = root / f".{ckpt_mod.LATEST}.tmp"
            tmp.write_text(path.name)
            os.replace(tmp, root / ckpt_mod.LATEST)
            olds = sorted(p for p in root.glob("step-*") if p.is_dir() and p != path)
            keep = self.cfg.keep_checkpoints
            for p in (olds[:len(olds) - (keep - 1)] if keep else []):
                shutil.rmtree(p, ignore_errors=True)
        return path

    def resume_sharded(self, path: str | os.PathLike) -> Path:
        """Restore weights, optimizer, loader and step from a DCP checkpoint saved on any number of
        ranks (or its run folder: the newest one under out/sharded)."""

        ck = find_sharded(path)
        if ck is None or not is_sharded_checkpoint(ck):
            raise ckpt_mod.CheckpointError(f"no sharded checkpoint in {path}")
        state = load_sharded(ck, self.model, self.optimizer)
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        return ck

    def resume(self, path: str | os.PathLike, load_weights: Callable[[Path], None] | None = None) -> Path:
        """Restore weights, optimizer, loader, RNG and step from a checkpoint (verified first): the
        newest of a run folder, single-file or sharded (`ckpt_mod.find_checkpoint`)."""
        ck = ckpt_mod.resolve_checkpoint(path)
        if is_sharded_checkpoint(ck):
            self.resume_sharded(ck)
        else:
            state, rng, ot, os_ = ckpt_mod.load_checkpoint_state(ck)
            if load_weights is not None:
                load_weights(ck)
            else:
                load_model_weights(self.model, ck)
            restore_optimizer(self.optimizer, self.param_names, ot, os_, self.device)
            self.loader.load_state_dict(state["loader"])
            ckpt_mod.set_rng_state(rng, state["rng"])
            self.step = int(state["step"])
            self.tokens_seen = int(state.get("tokens_seen", 0))
        if self.is_main:
            self._rewind_log()
        return ck

    def _rewind_log(self) -> None:
        """The log continues from the checkpoint: drop records of steps the checkpoint did not see."""
        mf = self.out_dir / METRICS_FILE
        if mf.is_file():
            keep = []
            for line in mf.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= self.step:
                        keep.append(line)
                except json.JSONDecodeError:
                    continue
            tmp = mf.with_suffix(".tmp")
            tmp.write_text("".join(x + "\n" for x in keep))
            os.replace(tmp, mf)

    def tokens_read(self, step: int | None = None) -> int:
        """Input tokens of the first `step` steps (default: the steps done): batch x context each."""
        return (self.step if step is None else step) * self.cfg.batch_size * self.train_rows.context

    # ------------------------------------------------------------------ the loop
    def fit(self, until: int | None = None, deadline: float | None = None, *, max_tokens: int | None = None,
            budget_s: float | None = None) -> list[dict]:
        """Train up to step ``until`` (default cfg.steps), or until ``time.time() > deadline``
        (checked before each step).  ``max_tokens`` (input tokens read since step 0, batch x
        context per step) and ``budget_s`` (seconds of this call) end the run early at the step
        that reaches them, which then logs, evaluates and checkpoints as the last step does.
        Returns the per-step records of this call."""
        cfg = self.cfg
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if budget_s is not None and not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
            raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
        stop_at = None if budget_s is None else time.time() + budget_s
        end = cfg.steps if until is None else min(until, cfg.steps)
        start_hist = len(self.history)
        recent: list[dict] = []
        with progress_bar(self.progress and self.is_main, total=cfg.steps, initial=self.step, desc="train",
                          out_dir=self.out_dir, step=lambda: self.step) as bar:
            while self.step < end:
                if deadline is not None and time.time() > deadline:
                    break
                rec = self.train_step()
                recent.append(rec)
                stop = ((max_tokens is not None and self.tokens_read() >= max_tokens)
                        or (stop_at is not None and time.time() >= stop_at))
                last = self.step == cfg.steps or stop
                if bar is not None:
                    bar.update(1)
                    post = {"mode": rec["mode"]}
                    if rec["loss"] is not None:
                        post["loss"] = f"{rec['loss']:.3f}"
                    if rec["kl"] is not None:
                        post["kl"] = f"{rec['kl']:.3f}"
                    bar.set_postfix(post)
                if self.step % cfg.log_every == 0 or last:
                    rec_i = self._interval_record(recent)
                    self._log(rec_i)
                    if bar is None and self.is_main:  # no bar (a log file, not a terminal): one line per record
                        print(train_line(rec_i), flush=True)
                    recent = []
                if self._val and (self.step % cfg.eval_every == 0 or last):
                    ev = self.eval_record()
                    self._log(ev)
                    if self.eval_both_modes and self.is_main:
                        line = eval_line(ev)
                        (bar.write if bar is not None else print)(line)
                    self.write_plots()
                if self.step % cfg.save_every == 0 or last:
                    self.save()
                for cb in self.callbacks:
                    cb(self, rec)
                if stop:
                    break
        return self.history[start_hist:]

    def write_plots(self) -> None:
        if not self.is_main:
            return
        try:
            switch = None if self.cfg.train == "index" else self.cfg.dense_warmup_steps
            write_plots(self.out_dir / METRICS_FILE, self.out_dir, switch_step=switch)
        except ImportError:
            pass


def find_sharded(path: str | os.PathLike) -> Path | None:
    """A DCP checkpoint folder itself, or the newest under <run>/sharded (None when there is none)."""
    return ckpt_mod.find_sharded_checkpoint(path)


def train_line(rec: dict) -> str:
    """One line of a training interval record: step, loss and KL where present, tokens, seconds."""
    parts = [f"{k} {rec[k]:.4f}" for k in ("loss", "kl") if rec.get(k) is not None]
    parts.append(f"{rec['tokens']:,} tokens")
    return f"step {rec['step']}: {', '.join(parts)}, {rec['elapsed_s']:.0f}s"


def eval_line(rec: dict) -> str:
    """One line of an evaluation record: the step, dense / sparse validation loss, the KL."""
    parts = [f"{m} {rec[f'val_loss_{m}']:.3f}" for m in ("dense", "sparse") if f"val_loss_{m}" in rec]
    if not parts:
        parts = [f"{rec.get('mode', '')} {rec['val_loss']:.3f}".strip()]
    kl = rec.get("val_kl")
    tail = f", index KL {kl:.4f}" if isinstance(kl, float) and math.isfinite(kl) else ""
    return f"step {rec['step']}: validation loss {', '.join(parts)}{tail}"


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


def load_model_weights(model, ckpt: Path) -> None:
    """Copy the checkpoint's weights (saved by save_pretrained) into ``model`` in place."""
    cls = type(model)
    try:
        other = cls.from_pretrained(ckpt, device="cpu")
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        raise ckpt_mod.CheckpointError(f"cannot load the weights of {ckpt}: {str(e).splitlines()[0]}") from None
    sd = other.state_dict()
    own = model.state_dict()
    if set(sd) != set(own) or any(sd[k].shape != own[k].shape for k in own):
        raise ckpt_mod.CheckpointError(f"checkpoint {ckpt} does not match the model (different config)")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(sd[k])


__all__ = ["TrainConfig", "Trainer", "lr_at", "mode_at", "resolve_device", "load_model_weights", "read_metrics",
           "eval_line", "METRICS_FILE", "TRAIN_WHAT"]
