"""The index-only warm-up (`TrainConfig(train="index")`) on a tiny msakit dense model and a tiny
HF Qwen2 model, both converted: the backbone stays bit-identical, only the index branch is in the
optimizer, the KL falls at a fixed batch, the [T, vocab] logits are never built, and the token /
time limits end the run with a checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from msakit.models.convert import convert_dense_to_msa
from msakit.train import checkpoint as ckpt_mod
from msakit.train.trainer import TrainConfig, Trainer, read_metrics

from toy_model import make_model, stdlib_data

pytestmark = pytest.mark.usefixtures("one_thread")

FILES = ["textwrap.py", "fnmatch.py", "bisect.py", "heapq.py", "colorsys.py", "glob.py"]
KINDS = ["msakit", "qwen2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory.mktemp("icorpus"), FILES, val_fraction=0.2)


def converted(kind: str, vocab: int, **kw):
    """A dense model of `kind` converted to MSA: blocks of 8, top-2 (64-token rows span 8 blocks)."""
    if kind == "msakit":
        return convert_dense_to_msa(make_model(vocab, sparse_attention_freq=[0, 0]), block_size=8, topk=2,
                                    index_head_dim=8, **kw)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False))
    return convert_dense_to_msa(hf, block_size=8, topk=2, **kw)


def lm_head(model) -> torch.nn.Module:
    return model.hf.lm_head if hasattr(model, "hf") else model.lm_head


def cfg(**kw) -> TrainConfig:
    base = dict(steps=3, batch_size=2, lr=1e-2, lr_warmup_steps=1, train="index", log_every=1, eval_every=100,
                eval_rows=2, save_every=100)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("kind", KINDS)
def test_index_only_steps_leave_the_backbone_bit_identical(kind, data, tmp_path):
    model = converted(kind, data.tokenizer.vocab_size)
    index = {n for n, _ in model.index_parameters()}
    assert index and all(".index_" in n for n in index)
    before = {k: v.clone() for k, v in model.state_dict().items()}  # parameters and buffers
    shapes: list[tuple] = []
    lm_head(model).register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)) if m.training else None)
    tr = Trainer(model, cfg(), data.train, data.val, out_dir=tmp_path / "run", tokenizer=data.tokenizer,
                 progress=False)
    hist = tr.fit()
    assert [r["mode"] for r in hist] == ["dense"] * 3 and all(r["loss"] is None for r in hist)
    assert all(torch.isfinite(torch.tensor(r["kl"])) for r in hist)
    after = model.state_dict()
    assert [k for k in before if k not in index and not torch.equal(before[k], after[k])] == []
    assert [k for k in index if torch.equal(before[k], after[k])] == []  # every index tensor moved
    # the training forwards computed the logits of the last position only
    assert shapes == [(2, 1, data.tokenizer.vocab_size)] * 3
    # (b) the optimizer and its checkpointed state hold the index parameters only
    params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert params == {id(p) for _, p in model.index_parameters()}
    assert set(tr.param_names) == index and len(tr.optimizer.state) == len(index)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == index
    ck = tr.save()
    tensors, _ = ckpt_mod.load_checkpoint_state(ck)[2:]
    assert tensors and {k.split(".", 1)[1].rsplit(".", 1)[0] for k in tensors} == index


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kl_tokens", ["selected", "all"])
def test_index_kl_falls_at_a_fixed_batch(kind, kl_tokens, data, tmp_path):
    model = converted(kind, data.tokenizer.vocab_size)
    tr = Trainer(model, cfg(steps=12, kl_tokens=kl_tokens, grad_clip=0.0), data.train, None,
                 out_dir=tmp_path / "run", progress=False)
    batch = tr.loader.next_batch()
    tr.loader.next_batch = lambda: batch  # the same rows every step
    _, _, loss, _, _ = tr._index_kl(batch.to(tr.device))
    loss.backward()
    grads = [p.grad for _, p in model.index_parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(float(g.abs().max()) > 0 for g in grads)
    tr.optimizer.zero_grad(set_to_none=True)
    kls = [r["kl"] for r in tr.fit()]
    assert all(k > 0 for k in kls)
    # a fresh random indexer is far from the dense attention: 12 steps at lr 1e-2 at least halve the KL
    assert kls[-1] < 0.5 * kls[0], kls


def test_kl_over_all_tokens_differs_from_the_selected(data, tmp_path):
    batch = None
    kls = {}
    for tokens in ("selected", "all"):
        model = converted("msakit", data.tokenizer.vocab_size)
        tr = Trainer(model, cfg(kl_tokens=tokens), data.train, None, out_dir=tmp_path / tokens, progress=False)
        batch = batch or tr.loader.next_batch()
        kls[tokens] = float(tr._index_kl(batch)[1])
    # over every causal token the indexer's distribution spreads over more keys than over its own top-k
    assert kls["all"] != kls["selected"] and kls["all"] > 0 and kls["selected"] > 0


@pytest.mark.parametrize("kind", ["msakit", "qwen2"])
def test_activation_checkpointing_gives_the_same_index_training(kind, data, tmp_path):
    out = {}
    for ac in (False, True):
        model = converted(kind, data.tokenizer.vocab_size)
        tr = Trainer(model, cfg(steps=2), data.train, None, out_dir=tmp_path / str(ac), progress=False,
                     activation_checkpointing=ac)
        out[ac] = ([r["kl"] for r in tr.fit()], {n: p.detach().clone() for n, p in model.index_parameters()})
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5, abs=1e-7)
    for n, p in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], p, rtol=1e-5, atol=1e-6)


def test_max_tokens_and_time_budget_end_the_run_with_a_checkpoint(data, tmp_path):
    model = converted("msakit", data.tokenizer.vocab_size)
    run = tmp_path / "run"
    tr = Trainer(model, cfg(steps=10, eval_every=100, log_every=100), data.train, data.val, out_dir=run,
                 tokenizer=data.tokenizer, progress=False, eval_both_modes=True)
    per_step = 2 * data.train.context
    hist = tr.fit(max_tokens=2 * per_step + 1)  # reached by the third step
    assert len(hist) == 3 and tr.step == 3 and tr.tokens_read() == 3 * per_step
    assert ckpt_mod.resolve_checkpoint(run).name == "step-00000003"
    recs = read_metrics(run / "metrics.jsonl")
    ev = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in ev] == [3] and {"val_loss_dense", "val_loss_sparse"} <= set(ev[0])
    assert [r["step"] for r in recs if r["kind"] == "train"] == [3]
    hist = tr.fit(budget_s=1e-9)  # one step, then the budget is spent
    assert len(hist) == 1 and ckpt_mod.resolve_checkpoint(run).name == "step-00000004"
    for bad in (dict(max_tokens=0), dict(budget_s=0.0), dict(budget_s=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tr.fit(**bad)


def test_index_lr_is_its_own_group_when_everything_trains(data, tmp_path):
    model = converted("msakit", data.tokenizer.vocab_size)
    tr = Trainer(model, cfg(train="all", lr=1e-3, index_lr=4e-3, dense_warmup_steps=1, steps=2), data.train, None,
                 out_dir=tmp_path / "run", progress=False)
    index = {id(p) for _, p in model.index_parameters()}
    tr.fit()
    by_scale = {}
    for g in tr.optimizer.param_groups:
        for p in g["params"]:
            by_scale[id(p)] = g.get("lr_scale", 1.0)
    assert {by_scale[i] for i in index} == {4.0}
    assert {s for i, s in by_scale.items() if i not in index} == {1.0} and len(by_scale) > len(index)
    ratio = {g.get("lr_scale", 1.0): g["lr"] for g in tr.optimizer.param_groups}
    assert ratio[4.0] == pytest.approx(4 * ratio[1.0])


def test_index_config_refusals():
    with pytest.raises(ValueError, match="train"):
        TrainConfig(train="backbone")
    with pytest.raises(ValueError, match="kl_every"):
        TrainConfig(train="index", kl_every=2)
    with pytest.raises(ValueError, match="kl_tokens"):
        TrainConfig(kl_tokens="some")
    with pytest.raises(ValueError, match="index_lr"):
        TrainConfig(index_lr=0.0)
