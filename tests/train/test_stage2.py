"""Stage 2 of the conversion recipe (sparse continued training) on a tiny msakit model and a tiny HF
Qwen2 model, both converted: the seeds' stop-gradients (the KL's gradient reaches the index branch
only; the LM loss gives the index branch none: the selection is discrete), LoRA on the backbone
(only the adapters and the index branch train and hold optimizer state; the merged model saves and
loads to the adapted forward), the selection of a warmed model changed in place, and the size check
of 32K-token rows (a one-line refusal, not an out-of-memory)."""

from __future__ import annotations

import pytest
import torch

from msakit.models.convert import convert_dense_to_msa, is_converted, load_for_conversion, set_selection
from msakit.models.sizes import check_batch_fits
from msakit.train.folders import check_context
from msakit.train.lora import apply_lora, has_lora, merge_lora
from msakit.train.trainer import TrainConfig, Trainer

from toy_model import make_model, stdlib_data

pytestmark = pytest.mark.usefixtures("one_thread")

FILES = ["textwrap.py", "fnmatch.py", "bisect.py", "heapq.py"]
KINDS = ["msakit", "qwen2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory.mktemp("s2corpus"), FILES, val_fraction=0.2)


def converted(kind: str, vocab: int = 300):
    """A dense model of `kind` converted to MSA: blocks of 8, top-2 (64-token rows span 8 blocks: sparse)."""
    if kind == "msakit":
        return convert_dense_to_msa(make_model(vocab, sparse_attention_freq=[0, 0]), block_size=8, topk=2,
                                    index_head_dim=8)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False))
    return convert_dense_to_msa(hf, block_size=8, topk=2)


def _grads(loss: torch.Tensor, model) -> dict[str, torch.Tensor | None]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
    return {n: g for (n, _), g in zip(named, gs)}


def _nonzero(g: torch.Tensor | None) -> bool:
    return g is not None and bool(g.abs().max() > 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kl_tokens", ["selected", "all"])
def test_stage2_stop_gradients(kind, kl_tokens):
    """A sparse training forward (stage 2): d KL reaches the index branch only, d LM none of it."""
    model = converted(kind)
    model.set_kl_tokens(kl_tokens)
    model.set_attention_mode("sparse")
    model.train()
    index = {n for n, _ in model.index_parameters()}
    seen: dict[str, list[torch.Tensor]] = {"q": [], "k": []}  # the backbone's q / k activations
    attns = model.msa_layers() if hasattr(model, "msa_layers") else model.msa_attention_modules()
    for a in attns:
        for name in ("q", "k"):
            getattr(a, f"{name}_proj").register_forward_hook(lambda m, i, o, name=name: seen[name].append(o))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 64), generator=g)
    out = model(ids, labels=ids, compute_kl=True)
    assert out.kl is not None and out.kl.requires_grad and len(seen["q"]) == len(attns)
    d_kl = _grads(out.kl, model)
    assert all(_nonzero(d_kl[n]) for n in index if n.endswith("_proj.weight"))  # the KL trains the index projections
    assert [n for n, gr in d_kl.items() if n not in index and _nonzero(gr)] == []  # and nothing else
    acts = seen["q"] + seen["k"]
    for t, gr in zip(acts, torch.autograd.grad(out.kl, acts, retain_graph=True, allow_unused=True)):
        assert not _nonzero(gr)  # q / k of the backbone get no gradient from the KL
    d_lm = _grads(out.loss, model)
    assert [n for n in index if _nonzero(d_lm[n])] == []  # the LM loss does not train the indexer (discrete top-k)
    assert any(_nonzero(d_lm[n]) for n in d_lm if n not in index)  # while it does train the backbone


@pytest.mark.parametrize("kind", KINDS)
def test_lora_trains_the_adapters_and_the_index_branch_only_and_merges(kind, data, tmp_path):
    model = converted(kind, data.tokenizer.vocab_size)
    index = {n for n, _ in model.index_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(steps=3, batch_size=2, lr=1e-2, lr_warmup_steps=1, dense_warmup_steps=0, log_every=1,
                      eval_every=100, eval_rows=2, save_every=100, lora_rank=2, lora_alpha=4.0)
    tr = Trainer(model, cfg, data.train, None, out_dir=tmp_path / "run", progress=False)
    assert has_lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n in trainable if ".lora_" in n}
    assert lora and trainable == lora | index
    hist = tr.fit()
    assert [r["mode"] for r in hist] == ["sparse"] * 3 and all(r["kl"] is not None for r in hist)
    in_opt = {id(p) for grp in tr.optimizer.param_groups for p in grp["params"]}
    assert in_opt == {id(p) for n, p in model.named_parameters() if n in trainable}
    assert set(tr.param_names) == trainable and {id(p) for p in tr.optimizer.state} <= in_opt
    assert len(tr.optimizer.state) == len(trainable)
    # the frozen weights (base layers under peft's names) did not move -- but for the MoE routing bias, which
    # moves toward balance without a gradient -- and the index branch did
    after = {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if ".lora_" not in n}
    assert set(after) == set(before)
    moved = [n for n in before if n not in index and not torch.equal(before[n], after[n])]
    assert [n for n in moved if not n.endswith("e_score_correction_bias")] == []
    assert all(not torch.equal(before[n], after[n]) for n in index if n.endswith("_proj.weight"))
    assert tr.save() is None  # no resumable checkpoint of a LoRA run
    # the merged model saves and loads to the adapted forward
    model.eval()
    model.set_attention_mode("sparse")
    ids = torch.randint(0, data.tokenizer.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        adapted = model(ids, compute_kl=False).logits
    assert merge_lora(model) == len({n.rsplit(".lora_", 1)[0] for n in lora}) and not has_lora(model)
    assert {n for n, _ in model.named_parameters()} == set(before)
    model.save_pretrained(tmp_path / "merged")
    again = load_for_conversion(tmp_path / "merged")
    again.eval()
    again.set_attention_mode("sparse")
    with torch.no_grad():
        torch.testing.assert_close(again(ids, compute_kl=False).logits, adapted, rtol=1e-4, atol=1e-5)


def test_lora_settings_that_cannot_apply_are_refused():
    with pytest.raises(ValueError, match="lora_rank"):
        TrainConfig(train="index", lora_rank=2)
    with pytest.raises(ValueError, match="lora_alpha"):
        TrainConfig(lora_alpha=2.0)
    with pytest.raises(ValueError, match="rank"):
        apply_lora(converted("msakit"), 0)
    model = converted("msakit")
    apply_lora(model, 2)
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_warmed_model_is_converted_and_its_selection_changes_in_place(kind, tmp_path):
    model = converted(kind)
    assert is_converted(model)
    assert not is_converted(make_model(300, sparse_attention_freq=[0, 0]))
    assert not is_converted(make_model(300, sparse_attention_freq=[0, 1]))  # a dense layer left to convert
    with pytest.raises(ValueError, match="already"):
        convert_dense_to_msa(model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    set_selection(model, topk=4, init_blocks=1)
    model.save_pretrained(tmp_path / "m")
    again = load_for_conversion(tmp_path / "m")
    for m in (model, again):
        sel = m.settings.selection if hasattr(m, "settings") else m.config.selection
        assert (sel.block_size, sel.topk, sel.init_blocks) == (8, 4, 1)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    # the layers select by the new settings: top-4 blocks per query
    model.set_attention_mode("sparse")
    out = model(torch.randint(0, 300, (1, 64)), return_attn_inputs=True, compute_kl=False)
    bidx = next(x for x in out.attn_inputs if x is not None)["block_idx"]
    assert bidx.shape[-1] == 4 and bool((bidx[..., :][:, :, 40] == 0).any())  # block 0 forced for a late query
    with pytest.raises(ValueError, match="topk"):
        set_selection(model, topk=1, init_blocks=1)
    with pytest.raises(ValueError, match="init_blocks"):
        set_selection(model, init_blocks=-1)


def test_32k_rows_fit_the_positions_and_the_size_check_refuses_in_one_line():
    """Qwen2.5-0.5B's shape at 32,768-token rows: the context is the model's own, one row fits 80 GB,
    a batch far past the device is a ValueError naming --batch-size (not an out-of-memory)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768)
    check_context(cfg, 32768)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        check_context(cfg, 65536)
    check_batch_fits(cfg, 1, 32768, "cuda", backward=True, available=lambda d: 80 * 10**9)
    with pytest.raises(ValueError, match="--batch-size 64") as e:
        check_batch_fits(cfg, 64, 32768, "cuda", backward=True, available=lambda d: 80 * 10**9)
    assert "\n" not in str(e.value)
