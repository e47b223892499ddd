"""Text from model folders: a target model, its tokenizer and an optional DSpark drafter loaded
from their folders (`TextGenerator.from_folders`), and a prompt's continuation streamed as text
(`TextGenerator.stream`): plain sampling (`msakit.generate.generate`, optionally the compiled paged step) or
speculative decoding (`speculative_generate`, the same distribution).

Folders are what `msakit train` / `convert` / `train-drafter` write: a run folder (its latest
checkpoint), a checkpoint or a model folder; each is checked (a drafter is not a target, a dense
HF model needs converting first) before anything is loaded.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from msakit.generate import generate, paged_supported
from msakit.models import M3ForCausalLM
from msakit.speculative.drafter import DSparkDrafter
from msakit.speculative.generate import SpecStats, speculative_generate
from msakit.train.folders import (check_context, check_vocab, folder_kind, load_model_folder, loading,
                                  model_folder, tokenizer_beside)
from msakit.train.metrics import autocast_for
from msakit.train.tokenizer import TextStreamer, Tokenizer

__all__ = ["TextGenerator", "load_drafter"]


def load_drafter(path: Path, device: torch.device | str | None = None) -> DSparkDrafter:
    """A DSpark drafter from a drafter run folder (its latest checkpoint), checkpoint or folder."""
    folder = model_folder(path, "drafter")
    if folder_kind(folder) != "drafter":
        raise ValueError(f"--drafter {path} is not a DSpark drafter (train one with `msakit train-drafter`)")
    with loading(folder, "the drafter"):
        return DSparkDrafter.from_pretrained(folder, device=device)


@dataclass
class TextGenerator:
    """A target model on `device` with its tokenizer and, for speculative decoding, a drafter;
    `compile` runs plain decoding's step under torch.compile."""

    model: Any
    tokenizer: Tokenizer
    device: torch.device
    drafter: DSparkDrafter | None = None
    compile: bool = False

    @classmethod
    def from_folders(cls, checkpoint: str | Path, *, device: torch.device | str, tokenizer: str | Path | None = None,
                     drafter: str | Path | None = None, compile: bool = False) -> "TextGenerator":
        """The model in `checkpoint` (run, checkpoint or model folder) on `device`, the tokenizer
        `tokenizer` (a tokenizer.json; default: the one saved beside the model) and the DSpark
        drafter in `drafter` (a train-drafter run, checkpoint or drafter folder)."""
        if compile and drafter:
            raise ValueError("--compile compiles plain decoding's step; it does not take --drafter")
        folder = model_folder(Path(checkpoint))
        kind = folder_kind(folder)
        if kind == "drafter":
            raise ValueError(f"{checkpoint} is a DSpark drafter, not a model: pass the target model as CHECKPOINT "
                             f"and this folder as --drafter")
        if kind == "hf-dense":
            raise ValueError(f"{checkpoint} is a dense HF model without MSA index branches: convert it first "
                             f"(`msakit convert {checkpoint} --out RUN`), then `msakit generate RUN`")
        tok = Tokenizer.load(tokenizer) if tokenizer else tokenizer_beside(Path(checkpoint))
        dr = load_drafter(Path(drafter), device) if drafter else None
        model = load_model_folder(folder, device=device)
        check_vocab(model, tok)
        if compile:
            why = "it is a converted HF model (contiguous cache)" if not isinstance(model, M3ForCausalLM) \
                else paged_supported(model)
            if why is not None:
                raise ValueError(f"--compile needs an msakit model on the paged cache: {why}")
        if dr is not None:
            dr.config.check_target(model.config)
        return cls(model, tok, torch.device(device), dr, compile)

    def stream(self, prompt: str, out: TextIO | None = None, *, max_new_tokens: int = 200, temperature: float = 0.8,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               mode: str = "sparse", compare: bool = True) -> SpecStats | None:
        """Write `prompt` and then its sampled continuation (up to `max_new_tokens` tokens, ending
        at the end-of-text token) to `out` (default stdout) as it is produced, then a newline;
        `mode` is the attention mode ("sparse" / "dense").  An empty prompt starts a new document.
        Returns the speculative decoding statistics (None without a drafter), with its decoding
        speed after the first token and, with `compare`, plain decoding's speed on the same prompt
        (PROBE_TOKENS tokens, not written), for `SpecStats.cost_warning`."""
        out = out if out is not None else sys.stdout
        model, tok, device = self.model, self.tokenizer, self.device
        model.set_attention_mode(mode)
        ids = tok.encode(prompt) if prompt else []
        if not ids:
            ids = [tok.eos_id]  # an empty prompt starts a new document
        check_context(model.config, len(ids) + max_new_tokens)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.tensor([ids], dtype=torch.long, device=device)
        out.write(prompt)
        out.flush()
        streamer = TextStreamer(tok, out, eos_id=tok.eos_id)
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=gen, eos_token_id=tok.eos_id)
        stats = None
        with torch.no_grad(), autocast_for(device):
            if self.drafter is None:
                generate(model, x, max_new_tokens, streamer=streamer, **sample,
                               **({"compile": True} if self.compile else {}))
            else:
                clock = _Clock()

                def push_rows(rows: list[list[int]]) -> None:
                    clock.tick(len(rows[0]))
                    for t in rows[0]:
                        streamer.push(int(t))

                _, stats = speculative_generate(model, self.drafter, x, max_new_tokens, streamer=push_rows,
                                                return_stats=True, **sample)
                stats.tokens_per_s = clock.rate()
        out.write("\n")
        out.flush()
        if stats is not None and compare and stats.tokens_per_s:
            stats.plain_tokens_per_s = self._plain_rate(x, min(max_new_tokens, PROBE_TOKENS), temperature=temperature,
                                                        top_k=top_k, top_p=top_p, seed=seed)
        return stats

    def _plain_rate(self, x: torch.Tensor, n: int, **sampling: Any) -> float | None:
        """Plain decoding's tokens per second after the first of `n` tokens from prompt `x` [1, T]."""
        clock = _Clock()
        gen = torch.Generator(device="cpu").manual_seed(sampling.pop("seed"))
        with torch.no_grad(), autocast_for(self.device):
            generate(self.model, x, n, streamer=lambda t: clock.tick(1), generator=gen, **sampling)
        return clock.rate()


PROBE_TOKENS = 16  # plain decoding's tokens timed to compare speculative decoding with


class _Clock:
    """The times of a streamer's calls and the tokens each brought: the decoding speed after the
    first call (the prefill excluded)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []

    def tick(self, n: int) -> None:
        self.times.append(time.perf_counter())
        self.counts.append(n)

    def rate(self) -> float | None:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return None
        return sum(self.counts[1:]) / (self.times[-1] - self.times[0])
