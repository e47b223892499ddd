"""msakit.models.hooks (attachments, class swaps, keyed hooks, the one attention function) and
the declared model interface (msakit.models.interface)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from msakit.models import M3Config, M3ForCausalLM
from msakit.models.hooks import (
    ATTN_IMPL,
    add_hook,
    attach,
    attached,
    attention_handler,
    detach,
    remove_hooks,
    restore_class,
    swap_class,
)
from msakit.models.interface import MSAModel, SelectionModel, SparseModel

pytestmark = pytest.mark.usefixtures("one_thread")


class Twice(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_attachments_classes_and_keyed_hooks() -> None:
    m = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ref = m(x)
    state = attach(m, "k", {"a": 1})
    assert attached(m, "k") is state and attached(m, "other") is None and "_msakit" not in dict(m.named_children())
    assert list(m.state_dict()) == ["weight", "bias"]
    swap_class(m, Twice)
    assert type(m) is Twice and torch.equal(m(x), 2 * ref)
    with pytest.raises(ValueError, match="already swapped"):
        swap_class(m, Twice)
    seen: list[str] = []
    add_hook(m, "mine", lambda mod, args: seen.append("pre"), pre=True)
    add_hook(m, "mine", lambda mod, args, out: seen.append("post"))
    theirs = m.register_forward_hook(lambda mod, args, out: seen.append("theirs"))
    c = copy.deepcopy(m)  # attachments, class and hooks travel with a copy
    assert attached(c, "k") == {"a": 1} and attached(c, "k") is not state
    m(x)
    assert seen == ["pre", "post", "theirs"]
    assert remove_hooks(m, "mine") == 2 and remove_hooks(m, "mine") == 0
    seen.clear()
    m(x)
    assert seen == ["theirs"]  # exactly ours removed
    theirs.remove()
    assert remove_hooks(c, "mine") == 2  # in the copy too
    seen.clear()
    c(x)
    assert seen == ["theirs"]
    assert restore_class(m) and type(m) is nn.Linear and not restore_class(m)
    assert detach(m, "k") is state and "_msakit" not in m.__dict__
    with pytest.raises(ValueError, match="not a subclass"):
        swap_class(nn.Embedding(2, 2), Twice)


def tiny_m3(**kw) -> M3ForCausalLM:
    cfg = M3Config.preset("tiny", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, index_head_dim=16, rotary_dim=8,
                          dense_intermediate_size=32, intermediate_size=16, shared_intermediate_size=16,
                          num_local_experts=2, num_experts_per_tok=1, **kw)
    return M3ForCausalLM(cfg)


def test_models_declare_the_interface() -> None:
    m3 = tiny_m3()
    assert isinstance(m3, MSAModel) and m3.has_indexer
    assert not tiny_m3(sparse_attention_freq=[0]).has_indexer
    transformers = pytest.importorskip("transformers")
    from msakit.eval import HFPolicyModel
    from msakit.models.convert import convert_dense_to_msa

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    pol = HFPolicyModel(transformers.LlamaForCausalLM(cfg), block_size=8, topk=2)
    assert isinstance(pol, SelectionModel) and not isinstance(pol, MSAModel) and not pol.has_indexer
    pol.set_attention_mode("sparse")
    assert pol.attention_mode == "sparse"
    wrapped = convert_dense_to_msa(transformers.LlamaForCausalLM(cfg), block_size=8, topk=2)
    assert isinstance(wrapped, MSAModel) and wrapped.has_indexer
    assert not isinstance(nn.Linear(2, 2), SparseModel)
    # one transformers attention function; each attention module carries its own handler
    assert wrapped.hf.config._attn_implementation == pol.hf.config._attn_implementation == ATTN_IMPL
    h_wrapped = attention_handler(wrapped.hf.model.layers[0].self_attn)
    h_pol = attention_handler(pol.hf.model.layers[0].self_attn)
    assert h_wrapped is not None and h_pol is not None and type(h_wrapped) is not type(h_pol)
