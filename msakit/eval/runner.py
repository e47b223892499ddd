"""The evaluation loop: policies x tasks x lengths x depths x samples, resumable.

The model is used only through ``forward(input_ids) -> .logits`` (one forward per sample or
batch of samples; no cache).  Sparse policies need the interfaces declared in
`msakit.models.interface`:

- a `SparseModel` (``attention_mode``, ``set_attention_mode("dense" | "sparse")``,
  ``has_indexer``) runs ``msa`` when it has an indexer, with its own selection settings
  (recorded as ``"selection": "model"`` in the results);
- a `SelectionModel` (+ ``set_selection_policy(fn | None)`` with ``fn(layer_idx, q, k, q_idx,
  k_idx, sel) -> block_idx``, `msakit.eval.policies`) runs every policy at the run's budget
  (``msa`` only with ``has_indexer``).

Policy names: ``dense`` (full context), ``last<N>`` (dense on the last N tokens only, e.g.
``last1024``), and the sparse policies ``msa``, ``window``, ``window0``, ``oracle``.

The output folder is a run folder of `msakit.run_folder` (command "eval"): a fresh evaluation
takes a new or empty folder, a resumed one only a folder an evaluation wrote (its marker), and
the folder is locked while the evaluation runs.  Each finished batch appends one strict JSON line
per sample to ``results.jsonl`` (`msakit.jsonl`: a non-finite score is written as null; flushed
and synced); a resumed run skips the samples already there.  ``settings.json`` keeps what decides
the samples (seed, budget, task options, documents): a rerun with other values is refused.
`write_report` turns every record the folder holds (this run's grid and the earlier runs' tasks,
lengths, depths and policies alike) into ``summary.json``, ``table.md`` and ``plot.png``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from msakit.eval.documents import long_documents
from msakit.eval.generation import greedy_generate
from msakit.eval.policies import POLICY_NAMES, make_policy
from msakit.eval.report import write_report
from msakit.eval.ruler import RULER_TASKS, RULER_VERSION, RulerData, RulerGenerator, expand_tasks, ruler_score
from msakit.eval.scoring import (
    answer_scores,
    bucket_edges,
    bucket_sums,
    model_logits,
    token_nll,
)
from msakit.eval.tasks import (
    RETRIEVAL_TASKS,
    TASK_VERSION,
    TokenPieces,
    decoder,
    encoder,
    make_sample,
)
from msakit.jsonl import append_jsonl, drop_torn_tail, dumps_strict, read_jsonl
from msakit.models.interface import SelectionModel, SparseModel
from msakit.models.sizes import check_batch_fits, check_memory, max_positions
from msakit.ops.index_topk import Selection
from msakit.run_folder import check_fresh, check_resume, claim, read_marker

__all__ = ["EVAL_COMMAND", "EvalConfig", "TASKS", "check_model", "check_out", "configure_model", "grid_of",
           "parse_policy", "read_records", "run_eval"]

TASKS = ("loss",) + RETRIEVAL_TASKS + RULER_TASKS
# RULER tasks: samples per (task, length) cell.  A task's score is a mean of per-sample scores in
# [0, 1]; its standard error is at most sqrt(p (1 - p) / n) (the binomial one, reached by 0/1
# scores): 100 samples give at most 5 points per task and cell, 1.4 points on the 13-task average,
# and about 1.8 points on the 8 NIAH tasks pooled (independent samples; paired comparisons on the
# same samples, as the report's differences against dense, are tighter)
RULER_SAMPLES = 100
RESULTS = "results.jsonl"
EVAL_COMMAND = "eval"  # the command whose runs evaluation folders are (their marker)
SETTINGS = "settings.json"
_LAST_RE = re.compile(r"^last(\d+)([kK]?)$")


def parse_policy(name: str) -> tuple[str, int | None]:
    """'dense' -> ('dense', None); 'last1024' / 'last1K' -> ('last', 1024); 'msa' -> ('msa', None)."""
    if name == "dense" or name in POLICY_NAMES:
        return name, None
    m = _LAST_RE.match(name)
    if m:
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 2:
            raise ValueError(f"policy {name!r}: the kept context must be >= 2 tokens")
        return "last", n
    raise ValueError(f"policy must be dense, last<N> (e.g. last1024) or one of {', '.join(POLICY_NAMES)}; got {name!r}")


@dataclass
class EvalConfig:
    """What to evaluate.  `samples` per (task, length, depth); loss uses `samples` documents per length;
    RULER's tasks (`msakit.eval.ruler`; "ruler" in `tasks` names all 13) `ruler_samples` per
    (task, length), their data from `ruler_data` (folders or wheel files; default the installed
    packages)."""

    tasks: list[str] = field(default_factory=lambda: ["loss", *RETRIEVAL_TASKS])
    lengths: list[int] = field(default_factory=lambda: [4096])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    policies: list[str] = field(default_factory=lambda: ["dense"])
    budget: Selection = field(default_factory=lambda: Selection(64, 8))
    samples: int = 4
    seed: int = 0
    batch_size: int = 1
    documents: list[str] | None = None
    num_needles: int = 4
    hops: int = 4
    ruler_samples: int = RULER_SAMPLES
    ruler_data: list[str] | None = None

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("tasks must name at least one task")
        self.tasks = expand_tasks(self.tasks)
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"task must be one of {', '.join(TASKS)}; got {t!r}")
        if not self.lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 64 for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 64, got {self.lengths}")
        if any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise ValueError(f"depths must lie in [0, 1], got {self.depths}")
        if not self.depths and any(t in RETRIEVAL_TASKS for t in self.tasks):
            raise ValueError("depths must name at least one depth for the retrieval tasks")
        if not self.policies:
            raise ValueError("policies must name at least one policy")
        for p in self.policies:
            parse_policy(p)
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies must not repeat, got {self.policies}")
        if not isinstance(self.budget, Selection):
            raise ValueError(f"budget must be a Selection, got {type(self.budget).__name__}")
        for name in ("samples", "batch_size", "num_needles", "hops", "ruler_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    def identity(self) -> dict[str, Any]:
        """The settings that decide the samples and their scores (fixed for one output folder)."""
        ident = dict(seed=self.seed, budget=str(self.budget), documents=self.documents,
                     num_needles=self.num_needles, hops=self.hops, task_version=TASK_VERSION)
        if self.ruler_tasks:  # only then: folders written before RULER's tasks existed stay resumable
            ident["ruler_version"] = RULER_VERSION
        return ident

    @property
    def ruler_tasks(self) -> list[str]:
        return [t for t in self.tasks if t in RULER_TASKS]


def record_key(policy: str, task: str, length: int, depth: float | None, index: int) -> str:
    d = "-" if depth is None else f"{float(depth):g}"
    return f"{policy}|{task}|{length}|{d}|{index}"


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a results.jsonl (a torn last line, from an interrupted write, is ignored)."""
    return read_jsonl(path)


def _append(path: Path, records: Iterable[dict[str, Any]]) -> None:
    append_jsonl(path, *records, sort_keys=True, sync=True)


def holds_results(out: Path) -> bool:
    """Whether `out` holds an evaluation's settings and results (one written before run folders
    had markers counts as an evaluation run)."""
    return (out / SETTINGS).is_file() and (out / RESULTS).is_file()


def keeps_results(out: Path) -> bool:
    """Whether an interrupted fresh evaluation in `out` has results worth resuming."""
    return bool(read_records(out / RESULTS))


def check_out(out: str | os.PathLike[str], resume: bool | None = None) -> bool:
    """RunFolderError unless an evaluation may write `out` (nothing is written): `resume` True, a
    folder an evaluation wrote; False, a new or empty folder; None, either.  Returns whether the
    evaluation continues an earlier one."""
    out = Path(out)
    if resume is None:
        resume = out.is_dir() and (read_marker(out) is not None or holds_results(out))
    if resume:
        check_resume(out, EVAL_COMMAND, legacy=holds_results)
    else:
        check_fresh(out, legacy=holds_results)
    return resume


def grid_of(records: Sequence[dict[str, Any]], cfg: EvalConfig) -> EvalConfig:
    """`cfg` widened to every record of the folder: the union of the tasks, lengths, depths and
    policies of this run and the records (earlier runs into the same folder; the identity, which
    decides the samples, is the same for all), and the largest sample count."""
    def union(first: Sequence[Any], more: Iterable[Any]) -> list[Any]:
        out = list(first)
        for x in more:
            if x is not None and x not in out:
                out.append(x)
        return out

    recs = [r for r in records if r.get("task") in TASKS and isinstance(r.get("length"), int)]
    tasks = union(cfg.tasks, (r["task"] for r in recs))
    depths = union([float(d) for d in cfg.depths], (float(r["depth"]) for r in recs if r.get("depth") is not None))
    return dataclasses.replace(
        cfg, tasks=[t for t in TASKS if t in tasks], lengths=sorted(union(cfg.lengths, (r["length"] for r in recs))),
        depths=sorted(depths), policies=union(cfg.policies, (r.get("policy") for r in recs)),
        samples=max([cfg.samples] + [int(r["index"]) + 1 for r in recs if isinstance(r.get("index"), int)]))


def _check_policy(model: Any, policy: str) -> str:
    """The kind of `policy`; ValueError when `model` cannot run it."""
    kind, _ = parse_policy(policy)
    if kind in ("dense", "last"):
        return kind
    if not isinstance(model, SparseModel):
        raise ValueError(f"policy {policy!r} needs a model with sparse attention (msakit.models.interface."
                         f"SparseModel); {type(model).__name__} is not one: convert it to MSA first")
    if kind != "msa" and not isinstance(model, SelectionModel):
        raise ValueError(f"policy {policy!r} needs model.set_selection_policy (msakit.models.interface."
                         f"SelectionModel), which {type(model).__name__} lacks")
    if kind == "msa" and not model.has_indexer:
        raise ValueError(f"policy 'msa' needs an index branch, which {type(model).__name__} has not: "
                         "convert the model to MSA first")
    return kind


def check_model(model: Any, policies: Sequence[str]) -> None:
    """ValueError when `model` cannot run one of `policies` (checked before any work starts)."""
    for policy in policies:
        _check_policy(model, policy)


# memory one result record takes when the report reads results.jsonl (a parsed dict of ~15 fields)
RECORD_BYTES = 2048
# retrieval samples built at the shortest length to check that every one fits it
LENGTH_CHECK_SAMPLES = 16


def model_selection(model: Any) -> Selection | None:
    """The selection settings the model's own layers use (an msakit or converted model), or None
    (an HF model under policies, which takes the budget's)."""
    for sel in (getattr(getattr(model, "msa_config", None), "selection", None),
                getattr(getattr(model, "config", None), "selection", None)):
        if isinstance(sel, Selection):
            return sel
    return None


def planned_samples(cfg: EvalConfig) -> int:
    """Samples (records) the settings ask for: every policy x task x length (x depth for retrieval)."""
    per_policy = sum(len(cfg.lengths) * (1 if t == "loss" else len(cfg.depths)) for t in cfg.tasks)
    return cfg.samples * len(cfg.policies) * per_policy


def check_plan(model: Any, cfg: EvalConfig, pieces: TokenPieces) -> None:
    """ValueError naming the option for settings the model or the device cannot run, before any
    sample is built or scored: a length beyond the model's positions, a budget whose block size
    differs from the model's own selection (sparse policies), a length too short for a retrieval
    task's samples, a batch of the longest length beyond the device's memory (forward logits and
    hidden states, `msakit.cost.activation_bytes`), or more samples than the report can hold in
    memory (`RECORD_BYTES` each)."""
    config = getattr(model, "config", None)
    positions = max_positions(config)
    longest = max(cfg.lengths)
    if positions is not None and longest > positions:
        raise ValueError(f"--lengths {longest:,} is beyond the model's {positions:,} positions "
                         "(max_position_embeddings)")
    own = model_selection(model)
    sparse = any(parse_policy(p)[0] not in ("dense", "last") for p in cfg.policies)
    if sparse and own is not None and own.block_size != cfg.budget.block_size:
        raise ValueError(f"--budget {cfg.budget}: the model selects blocks of {own.block_size} tokens; give a budget "
                         f"of that block size (e.g. block{own.block_size}-top{own.topk})")
    shortest = min(cfg.lengths)
    for task in (t for t in cfg.tasks if t in RETRIEVAL_TASKS):
        for length in cfg.lengths:
            n = min(cfg.samples, LENGTH_CHECK_SAMPLES) if length == shortest else 1
            for i in range(n):
                try:
                    make_sample(None, task, length, cfg.depths[0], i, seed=cfg.seed, pieces=pieces,
                                num_needles=cfg.num_needles, hops=cfg.hops)
                except ValueError as e:
                    raise ValueError(f"--lengths {length:,} is too short for {task} ({str(e).split(': ', 1)[-1]})"
                                     ) from None
    device = _device(model)
    if config is not None:
        check_batch_fits(config, min(cfg.batch_size, cfg.samples), longest, device, backward=False)
    check_memory(planned_samples(cfg) * RECORD_BYTES, "cpu", f"--samples {cfg.samples:,} "
                 f"({planned_samples(cfg):,} results, which the report reads at once)")


def configure_model(model: Any, policy: str, budget: Selection) -> str:
    """Put `model` in the attention mode and selection of `policy`; returns where the selection
    comes from ("none" for dense, "policy", or "model" for msa on a model without the hook)."""
    kind = _check_policy(model, policy)
    if kind in ("dense", "last"):
        if isinstance(model, SparseModel):
            model.set_attention_mode("dense")
        if isinstance(model, SelectionModel):
            model.set_selection_policy(None)
        return "none"
    model.set_attention_mode("sparse")
    if not isinstance(model, SelectionModel):
        return "model"
    model.set_selection_policy(make_policy(kind, budget))
    return "policy"


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def _loss_record(model: Any, ids: list[int], keep: int | None, device: torch.device) -> dict[str, Any]:
    """Per-position NLL of one document window; with `keep`, strided windows of `keep` tokens
    (stride keep // 2: every scored token has keep // 2 .. keep - 1 tokens of context)."""
    L = len(ids)
    x = torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0)
    nll = torch.empty(L - 1, dtype=torch.float32)
    if keep is None or keep >= L:
        with torch.no_grad():
            nll[:] = token_nll(model_logits(model, x), x)[0].cpu()
    else:
        stride = max(1, keep // 2)
        done = 1  # next predicted position to score
        s = 0
        while done < L:
            e = min(L, s + keep)
            with torch.no_grad():
                part = token_nll(model_logits(model, x[:, s:e]), x[:, s:e])[0].cpu()  # predicts s+1 .. e-1
            nll[done - 1:e - 1] = part[done - s - 1:]
            done = e
            s += stride
    pos = torch.arange(1, L)
    buckets = bucket_sums(nll, pos, bucket_edges(L))
    return dict(nll_sum=float(nll.double().sum()), tokens=L - 1, buckets=buckets)


def run_eval(
    model: Any, tokenizer: Any, cfg: EvalConfig, out_dir: str | os.PathLike[str], *,
    progress: bool = True, log: Callable[[str], None] | None = None, model_name: str | None = None,
    resume: bool | None = None,
) -> dict[str, Any]:
    """Evaluate `model` under every policy of `cfg`, appending to OUT/results.jsonl, then write
    the report (summary.json, table.md, plot.png) of every result the folder holds.  `resume`
    True continues an evaluation's folder, False takes a new or empty one, None either
    (`check_out`); the folder is held (locked) while the evaluation runs.  Returns the summary."""
    check_model(model, cfg.policies)
    check_plan(model, cfg, TokenPieces(encoder(tokenizer)))
    out = Path(out_dir)
    resume = check_out(out, resume)
    with claim(out, EVAL_COMMAND, resume=resume, legacy=holds_results, keep=keeps_results):
        return _run_eval(model, tokenizer, cfg, out, progress=progress, log=log or (lambda s: None),
                         model_name=model_name)


def _run_eval(model: Any, tokenizer: Any, cfg: EvalConfig, out: Path, *, progress: bool,
              log: Callable[[str], None], model_name: str | None) -> dict[str, Any]:
    # tqdm is an optional dependency (msakit[train]): imported when an evaluation runs
    from tqdm.auto import tqdm

    encode = encoder(tokenizer)
    pieces = TokenPieces(encode)
    ident = cfg.identity()
    spath = out / SETTINGS
    if spath.is_file():
        old = json.loads(spath.read_text()).get("identity", {})
        diff = {k: (old.get(k), v) for k, v in ident.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{out} holds results made with other settings {diff} (old, new): use another --out")
    spath.write_text(dumps_strict(dict(identity=ident, model=model_name, config=_jsonable(asdict(cfg))), indent=2)
                     + "\n")
    rpath = out / RESULTS
    drop_torn_tail(rpath)
    done = {r.get("key") for r in read_records(rpath)}
    device = _device(model)

    plan = []  # (policy, task, length, depth, [indices to do])
    for policy in cfg.policies:
        for task in cfg.tasks:
            if task in RULER_TASKS:
                continue
            for length in cfg.lengths:
                for depth in ([None] if task == "loss" else cfg.depths):
                    todo = [i for i in range(cfg.samples) if record_key(policy, task, length, depth, i) not in done]
                    if todo:
                        plan.append((policy, task, length, depth, todo))
    # sample index outermost: a run cut short (a time limit, a kill) leaves every (task, length) cell
    # with about the same number of samples, and --resume continues evenly
    ruler_plan = [(task, length, i, [p for p in cfg.policies if record_key(p, task, length, None, i) not in done])
                  for i in range(cfg.ruler_samples) for task in cfg.ruler_tasks for length in cfg.lengths]
    ruler_plan = [r for r in ruler_plan if r[-1]]
    ruler_gen = RulerGenerator(encode, RulerData.find(cfg.ruler_data), seed=cfg.seed) if ruler_plan else None
    total = sum(len(p[-1]) for p in plan) + sum(len(r[-1]) for r in ruler_plan)
    log(f"{total} samples to run ({len(done)} already in {rpath})")
    sparse = [p for p in cfg.policies if parse_policy(p)[0] in POLICY_NAMES]
    covered = [str(n) for n in cfg.lengths if cfg.budget.covers(n)]
    if sparse and covered:
        log(f"note: the budget {cfg.budget} ({cfg.budget.keys} keys per query) covers length {', '.join(covered)}: "
            f"{', '.join(sparse)} attend every key there, the same as dense")
    docs_cache: dict[int, list] = {}
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    bar = tqdm(total=total, disable=not progress, desc="msakit eval", unit="sample")
    current = None
    try:
        for policy, task, length, depth, todo in plan:
            if policy != current:
                source = configure_model(model, policy, cfg.budget)
                current = policy
            kind, keep = parse_policy(policy)
            bar.set_postfix_str(f"{policy} {task} {length}" + ("" if depth is None else f" d={depth:g}"))
            base = dict(policy=policy, task=task, length=length, depth=depth, selection=source, budget=str(cfg.budget))
            if task == "loss":
                if length not in docs_cache:
                    docs_cache[length] = long_documents(encode, length, cfg.samples, seed=cfg.seed, paths=cfg.documents)
                    if len(docs_cache[length]) < cfg.samples:
                        log(f"only {len(docs_cache[length])} documents have >= {length} tokens (wanted {cfg.samples})")
                docs = docs_cache[length]
                for i in todo:
                    if i >= len(docs):
                        bar.update(1)
                        continue
                    rec = _loss_record(model, docs[i].ids, keep, device)
                    _append(rpath, [dict(base, key=record_key(policy, task, length, None, i), index=i,
                                         doc=docs[i].name, **rec)])
                    bar.update(1)
                continue
            for b0 in range(0, len(todo), cfg.batch_size):
                idx = todo[b0:b0 + cfg.batch_size]
                samples = [make_sample(None, task, length, depth, i, seed=cfg.seed, pieces=pieces,
                                       num_needles=cfg.num_needles, hops=cfg.hops) for i in idx]
                ids = torch.tensor([s.input_ids for s in samples], dtype=torch.long, device=device)
                starts = [s.answer_start for s in samples]
                if keep is not None and keep < length:
                    cut = length - keep
                    if min(starts) - cut < 1:
                        raise ValueError(f"policy {policy!r} keeps {keep} tokens, fewer than the {task} answer needs")
                    ids = ids[:, cut:]
                    starts = [a - cut for a in starts]
                with torch.no_grad():
                    scores = answer_scores(model_logits(model, ids), ids, starts)
                recs = []
                for s, sc in zip(samples, scores):
                    recs.append(dict(base, key=record_key(policy, task, length, depth, s.index), index=s.index,
                                     answer=s.answer, needle_pos=s.needle_pos, **sc))
                _append(rpath, recs)
                bar.update(len(idx))
        if ruler_plan:
            current = _run_ruler(model, tokenizer, ruler_gen, ruler_plan, cfg, rpath, bar)
    finally:
        bar.close()
        if current is not None:
            configure_model(model, "dense", cfg.budget)
        if was_training and hasattr(model, "train"):
            model.train()
    records = read_records(rpath)
    return write_report(records, grid_of(records, cfg), out, model_name=model_name)


def _eos_ids(model: Any) -> list[int]:
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _run_ruler(model: Any, tokenizer: Any, gen: RulerGenerator, plan: list, cfg: EvalConfig, rpath: Path,
               bar: Any) -> str | None:
    """RULER's samples, each made once and run under every policy still to do: greedy generation
    (`greedy_generate`) of the task's tokens, scored by RULER's string match.  Generation stops
    early once the score is 1 (added text cannot lower it) or at an end-of-sequence token; the
    record keeps the generated text.  Returns the policy the model is left in."""
    decode = decoder(tokenizer)
    eos = _eos_ids(model)
    current, source = None, "none"  # configured afresh: the selection source is recorded
    for task, length, i, policies in plan:
        s = gen.sample(task, length, i)
        for policy in policies:
            if policy != current:
                source = configure_model(model, policy, cfg.budget)
                current = policy
            _, keep = parse_policy(policy)
            bar.set_postfix_str(f"{policy} {task} {length}")
            ids = s.input_ids
            if keep is not None and keep < length:
                ids = ids[-max(1, keep - s.tokens_to_generate):]
            new = greedy_generate(model, ids, s.tokens_to_generate, eos_ids=eos,
                                  stop=lambda t: ruler_score(decode(t), s.outputs, s.metric) == 1.0)
            pred = decode(new)
            _append(rpath, [dict(policy=policy, task=task, length=length, depth=None, index=i,
                                 key=record_key(policy, task, length, None, i), selection=source,
                                 budget=str(cfg.budget), score=ruler_score(pred, s.outputs, s.metric), pred=pred,
                                 outputs=s.outputs, metric=s.metric, prompt_tokens=len(ids), generated=len(new),
                                 size=s.size)])
            bar.update(1)
    return current


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
