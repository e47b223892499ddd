"""Shared helpers of the speculative-decoding tests: a tiny target / drafter pair."""

from __future__ import annotations

import torch

from msakit.speculative import DSparkConfig, DSparkDrafter

from toy_model import small_target


def bigram_pair(mode: str = "sparse", *, head_scale: float = 20.0, layer_scale: float = 0.5, vocab: int = 64,
                block: int = 4):
    """A tiny target (layer 0 dense GQA, layer 1 MSA with blocks of `block` (4; 16 for the paged
    cache, whose pages are the blocks), top-2) whose next-token
    logits are mostly a bigram of the current token (residual branches scaled by layer_scale),
    and a drafter whose base logits are zero (final_norm scale 0) and whose Markov head is that
    bigram exactly (rank = vocab, W1 = I): it drafts well but not perfectly, so rounds see both
    acceptances and rejections."""
    t = small_target(vocab, 0, mode, index_block_size=block)
    with torch.no_grad():
        for n, p in t.named_parameters():
            if n.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.mul_(layer_scale)
        t.lm_head.weight.mul_(head_scale)
    torch.manual_seed(1)
    d = DSparkDrafter(DSparkConfig.for_target(t.config, "tiny", markov_rank=vocab)).bind(t)
    with torch.no_grad():
        d.final_norm.weight.fill_(-1.0)  # (1 + w) = 0: zero base logits
        d.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        d.markov_head.markov_w2.weight.copy_(t.lm_head(t.model.norm(t.model.embed_tokens.weight)).t())
        d.confidence_head.proj.weight.normal_(0, 0.5)
    return t, d.eval()
