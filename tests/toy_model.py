"""The model the training tests train: the real `M3ForCausalLM` at toy size (hidden 32, 2 layers,
blocks of 8, top-2), so that a step takes milliseconds on a CPU."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from msakit.models import M3Config, M3ForCausalLM

TOY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           index_head_dim=8, rotary_dim=4, index_block_size=8, index_topk_blocks=2, num_local_experts=4,
           num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=64,
           max_position_embeddings=256)


def toy_config(vocab_size: int = 300, **overrides) -> M3Config:
    return M3Config.preset("tiny", **{**TOY, "vocab_size": vocab_size, **overrides})


def make_model(vocab_size: int = 300, **overrides) -> M3ForCausalLM:
    torch.manual_seed(0)
    return M3ForCausalLM(toy_config(vocab_size, **overrides))


# layer 0 dense GQA, layer 1 MSA; blocks of 4, top-2 (by position 20 a query sees 6 blocks and
# attends 2 of them in sparse mode)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             index_head_dim=16, rotary_dim=8, dense_intermediate_size=64, intermediate_size=32,
             shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, index_block_size=4,
             index_topk_blocks=2, sparse_attention_freq=[0, 1])


def randomize_norms(model: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    """Draws the trainable 1-D weights (the norms' scales, index branch included) from N(0, std),
    so that they are not the trivial zeros of a fresh model; returns `model`."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.requires_grad:
                p.normal_(0, std)
    return model


def small_target(vocab_size: int = 64, seed: int = 0, mode: str = "sparse", **overrides) -> M3ForCausalLM:
    """The generation and speculative tests' target: `SMALL` (with `overrides`) seeded by `seed`,
    its norms drawn by `randomize_norms`, in eval mode."""
    cfg = M3Config.preset("tiny", **{**SMALL, "vocab_size": vocab_size, **overrides})
    torch.manual_seed(seed)
    return randomize_norms(M3ForCausalLM(cfg, mode=mode)).eval()


def paged_model(mode: str, seed: int = 0, device: str = "cpu", layers=(0, 1, 1)) -> M3ForCausalLM:
    """The decoding tests' model: the tiny preset with pages (= blocks) of 16 and top-2 blocks;
    `layers` holds 0 (dense GQA) / 1 (MSA) per layer, MoE in layers >= 1.  A 40-token prompt spans
    3 pages, so sparse decoding really skips a page.  Norm weights drawn by `randomize_norms`."""
    cfg = M3Config.preset("tiny", vocab_size=256, num_hidden_layers=len(layers), index_block_size=16,
                          index_topk_blocks=2, sparse_attention_freq=list(layers), num_local_experts=4)
    torch.manual_seed(seed)
    return randomize_norms(M3ForCausalLM(cfg, mode=mode)).to(device).eval()


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_data(folder: Path, files: list[str], val_fraction: float):
    """The training tests' corpus: the stdlib modules `files` (paths under the stdlib folder) copied
    into `folder`, prepared with a 300-token vocabulary and 64-token rows (cache under folder/cache)."""
    from msakit.train.data import prepare_data

    for n in files:
        (folder / n.replace("/", "_")).write_text((STDLIB / n).read_text())
    return prepare_data([folder], stdlib=False, vocab_size=300, context=64, cache_dir=folder / "cache",
                        val_fraction=val_fraction)
