"""Block selections for the prefill benchmark, in the layout of `msakit.ops.index_topk`.

A trained indexer does not spread its choices uniformly: every query takes its own block, a few
local blocks and block 0, and then long-range "stripes" that all later queries share.  Popular
blocks are then chosen by every query past them.  `trained_like_block_idx` builds that pattern
directly; `dump_block_idx` records the selections a model's indexer makes (run as a script, it
writes them from a trained checkpoint), and `load_block_idx` reads such a file back.

    python benchmarks/selections.py --model runs/train/final --context 131072 --layer 3 --out sel.pt

Layout (docs/msa.md): int32 [B, G, T, topk]; row (b, r, i) holds distinct block ids <= the
query's own block i // block_size, valid ids first (ascending here), -1 padding only when the row
has fewer than topk valid blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch


def stripe_ids(nblocks: int, groups: int, stripes: int, seed: int = 0) -> torch.Tensor:
    """int64 [groups, min(stripes, nblocks - 1)]: per group, distinct random block ids in
    [1, nblocks), ascending (block 0 is forced anyway).  Deterministic in `seed` (CPU generator)."""
    n = min(stripes, max(0, nblocks - 1))
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randperm(max(0, nblocks - 1), generator=g)[:n] + 1).sort().values for _ in range(groups)]
    return torch.stack(rows)


def trained_like_rows(nblocks: int, groups: int, topk: int = 16, *, local_blocks: int = 3,
                      stripes: int = 11, seed: int = 0, device=None) -> torch.Tensor:
    """int32 [groups, nblocks, topk]: the selection of any query whose own block is o, per group.

    In priority order: o, the `local_blocks` blocks before it, block 0; the group's stripes s < o
    (each taken by every query past it); then, while slots are left, the blocks before the local
    window from the most recent down (a trained indexer's extra choices are mostly near).  The
    first `topk` distinct valid ids, ascending, then -1 padding (rows with o + 1 < topk)."""
    if topk < 1 or nblocks < 1 or groups < 1:
        raise ValueError(f"topk, nblocks and groups must be >= 1, got {topk}, {nblocks}, {groups}")
    if local_blocks < 0 or stripes < 0:
        raise ValueError(f"local_blocks and stripes must be >= 0, got {local_blocks}, {stripes}")
    own = torch.arange(nblocks, device=device).view(nblocks, 1)  # [nb, 1]
    forced = torch.cat([own - torch.arange(local_blocks + 1, device=device).view(1, -1),
                        torch.zeros_like(own)], dim=1)  # [nb, local + 2]
    s = stripe_ids(nblocks, groups, stripes, seed).to(device)  # [G, S]
    n_fill = topk + s.shape[1]  # enough: at most S of these are stripes
    fill = own - local_blocks - 1 - torch.arange(n_fill, device=device).view(1, -1)  # [nb, n_fill]
    out = torch.empty(groups, nblocks, topk, dtype=torch.int32, device=device)
    for r in range(groups):
        st = s[r].view(1, -1).expand(nblocks, -1)
        # a filler block that is a stripe is left to the stripe (duplicates are dropped below)
        cand = torch.cat([forced, torch.where(st <= own, st, torch.full_like(st, -1)), fill], dim=1)  # [nb, L]
        valid = (cand >= 0) & (cand <= own)
        cand = torch.where(valid, cand, torch.full_like(cand, -1))
        L = cand.shape[1]
        earlier = torch.ones(L, L, dtype=torch.bool, device=device).tril(-1)  # [j, j'] = j' < j
        dup = ((cand.unsqueeze(2) == cand.unsqueeze(1)) & earlier).any(2)  # equals an earlier entry
        keep = valid & ~dup
        keep &= keep.cumsum(1) <= topk
        big = torch.iinfo(torch.int64).max
        chosen = torch.where(keep, cand, torch.full_like(cand, big)).sort(dim=1).values[:, :topk]
        out[r] = torch.where(chosen == big, torch.full_like(chosen, -1), chosen).to(torch.int32)
    return out


def trained_like_block_idx(T: int, *, block_size: int = 128, topk: int = 16, batch: int = 1, groups: int = 4,
                           local_blocks: int = 3, stripes: int = 11, seed: int = 0, device=None) -> torch.Tensor:
    """int32 [batch, groups, T, topk]: `trained_like_rows` for every query (query i takes its own
    block's row); the same stripes in every batch row."""
    if T < 1 or block_size < 1:
        raise ValueError(f"T and block_size must be >= 1, got {T}, {block_size}")
    nb = (T + block_size - 1) // block_size
    rows = trained_like_rows(nb, groups, topk, local_blocks=local_blocks, stripes=stripes, seed=seed, device=device)
    own = torch.arange(T, device=device) // block_size
    return rows[:, own].unsqueeze(0).expand(batch, groups, T, topk).contiguous()


def load_block_idx(path: str | Path, *, B: int, G: int, T: int, topk: int, block_size: int | None = None,
                   device=None) -> torch.Tensor:
    """A dumped selection: a torch file holding an int tensor [B, G, T, topk] (or a dict with key
    "block_idx", and "block_size" checked against `block_size` when both are given), or a
    .safetensors file with tensor "block_idx".  Groups are tiled when the file holds fewer groups
    that divide G (a model with fewer KV groups); raises ValueError when the selection cannot
    serve [B, G, T, topk] at `block_size`."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        bi = load_file(str(path))["block_idx"]
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        bi = obj["block_idx"] if isinstance(obj, dict) else obj
        saved_bs = obj.get("block_size") if isinstance(obj, dict) else None
        if block_size is not None and saved_bs is not None and int(saved_bs) != block_size:
            raise ValueError(f"{path}: a selection over blocks of {saved_bs} tokens cannot serve blocks of {block_size}")
    if not isinstance(bi, torch.Tensor) or bi.dim() != 4 or bi.dtype.is_floating_point:
        raise ValueError(f"{path}: expected an integer block_idx [B, G, T, topk]")
    b, g, t, k = bi.shape
    if t != T or k != topk or b not in (1, B) or G % g:
        raise ValueError(f"{path}: block_idx {tuple(bi.shape)} cannot serve [B={B}, G={G}, T={T}, topk={topk}]")
    bi = bi.expand(B, g, T, topk).repeat_interleave(G // g, dim=1)
    return bi.to(device=device, dtype=torch.int32).contiguous()


def selection_stats(block_idx: torch.Tensor, block_size: int) -> dict:
    """Shape of a selection: mean valid slots per row; the most popular block's row count over T
    (per group, averaged: 1.0 when every query takes it, the length of a KV-outer kernel's longest
    item list in rows); and the mean number of distinct blocks per tile of 128 consecutive
    queries (the union a query-outer tile loads)."""
    B, G, T, K = block_idx.shape
    nb = (T + block_size - 1) // block_size
    bi = block_idx.long()
    valid = bi >= 0
    counts = torch.zeros(B * G, nb + 1, dtype=torch.int64, device=bi.device)
    flat = torch.where(valid, bi, torch.full_like(bi, nb)).view(B * G, -1)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    share = counts[:, :nb].max(1).values.float().mean() / T
    tile = 128
    nt = T // tile
    distinct = float("nan")
    if nt:
        t = bi[:, :, : nt * tile].reshape(B * G * nt, tile * K)
        s = t.sort(1).values
        distinct = float(((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(1).add((s[:, 0] >= 0).long()).float().mean())
    return {"valid_slots_per_row": float(valid.sum(-1).float().mean()), "top_block_rows_over_T": float(share),
            "distinct_blocks_per_128_queries": distinct}


def dump_block_idx(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The block_idx of every `msakit.ops.index_topk` call that model(input_ids) makes (one per MSA
    layer, in call order), in the model's current attention mode ("sparse" to select)."""
    from msakit import ops

    captured: list[torch.Tensor] = []
    orig = ops.index_topk

    def spy(*args, **kwargs):
        out = orig(*args, **kwargs)
        captured.append(out.detach().to("cpu", torch.int32))
        return out

    ops.index_topk = spy
    try:
        with torch.no_grad():
            model(input_ids, compute_kl=False)
    finally:
        ops.index_topk = orig
    return captured


def _corpus_tokens(model_dir: Path, T: int) -> torch.Tensor:
    """T tokens of held-out text (the corpus's validation files) in the tokenizer beside the model."""
    from msakit.train.corpus import build_corpus
    from msakit.train.data import encode_files
    from msakit.train.tokenizer import Tokenizer

    tok_path = next((p for p in (model_dir / "tokenizer.json", model_dir.parent / "tokenizer.json") if p.is_file()), None)
    if tok_path is None:
        raise FileNotFoundError(f"no tokenizer.json beside {model_dir}: pass --tokens")
    tok = Tokenizer.load(tok_path)
    corpus = build_corpus(val_fraction=0.02)
    stream = encode_files(tok, corpus.val + corpus.train, max_tokens=T)
    if len(stream) < T:
        raise ValueError(f"the corpus holds {len(stream)} tokens, fewer than --context {T}")
    return torch.from_numpy(stream.tokens[:T].astype("int64")).view(1, T)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="dump a trained model's selections for prefill.py --selection-file")
    ap.add_argument("--model", required=True, help="a model folder (config.json + safetensors)")
    ap.add_argument("--context", type=int, default=8192, help="tokens of held-out text to run")
    ap.add_argument("--tokens", default=None, help="a torch file with input ids [1, T] instead of the corpus")
    ap.add_argument("--layer", type=int, default=0, help="which MSA layer's selection (in call order)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from msakit.models import M3ForCausalLM

    model = M3ForCausalLM.from_pretrained(args.model, device=args.device).eval()
    model.set_attention_mode("sparse")
    ids = (torch.load(args.tokens, weights_only=True) if args.tokens else _corpus_tokens(Path(args.model), args.context))
    sels = dump_block_idx(model, ids.to(args.device))
    if not sels:
        raise SystemExit("the model made no index_topk call (no MSA layer in sparse mode?)")
    bi = sels[args.layer]
    cfg = model.config
    torch.save({"block_idx": bi, "block_size": cfg.index_block_size, "layer": args.layer, "model": str(args.model)},
               args.out)
    print(f"wrote {args.out}: block_idx {tuple(bi.shape)}, blocks of {cfg.index_block_size}, "
          f"{selection_stats(bi, cfg.index_block_size)}")


if __name__ == "__main__":
    main()
