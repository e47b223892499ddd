"""`DSparkDrafter`: DSpark's parallel block drafter with a Markov head and a confidence head.

    taps     = [H(l1); ...; H(lm)]     target residual stream after each tap layer (the last layer's
                                       before the final norm: `output_hidden_states[l + 1]`)
    ctx      = hidden_norm(fc(taps))   [B, T, H], injected as keys / values in every draft layer
    block    = [anchor, noise x (gamma - 1)] at positions L .. L + gamma - 1 (L = anchor position)
    layer i  : x = input_layernorm(h); q from x; k, v = [k_proj(ctx); k_proj(x)] (ctx not normed
               again, as in DFlash); attention bidirectional inside the block, to the context causal
               up to the anchor (keys L - W < j < L, W = sliding_window); o_proj; SwiGLU-OAI MLP
    h_k      = final_norm(h)[k]        row k predicts position L + k + 1
    logits_k = lm_head(h_k) + W2 W1[x_(k-1)]    (the target's frozen output head; x_(-1) = anchor,
                                                then the token drafted / given at row k - 1)
    c_k      = sigmoid(proj([h_k ; W1[x_(k-1)]]))  survival of draft k given drafts < k survived

The embedding and output head are the target's (shared, frozen, never stored with the drafter):
`bind(target)` attaches them.  Weight names follow the released M3.1 drafter (prefix
``language_model.model.dspark.`` in the released checkpoint, accepted on load): ``fc``,
``hidden_norm``, ``final_norm``, ``markov_head.markov_w1/2``, ``confidence_head.proj``,
``layers.{i}.decoder_layer.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}``.  MXFP8 tensors (``weight`` float8_e4m3fn
+ ``weight_scale_inv`` E8M0 [rows, cols / 32]) are dequantized on load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from msakit.models.io import ModelFolderError, check_finite, reading
from msakit.nn.attention import GQAProjections
from msakit.nn.mlp import SwiGLUMLP
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin
from msakit.quant.formats import mxfp8_dequantize
from msakit.speculative.config import DSparkConfig
from msakit.speculative.verify import check_sampling, sample_probs, sampling_probs

__all__ = ["DSparkDrafter", "DSparkAttention", "DSparkDecoderLayer", "MarkovHead", "ConfidenceHead",
           "DraftProposal", "RELEASED_PREFIX", "block_mask"]

RELEASED_PREFIX = "language_model.model.dspark."
WEIGHTS_FILE = "model.safetensors"


class DSparkAttention(GQAProjections):
    """GQA attention whose keys / values are [context ; block] (HF names q/k/v/o_proj, q/k_norm)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.rms_norm_eps)
        self.cfg = cfg

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if not c.rotary_dim:
            return x
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
        return apply_partial_rope(x, cos, sin)

    def query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        return self._rope(self.q_norm(self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)), positions)

    def key_value(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] at positions [B or 1, T] -> k (normed, RoPE'd), v [B, T, G, D]."""
        B, T, _ = x.shape
        c = self.cfg
        k = self._rope(self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)), positions)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, Tb, H] (block rows, already input-normed); ctx_k / ctx_v [B, Tc, G, D];
        mask bool [B, 1, Tb, Tc + Tb] (True = attend) -> [B, Tb, H]."""
        c = self.cfg
        B, Tb, _ = x.shape
        q = self.query(x, positions)
        kb, vb = self.key_value(x, positions)
        k = torch.cat([ctx_k.to(kb.dtype), kb], dim=1)
        v = torch.cat([ctx_v.to(vb.dtype), vb], dim=1)
        rep = c.num_attention_heads // c.num_key_value_heads
        qh = q.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(rep, dim=1).to(qh.dtype)
        vh = v.transpose(1, 2).repeat_interleave(rep, dim=1).to(qh.dtype)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, Tb, -1))


class DSparkDecoderLayer(nn.Module):
    """Pre-norm dense layer: attention over [context ; block] and a SwiGLU-OAI MLP."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = GemmaRMSNorm(H, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(H, cfg.intermediate_size, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)

    def forward(self, h, positions, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _LayerSlot(nn.Module):
    """`layers.{i}.decoder_layer` (the released layout nests each layer one level deeper)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.decoder_layer = DSparkDecoderLayer(cfg)


class MarkovHead(nn.Module):
    """Low-rank first-order bias: bias(prev) = W2 W1[prev]; W1 = markov_w1.weight [V, r] (an
    embedding), W2 = markov_w2.weight [V, r] (a linear r -> V)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def feature(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """prev int64 [...] -> bias [..., V]."""
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """c = sigmoid(proj([h ; W1[prev]]))  (proj: Linear(H [+ r], 1) with bias)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., F] -> confidence logits [...] (float32)."""
        return self.proj(features).float().squeeze(-1)


@dataclass
class DraftProposal:
    """One round of drafts: tokens [B, g], the exact distributions they were drawn from [B, g, V]
    (None when greedy) and the confidence head's survival probabilities [B, g] (or None)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor | None


def block_mask(
    anchors: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: int,
    ctx_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention mask of blocks anchored at `anchors` int64 [B, A] over keys [context (ctx_len) ;
    A blocks of block_size] -> bool [B, 1, A * block_size, ctx_len + A * block_size].

    A block's rows see the context keys j with anchor - window < j < anchor (and ctx_valid[b, j]
    when given), and every row of their own block (bidirectional)."""
    B, A = anchors.shape
    dev = anchors.device
    j = torch.arange(ctx_len, device=dev).view(1, 1, ctx_len)
    L = anchors.unsqueeze(-1)  # [B, A, 1]
    ctx = (j < L) & (j > L - window)  # [B, A, Tc]
    if ctx_valid is not None:
        ctx = ctx & ctx_valid.unsqueeze(1)
    ctx = ctx.unsqueeze(2).expand(B, A, block_size, ctx_len).reshape(B, A * block_size, ctx_len)
    blk = torch.eye(A, dtype=torch.bool, device=dev).repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    blk = blk.unsqueeze(0).expand(B, A * block_size, A * block_size)
    return torch.cat([ctx, blk], dim=-1).unsqueeze(1)


class DSparkDrafter(nn.Module):
    """The DSpark drafter.  See the module docstring for the computation and the weight names."""

    def __init__(self, config: DSparkConfig, *, init: bool = True) -> None:
        super().__init__()
        if not isinstance(config, DSparkConfig):
            raise ValueError(f"config must be a DSparkConfig, got {type(config).__name__}")
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.num_taps * H, H, bias=False)
        self.hidden_norm = GemmaRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(_LayerSlot(config) for _ in range(config.num_hidden_layers))
        self.final_norm = GemmaRMSNorm(H, config.rms_norm_eps)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank) if config.has_markov else None
        if config.enable_confidence_head:
            extra = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(H + extra)
        else:
            self.confidence_head = None
        self._target: Any = None
        if init:
            self.reset_parameters()

    # -- target binding ------------------------------------------------------------------------
    def bind(self, target: nn.Module) -> "DSparkDrafter":
        """Attach the target whose embedding and output head the drafter shares (not stored as a
        submodule: the drafter's state_dict holds only its own weights).  Checks compatibility."""
        cfg = getattr(target, "config", None)
        if cfg is None:
            raise ValueError("the target must have a .config (an M3Config)")
        self.config.check_target(cfg)
        object.__setattr__(self, "_target", target)
        return self

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise ValueError("the drafter is not bound to a target: call drafter.bind(target) first")
        return self._target

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(h)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- init ----------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for projections (o_proj / down_proj scaled by
        1/sqrt(2 * layers)); Gemma norms 0; Markov W1 normal(0, 1/sqrt(r)) and W2 zero (the bias
        starts at 0); confidence head zero (c = 0.5)."""
        c = self.config
        std = c.initializer_range
        out_std = std / math.sqrt(2 * c.num_hidden_layers)
        nn.init.normal_(self.fc.weight, std=std)
        for slot in self.layers:
            layer = slot.decoder_layer
            a = layer.self_attn
            for lin in (a.q_proj, a.k_proj, a.v_proj):
                nn.init.normal_(lin.weight, std=std)
            nn.init.normal_(a.o_proj.weight, std=out_std)
            layer.mlp.reset_parameters(std, out_std)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                nn.init.zeros_(m.weight)
        if self.markov_head is not None:
            nn.init.normal_(self.markov_head.markov_w1.weight, std=1.0 / math.sqrt(c.markov_rank))
            nn.init.zeros_(self.markov_head.markov_w2.weight)
        if self.confidence_head is not None:
            nn.init.zeros_(self.confidence_head.proj.weight)
            nn.init.zeros_(self.confidence_head.proj.bias)

    # -- pieces --------------------------------------------------------------------------------
    def taps_from_hidden_states(self, hidden_states: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target's `output_hidden_states` ([0] = embeddings, [l + 1] = after layer l, before
        the final norm) -> the concatenated taps [B, T, num_taps * H]."""
        n = len(hidden_states) - 1
        bad = [t for t in self.config.target_layer_ids if t >= n]
        if bad:
            raise ValueError(f"tap layer(s) {bad} beyond the target's depth ({n} layers)")
        return torch.cat([hidden_states[t + 1] for t in self.config.target_layer_ids], dim=-1)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, num_taps * H] -> hidden_norm(fc(taps)) [B, T, H]."""
        if taps.shape[-1] != self.fc.in_features:
            raise ValueError(f"taps must have {self.fc.in_features} features ({self.config.num_taps} taps x "
                             f"{self.config.hidden_size}), got {taps.shape[-1]}")
        if not torch.is_autocast_enabled(taps.device.type):
            taps = taps.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the context's keys / values [B, T, G, D] at positions [B or 1, T]."""
        return [slot.decoder_layer.self_attn.key_value(ctx, positions) for slot in self.layers]

    def block_ids(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor tokens int64 [...] -> block inputs [..., gamma]: [anchor, noise x (gamma - 1)]."""
        g = self.config.draft_block_size
        noise = torch.full((*anchor_tokens.shape, g - 1), self.config.noise_token_id, dtype=torch.long,
                           device=anchor_tokens.device)
        return torch.cat([anchor_tokens.long().unsqueeze(-1), noise], dim=-1)

    def run_blocks(
        self,
        block_tokens: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """block_tokens / positions [B, Tb]; ctx_kv per layer; mask [B, 1, Tb, Tc + Tb] ->
        final-normed hidden states [B, Tb, H]."""
        h = self.embed(block_tokens)
        for slot, (k, v) in zip(self.layers, ctx_kv):
            h = slot.decoder_layer(h, block_positions, k, v, mask)
        return self.final_norm(h)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor | None:
        return None if self.markov_head is None else self.markov_head(prev)

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """h [..., H], prev int64 [...] -> the confidence head's logits [...] (None without one)."""
        if self.confidence_head is None:
            return None
        feat = h
        if self.config.confidence_head_with_markov:
            feat = torch.cat([h, self.markov_head.feature(prev).to(h.dtype)], dim=-1)
        return self.confidence_head(feat)

    # -- training forward ----------------------------------------------------------------------
    def forward(self, taps: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training / teacher-forced forward.

        taps [B, T, num_taps * H] (the target's hidden states over input_ids), input_ids [B, T],
        anchors int64 [B, A] (positions L with 1 <= L < T) -> final-normed hidden states
        [B, A, gamma, H]; row j of block a predicts input position anchors[:, a] + j + 1.
        """
        B, T = input_ids.shape
        A = anchors.shape[1]
        g = self.config.draft_block_size
        ctx = self.context(taps)
        pos = torch.arange(T, device=input_ids.device).unsqueeze(0)
        kv = self.context_kv(ctx, pos)
        anchor_tok = input_ids.gather(1, anchors)
        ids = self.block_ids(anchor_tok).reshape(B, A * g)
        bpos = (anchors.unsqueeze(-1) + torch.arange(g, device=anchors.device)).reshape(B, A * g)
        mask = block_mask(anchors, T, g, self.config.sliding_window)
        h = self.run_blocks(ids, bpos, kv, mask)
        return h.view(B, A, g, -1)

    # -- inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(
        self,
        h: torch.Tensor,
        anchor: torch.Tensor,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        num_drafts: int | None = None,
        want_confidence: bool = False,
        noise: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Draw the drafts of one block: h [B, gamma, H] (`run_blocks` output), anchor int64 [B].

        Row k's distribution is sampling_probs(lm_head(h_k) + W2 W1[x_(k-1)]) with x_(-1) = the
        anchor, drawn left to right (the Markov bias needs the previous draft); without a Markov
        head all rows are drawn at once.  Temperature 0 takes argmaxes (probs None).  noise
        (float32 [B, >= num_drafts, V], Exp(1)): the race noise of the draws, drawn beforehand
        (then `generator` is not used; see `sample_probs`)."""
        check_sampling(temperature, top_k, top_p)
        g = self.config.draft_block_size if num_drafts is None else int(num_drafts)
        h = h[:, :g]
        if noise is not None:
            noise = noise[:, :g]
        base = self.lm_head(h).float()  # [B, g, V]
        greedy = temperature == 0
        if self.markov_head is None:
            if greedy:
                toks, probs = base.argmax(-1), None
            else:
                probs = sampling_probs(base, temperature, top_k, top_p)
                toks = sample_probs(probs, generator, noise=noise)
            prevs = torch.cat([anchor.view(-1, 1), toks[:, :-1]], dim=1)
        else:
            W1 = self.markov_head.markov_w1.weight
            W2 = self.markov_head.markov_w2.weight  # [V, r]
            prev = anchor.long()
            toks_l, probs_l, prev_l = [], [], []
            for k in range(g):
                prev_l.append(prev)
                z = base[:, k] + F.embedding(prev, W1).to(W2.dtype) @ W2.t()
                if greedy:
                    x = z.argmax(-1)
                else:
                    p = sampling_probs(z, temperature, top_k, top_p)
                    x = sample_probs(p, generator, noise=None if noise is None else noise[:, k])
                    probs_l.append(p)
                toks_l.append(x)
                prev = x
            toks = torch.stack(toks_l, dim=1)
            probs = None if greedy else torch.stack(probs_l, dim=1)
            prevs = torch.stack(prev_l, dim=1)
        conf = None
        if want_confidence and self.confidence_head is not None:
            conf = torch.sigmoid(self.confidence_logits(h, prevs))
        return DraftProposal(tokens=toks, probs=probs, confidence=conf)

    # -- I/O -----------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike[str]) -> Path:
        """config.json + model.safetensors (the drafter's own weights, released names, no prefix)."""
        from safetensors.torch import save_file

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.config.save(p)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(sd, str(p / WEIGHTS_FILE), metadata={"format": "pt", "msakit": "dspark-drafter"})
        return p

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> "DSparkDrafter":
        """Load config.json + safetensors (one file or an HF index; optional released prefix
        ``language_model.model.dspark.``; MXFP8 weights dequantized)."""
        from safetensors import safe_open

        p = Path(path)
        if not p.is_dir():
            raise FileNotFoundError(f"drafter folder not found: {p}")
        cfg = DSparkConfig.from_pretrained(p)
        files = _weight_files(p)
        raw: dict[str, torch.Tensor] = {}
        for f in files:
            with reading(f), safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    name = k[len(RELEASED_PREFIX):] if k.startswith(RELEASED_PREFIX) else k
                    if k.startswith("language_model.") and not k.startswith(RELEASED_PREFIX):
                        continue  # target tensors stored beside the drafter
                    raw[name] = fh.get_tensor(k)
                    check_finite(k, raw[name], f)
        sd = _dequantize_mxfp8(raw)
        model = cls(cfg, init=False)
        own = model.state_dict()
        missing = sorted(set(own) - set(sd))
        extra = sorted(set(sd) - set(own))
        if missing or extra:
            raise ModelFolderError(f"{p}: drafter weights do not match the config: missing {missing[:4]}, "
                             f"unexpected {extra[:4]}")
        bad = [k for k in own if tuple(sd[k].shape) != tuple(own[k].shape)]
        if bad:
            raise ModelFolderError(f"{p}: mis-shaped drafter weight(s) {bad[:4]} (e.g. {bad[0]}: "
                             f"{tuple(sd[bad[0]].shape)} vs {tuple(own[bad[0]].shape)})")
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()})
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        return model


def _weight_files(p: Path) -> list[Path]:
    single = p / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            m = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not an HF safetensors index ({e})") from None
        return [p / f for f in sorted(set(m.values()))]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no drafter weights (*.safetensors) in {p}")
    return files


def _dequantize_mxfp8(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    scales = {k[: -len("_scale_inv")]: v for k, v in raw.items() if k.endswith(".weight_scale_inv")}
    if not scales:
        return raw

    out = {}
    for k, v in raw.items():
        if k.endswith(".weight_scale_inv"):
            continue
        if k in scales and v.dtype == torch.float8_e4m3fn:
            v = mxfp8_dequantize(v, scales[k], torch.float32)
        out[k] = v
    return out
