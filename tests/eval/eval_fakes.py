"""Shared helpers of tests/eval: a tiny tokenizer and fake models exposing the policy hook.

`PolicyModel` is a one-layer attention LM whose forward calls the selection policy it was given
(``set_selection_policy``) on its own q, k, q_idx, k_idx and attends through
``ops.sparse_attention``: the model-level path of msakit.eval without touching the library.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from msakit import ops
from msakit.ops.index_topk import Selection
from msakit.eval.tasks import NIAH_INTRO, NOISE, PASSKEY_INTRO, VT_INTRO


def tiny_tokenizer(vocab_size: int = 360):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = [NOISE * 4, PASSKEY_INTRO, NIAH_INTRO, VT_INTRO, "The pass key is 12345. VAR ABCDE = VAR FGHIJ."]
    tok.train_from_iterator(text, trainer)
    return tok


class PolicyModel(nn.Module):
    """Embedding -> one GQA attention layer (Hq=4, G=2, D=8, index dim 8) -> logits [B, T, V].

    It declares `msakit.models.interface.SelectionModel` (``has_indexer``, ``attention_mode``,
    ``set_attention_mode``, ``set_selection_policy``), the hook the eval expects; every forward
    and every policy call are counted."""

    has_indexer = True  # q_idx / k_idx: the msa policy runs

    def __init__(self, vocab: int, block_size: int = 16, topk: int = 2, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.V, self.Hq, self.G, self.D = vocab, 4, 2, 8
        self.emb = nn.Parameter(torch.randn(vocab, 32, generator=g) * 0.5)
        self.wq = nn.Parameter(torch.randn(32, self.Hq * self.D, generator=g) * 0.3)
        self.wk = nn.Parameter(torch.randn(32, self.G * self.D, generator=g) * 0.3)
        self.wv = nn.Parameter(torch.randn(32, self.G * self.D, generator=g) * 0.3)
        self.wqi = nn.Parameter(torch.randn(32, self.G * 8, generator=g) * 0.3)
        self.wki = nn.Parameter(torch.randn(32, 8, generator=g) * 0.3)
        self.out = nn.Parameter(torch.randn(self.Hq * self.D + 32, vocab, generator=g) * 0.3)
        self.sel = Selection(block_size, topk)
        self.mode = "dense"
        self.policy = None
        self.forwards = 0
        self.policy_calls: list[tuple[int, tuple[int, ...]]] = []

    @property
    def attention_mode(self) -> str:
        return self.mode

    def set_attention_mode(self, mode: str) -> None:
        if mode not in ("dense", "sparse"):
            raise ValueError(mode)
        self.mode = mode

    def set_selection_policy(self, fn) -> None:
        self.policy = fn

    def forward(self, input_ids: torch.Tensor, compute_kl: bool = True):
        assert compute_kl is False, "eval must not ask for the KL term"
        self.forwards += 1
        B, T = input_ids.shape
        h = self.emb[input_ids]
        q = (h @ self.wq).view(B, T, self.Hq, self.D)
        k = (h @ self.wk).view(B, T, self.G, self.D)
        v = (h @ self.wv).view(B, T, self.G, self.D)
        q_idx = (h @ self.wqi).view(B, T, self.G, 8)
        k_idx = h @ self.wki
        if self.mode == "sparse":
            if self.policy is not None:
                bidx = self.policy(0, q, k, q_idx, k_idx, self.sel)
                self.policy_calls.append((0, tuple(bidx.shape)))
            else:
                bidx = ops.index_topk(q_idx, k_idx, block_size=self.sel.block_size, topk=self.sel.topk)
            o = ops.sparse_attention(q, k, v, bidx, block_size=self.sel.block_size)
        else:
            o = ops.dense_attention(q, k, v)
        logits = torch.cat([o.reshape(B, T, -1), h], dim=-1) @ self.out
        return SimpleNamespace(logits=logits)


class BigramModel(nn.Module):
    """logits[t] = table[input_ids[t]]: deterministic, cheap, for greedy-vs-teacher-forced checks."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids: torch.Tensor):
        return SimpleNamespace(logits=self.table[input_ids])


class PlainModel(nn.Module):
    """A dense-only model (no policy hook): logits from an embedding."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids: torch.Tensor):
        return SimpleNamespace(logits=self.emb[input_ids])
