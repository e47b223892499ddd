"""DSpark drafter: the released config and tensor layout, scaled presets, bad input, the row
shift (row j predicts anchor + j + 1) in training and inference, context masking, the Markov
bias applied left to right, the confidence head, weights I/O, the loss and the trainer."""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np
import pytest
import torch

from msakit.generate import generate
from msakit.models import M3Config
from msakit.speculative import DSparkConfig, DSparkDrafter, spread_taps
from msakit.speculative.generate import SpecCache, draft_context_update, draft_hidden, target_forward
from msakit.speculative.train import DrafterTrainConfig, DrafterTrainer, dspark_loss
from msakit.speculative.verify import sampling_probs

from toy_model import small_target

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_drafter(target, seed: int = 1, **kw) -> DSparkDrafter:
    torch.manual_seed(seed)
    d = DSparkDrafter(DSparkConfig.for_target(target.config, "tiny", **kw)).bind(target)
    with torch.no_grad():  # non-trivial norms, Markov W2 and confidence head
        for n, p in d.named_parameters():
            if p.dim() == 1 or "markov_w2" in n or "confidence" in n:
                p.normal_(0, 0.3)
    return d.eval()


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------


def test_released_config() -> None:
    cfg = DSparkConfig.preset("minimax-m3.1-flash")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (5, 6144, 200064)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (64, 4, 128, 12288)
    assert cfg.target_layer_ids == [3, 17, 31, 45, 59]
    assert (cfg.draft_block_size, cfg.num_drafts, cfg.verify_width) == (7, 7, 8)
    assert (cfg.noise_token_id, cfg.markov_rank, cfg.sliding_window) == (200058, 256, 4096)
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.quantization_config == {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    # writing gives back every field of the released file
    raw = json.loads(resources.files("msakit.speculative").joinpath("configs", "minimax-m3.1-flash-dspark.json").read_text())
    out = cfg.to_dict()
    for k, v in raw["text_config"].items():
        assert out["text_config"][k] == v, k
    assert out["quantization_config"] == raw["quantization_config"]
    assert DSparkConfig.from_dict(out) == cfg
    # the released target is 60 layers deep
    m31 = M3Config.preset("minimax-m3.1-flash")
    cfg.check_target(m31)
    assert spread_taps(m31.num_hidden_layers) == [3, 17, 31, 45, 59]


def test_released_tensor_layout() -> None:
    with torch.device("meta"):
        d = DSparkDrafter(DSparkConfig.preset("minimax-m3.1-flash"), init=False)
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert shapes["fc.weight"] == (6144, 30720)
    assert shapes["hidden_norm.weight"] == shapes["final_norm.weight"] == (6144,)
    assert shapes["markov_head.markov_w1.weight"] == shapes["markov_head.markov_w2.weight"] == (200064, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 6400) and shapes["confidence_head.proj.bias"] == (1,)
    pre = "layers.4.decoder_layer."
    assert shapes[pre + "self_attn.q_proj.weight"] == (8192, 6144)
    assert shapes[pre + "self_attn.k_proj.weight"] == shapes[pre + "self_attn.v_proj.weight"] == (512, 6144)
    assert shapes[pre + "self_attn.o_proj.weight"] == (6144, 8192)
    assert shapes[pre + "self_attn.q_norm.weight"] == shapes[pre + "self_attn.k_norm.weight"] == (128,)
    assert shapes[pre + "mlp.gate_proj.weight"] == shapes[pre + "mlp.up_proj.weight"] == (12288, 6144)
    assert shapes[pre + "mlp.down_proj.weight"] == (6144, 12288)
    assert shapes[pre + "input_layernorm.weight"] == shapes[pre + "post_attention_layernorm.weight"] == (6144,)
    assert not any("embed" in k or "lm_head" in k for k in shapes)  # shared with the target, not stored
    assert sum(math.prod(s) for k, s in shapes.items() if k.startswith("markov_head")) == 102_432_768


def test_scaled_presets() -> None:
    t = M3Config.preset("small", vocab_size=1000)
    c = DSparkConfig.for_target(t, "small")
    assert c.num_hidden_layers == 2 and c.hidden_size == 512 and c.vocab_size == 1000
    assert c.target_layer_ids == spread_taps(8) and c.target_layer_ids[-1] == 7 and len(set(c.target_layer_ids)) == 5
    assert c.noise_token_id == 999 and c.draft_block_size == 7
    tiny = DSparkConfig.for_target(M3Config.preset("tiny"), "tiny")
    assert tiny.num_hidden_layers == 1 and tiny.target_layer_ids == [0, 1, 2, 3]
    assert spread_taps(2) == [0, 1] and spread_taps(1) == [0] and spread_taps(12, 3) == [1, 6, 11]
    ab = DSparkConfig.for_target(t, "small", markov_rank=0)
    assert not ab.has_markov and not ab.confidence_head_with_markov
    d = DSparkDrafter(ab, init=False)
    assert d.markov_head is None and d.confidence_head.proj.in_features == 512
    assert DSparkConfig.from_dict(ab.to_dict()) == ab


def test_bad_input_raises() -> None:
    target = small_target(64)
    other = small_target(80)
    d = tiny_drafter(target)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        d.bind(other)
    deep = DSparkConfig.for_target(target.config, "tiny").replace(target_layer_ids=[0, 5])
    with pytest.raises(ValueError, match="beyond the target's depth"):
        DSparkDrafter(deep).bind(target)
    with pytest.raises(ValueError, match="beyond the target's depth"):
        DSparkConfig.for_target(target.config, "tiny", target_layer_ids=[2])
    with pytest.raises(ValueError, match="not bound"):
        DSparkDrafter(DSparkConfig.for_target(target.config, "tiny")).target
    raw = DSparkConfig.preset("minimax-m3.1-flash").to_dict()
    for key, val, msg in [("use_gemma_norm", False, "use_gemma_norm"),
                          ("dspark_hybrid_context_fusion", True, "dspark_hybrid_context_fusion"),
                          ("dspark_markov_head_type", "rnn", "dspark_markov_head_type"),
                          ("dspark_noise_token_id", 300000, "dspark_noise_token_id"),
                          ("dspark_target_layer_ids", [3, 3], "repeated"),
                          ("hidden_act", "gelu", "hidden_act")]:
        bad = json.loads(json.dumps(raw))
        bad["text_config"][key] = val
        with pytest.raises(ValueError, match=msg):
            DSparkConfig.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    del bad["text_config"]["dspark_target_layer_ids"]
    with pytest.raises(ValueError, match="dspark_target_layer_ids"):
        DSparkConfig.from_dict(bad)


# ---------------------------------------------------------------------------------------------
# the row shift, masks, heads
# ---------------------------------------------------------------------------------------------


def test_training_forward_matches_inference_path() -> None:
    """The teacher-forced block at anchor L equals the block drafted at inference after a prefill
    of positions < L: same positions, same context (keys < L), row j at position L + j."""
    target = small_target()
    d = tiny_drafter(target)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[5, 13], [8, 16]])
    with torch.no_grad():
        out = target(ids, compute_kl=False, output_hidden_states=True)
        h = d(d.taps_from_hidden_states(out.hidden_states), ids, anchors)
    assert h.shape == (2, 2, 7, 64)
    for b in range(2):
        for a in range(2):
            L = int(anchors[b, a])
            cache = SpecCache(2, 1, 1, 64, torch.device("cpu"))
            _, tap = target_forward(target, cache, ids[b:b + 1, :L], d.config.target_layer_ids)
            draft_context_update(d, cache, tap)
            cache.set_lengths(torch.tensor([L]), [L])
            hi = draft_hidden(d, cache, ids[b:b + 1, L])
            torch.testing.assert_close(hi[0], h[b, a], rtol=1e-4, atol=1e-4)


def test_loss_row_shift() -> None:
    """dspark_loss scores row j of the block at L against token L + j + 1 and the target's
    distribution at L + j, with the Markov bias of token L + j (an explicit re-computation)."""
    target = small_target()
    d = tiny_drafter(target)
    T, g = 20, 7
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[3, 14], [1, 9]])  # 14 + 6 + 1 > 19: the last rows of that block are invalid
    labels = ids.clone()
    labels[1, 12] = -100  # row 2 of block (1, 9) predicts position 12: that block stops there
    loss, met = dspark_loss(d, ids, anchors, labels=labels)
    with torch.no_grad():
        out = target(ids, compute_kl=False, output_hidden_states=True)
        h = d(d.taps_from_hidden_states(out.hidden_states), ids, anchors)
    num, den = 0.0, 0.0
    for b in range(2):
        for a in range(2):
            L = int(anchors[b, a])
            for j in range(g):
                pos = L + j + 1
                if pos > T - 1 or labels[b, pos] == -100:
                    break  # the cumulative mask: nothing after the first invalid target
                hv = h[b, a, j]
                z = (target.lm_head(hv) + d.markov_head(ids[b, L + j])).float()
                logp = z.log_softmax(-1)
                pt = out.logits[b, L + j].float().softmax(-1)
                ce = -logp[ids[b, pos]]
                tv = (logp.exp() - pt).abs().sum()
                feat = torch.cat([hv, d.markov_head.feature(ids[b, L + j])])
                cl = d.confidence_head.proj(feat).squeeze()
                bce = torch.nn.functional.binary_cross_entropy_with_logits(cl, (1 - 0.5 * tv).clamp(0, 1))
                w = math.exp(-j / 4)
                num = num + w * (0.1 * ce + 0.9 * tv + 1.0 * bce)
                den += w
    torch.testing.assert_close(loss, num / den, rtol=1e-5, atol=1e-6)
    assert met["blocks"] == 4 and len(met["alpha"]) == g and 1.0 <= met["accept_len"] <= 1.0 + g


def test_context_masking_and_anchor() -> None:
    """Block rows see context keys L - W < j < L only, and all of their own block."""
    target = small_target()
    d = tiny_drafter(target, sliding_window=4)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = target(ids, compute_kl=False, output_hidden_states=True)
        taps = d.taps_from_hidden_states(out.hidden_states)
        anchors = torch.tensor([[10]])
        base = d(taps, ids, anchors)

        def moved(pos: int) -> bool:
            t2 = taps.clone()
            t2[:, pos] += 1.0
            return not torch.allclose(d(t2, ids, anchors), base, atol=1e-6)

        assert moved(9) and moved(7)  # inside the window
        assert not moved(6) and not moved(3)  # 10 - 4 = 6 and older: outside
        assert not moved(10) and not moved(15)  # the anchor's own and later states: never visible
        ids2 = ids.clone()
        ids2[0, 10] = (ids[0, 10] + 1) % 64  # the anchor token changes every row of its block
        diff = (d(taps, ids2, anchors) - base).abs().amax(-1)
        assert bool((diff > 1e-6).all())
        # two blocks in one row do not see each other
        two = d(taps, ids, torch.tensor([[10, 13]]))
        torch.testing.assert_close(two[:, :1], base)


def _markov_perm_setup(vocab: int = 16):
    """A target whose output head is zero (flat base logits) and a drafter whose Markov head
    puts +10 on perm[prev]: the drafts must follow the chain perm[anchor], perm[perm[anchor]], ..."""
    target = small_target(vocab)
    with torch.no_grad():
        target.lm_head.weight.zero_()
    d = tiny_drafter(target, markov_rank=vocab)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        d.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        w2 = torch.zeros(vocab, vocab)
        w2[perm, torch.arange(vocab)] = 10.0  # bias(prev)[perm[prev]] = 10
        d.markov_head.markov_w2.weight.copy_(w2)
    return target, d, perm


def test_markov_bias_applied_in_order() -> None:
    target, d, perm = _markov_perm_setup()
    h = torch.randn(3, 7, 64)
    anchor = torch.tensor([0, 5, 9])
    prop = d.propose(h, anchor, temperature=0)
    chain = [anchor]
    for _ in range(7):
        chain.append(perm[chain[-1]])
    assert torch.equal(prop.tokens, torch.stack(chain[1:], 1))
    assert prop.probs is None
    # sampling: row k's q is exactly softmax(bias(x_(k-1))) of the token drawn at row k - 1
    prop = d.propose(h, anchor, temperature=1.0, generator=torch.Generator().manual_seed(0), want_confidence=True)
    prevs = torch.cat([anchor.view(3, 1), prop.tokens[:, :-1]], 1)
    with torch.no_grad():
        expect = sampling_probs(target.lm_head(h) + d.markov_head(prevs), 1.0)
    torch.testing.assert_close(prop.probs, expect)
    assert bool((prop.probs.gather(-1, prop.tokens.unsqueeze(-1)) > 0).all())
    # the confidence head: sigmoid(proj([h_k ; W1[x_(k-1)]]))
    with torch.no_grad():
        feat = torch.cat([h, d.markov_head.markov_w1(prevs)], -1)
        c = torch.sigmoid(d.confidence_head.proj(feat).squeeze(-1))
    torch.testing.assert_close(prop.confidence, c)
    # top-k on the drafter side truncates q too
    prop = d.propose(h, anchor, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(prop.tokens, torch.stack(chain[1:], 1))
    assert torch.allclose(prop.probs.amax(-1), torch.ones(3, 7))


def test_no_markov_drafter_draws_rows_independently() -> None:
    target = small_target()
    d = tiny_drafter(target, markov_rank=0)
    h = torch.randn(2, 7, 64)
    prop = d.propose(h, torch.tensor([1, 2]), temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(prop.probs, sampling_probs(target.lm_head(h), 0.8, None, 0.9))
    assert d.markov_bias(torch.tensor([1])) is None


# ---------------------------------------------------------------------------------------------
# weights I/O
# ---------------------------------------------------------------------------------------------


def test_save_load_roundtrip(tmp_path) -> None:
    target = small_target()
    d = tiny_drafter(target)
    d.save_pretrained(tmp_path / "d")
    d2 = DSparkDrafter.from_pretrained(tmp_path / "d")
    assert d2.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(v, d2.state_dict()[k]), k
    with pytest.raises(FileNotFoundError):
        DSparkDrafter.from_pretrained(tmp_path / "missing")


def test_load_released_layout(tmp_path) -> None:
    """The released prefix and MXFP8 linears (float8 codes + E8M0 weight_scale_inv) load."""
    from safetensors.torch import save_file

    from msakit.quant.formats import mxfp8_dequantize, mxfp8_quantize

    target = small_target()
    d = tiny_drafter(target)
    out = tmp_path / "released"
    d.config.save(out)
    tensors, expect = {}, {}
    for k, v in d.state_dict().items():
        name = "language_model.model.dspark." + k
        if ".decoder_layer." in k and k.endswith("_proj.weight"):
            codes, scales = mxfp8_quantize(v)
            tensors[name] = codes
            tensors[name + "_scale_inv"] = scales
            expect[k] = mxfp8_dequantize(codes, scales, torch.float32)
        else:
            tensors[name] = v.bfloat16()
            expect[k] = v.bfloat16().float()
    tensors["language_model.model.embed_tokens.weight"] = torch.zeros(3, 3)  # target tensors beside it: skipped
    save_file(tensors, str(out / "model.safetensors"))
    d2 = DSparkDrafter.from_pretrained(out)
    for k, v in expect.items():
        torch.testing.assert_close(d2.state_dict()[k], v, rtol=0, atol=0)
    tensors.pop("language_model.model.dspark.fc.weight")
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        DSparkDrafter.from_pretrained(out)


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def _rows(target, n_rows: int = 12, T: int = 32):
    from msakit.train.data import PackedRows, TokenStream

    with torch.no_grad():
        seqs = generate(target, torch.randint(0, 64, (n_rows, 2), generator=torch.Generator().manual_seed(4)),
                               T - 2, temperature=0.5, generator=torch.Generator().manual_seed(5))
    toks = seqs.reshape(-1).numpy().astype(np.int32)
    starts = np.arange(0, toks.shape[0] + 1, T, dtype=np.int64)
    stream = TokenStream(toks, starts, [f"doc{i}" for i in range(n_rows)], [])
    return PackedRows(stream, T, pad_id=0)


def test_trainer_learns_logs_and_resumes(tmp_path) -> None:
    target = small_target()
    rows = _rows(target)
    cfg = DrafterTrainConfig(steps=30, batch_size=4, anchors=8, lr=3e-3, log_every=5, eval_every=30, eval_rows=4,
                             save_every=10)
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    tr = DrafterTrainer(target, tiny_drafter(target), cfg, rows, rows, out_dir=tmp_path / "run", device="cpu",
                        progress=False)
    first = tr.evaluate()
    recs = tr.fit()
    last = tr.evaluate()
    assert len(recs) == 30 and all(math.isfinite(r["loss"]) for r in recs)
    assert last["loss"] < first["loss"] and last["accept_len"] > first["accept_len"]
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # the target stays frozen
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in log} == {"train", "eval"}
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-00000030"
    # the checkpoint folder is a drafter folder
    DSparkDrafter.from_pretrained(ck / "step-00000030")
    # resume from step 20 and finish: the same losses as the straight run
    tr2 = DrafterTrainer(target, tiny_drafter(target, seed=9), cfg, rows, rows, out_dir=tmp_path / "run2",
                         device="cpu", progress=False)
    tr2.resume(ck / "step-00000020")
    assert tr2.step == 20
    recs2 = tr2.fit()
    assert [round(r["loss"], 5) for r in recs2] == [round(r["loss"], 5) for r in recs[20:]]


def test_fit_to_time_keeps_the_configured_steps(tmp_path, monkeypatch) -> None:
    """fit(max_seconds): the step count is fitted to the time (after 10 and 50 steps) but never
    past cfg.steps; a slow pace shortens the run and the LR schedule with it."""
    import msakit.speculative.train as st

    target = small_target()
    rows = _rows(target)
    cfg = DrafterTrainConfig(steps=60, batch_size=2, anchors=4, log_every=100, eval_every=100, eval_rows=0,
                             save_every=1000, keep_checkpoints=0)
    tr = DrafterTrainer(target, tiny_drafter(target), cfg, rows, None, out_dir=tmp_path / "a", device="cpu",
                        progress=False)
    tr.fit(max_seconds=1e6)
    assert tr.step == 60 and cfg.steps == 60
    clock = {"t": 0.0}
    monkeypatch.setattr(st.time, "time", lambda: clock["t"])
    cfg2 = DrafterTrainConfig(steps=1000, batch_size=2, anchors=4, log_every=1000, eval_every=1000, eval_rows=0,
                              save_every=10**6, keep_checkpoints=0)
    tr2 = DrafterTrainer(target, tiny_drafter(target), cfg2, rows, None, out_dir=tmp_path / "b", device="cpu",
                         progress=False)
    step = tr2.train_step

    def slow_step():  # 1 s per step (3 s for each of the first ten: "compilation")
        clock["t"] += 3.0 if tr2.step < 10 else 1.0
        return step()

    tr2.train_step = slow_step
    tr2.fit(max_seconds=100)
    # after 10 steps (30 s): 3 s per step -> 33, provisionally 51; after 50 (70 s): 1 s per step
    # over steps 10-50 -> 50 + 30 = 80
    assert tr2.step == cfg2.steps == 80


def test_regeneration_pool_and_mix() -> None:
    from msakit.speculative.train import mix_streams, regenerate_pool

    target = small_target()
    rows = _rows(target, n_rows=6, T=16)
    pool = regenerate_pool(target, rows, 4, 5, temperatures=(0.7, 0.0), batch=4)
    assert len(pool) == 4 * 16 and pool.num_docs == 4 and list(pool.doc_starts) == [0, 16, 32, 48, 64]
    toks = torch.from_numpy(pool.tokens.astype("int64")).view(4, 16)
    src = rows.batch([0, 1, 2, 3]).input_ids
    assert torch.equal(toks[:, :5], src[:, :5])  # the prompts are kept
    greedy = generate(target, src[2:, :5], 11, temperature=0)  # the second half is the greedy continuation
    assert torch.equal(toks[2:], greedy)
    mixed = mix_streams(rows.stream, pool, 0.5)
    assert len(mixed) == len(rows.stream) + len(pool) * round(len(rows.stream) / len(pool))
    from msakit.train.data import PackedRows

    pr = PackedRows(mixed, 16, 0)
    ids, labels, cu = pr.row(0)
    assert torch.equal(torch.from_numpy(ids), toks[0]) and list(cu) == [0, 16] and (labels >= 0).all()


def test_cli_errors(tmp_path, capsys) -> None:
    from msakit.cli import main

    assert main(["train-drafter", str(tmp_path / "missing")]) == 2
    assert "target not found" in capsys.readouterr().err
    target = small_target()
    target.save_pretrained(tmp_path / "t")
    assert main(["train-drafter", str(tmp_path / "t"), "--taps", "0,7", "--out", str(tmp_path / "o")]) == 2
    assert "beyond the target's depth" in capsys.readouterr().err
    assert main(["train-drafter", str(tmp_path / "t"), "--out", str(tmp_path / "o")]) == 2  # no tokenizer beside it
    assert "tokenizer" in capsys.readouterr().err
