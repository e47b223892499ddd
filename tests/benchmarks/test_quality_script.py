"""benchmarks/quality.py: the retrieval-probe builder, the sliding-window selection, --report on nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import build_probes, window_block_idx  # noqa: E402


def _char_offsets(text):
    return [(i, i + 1) for i in range(len(text))]  # one token per character


def test_probe_builder_synthetic_file():
    filler = "".join(f"pass  # {i:03d}\n" for i in range(300))  # ~3.6K chars, names nothing
    text = ("def far_function(a):\n    return a\n\n"
            "class FarClass:\n    pass\n\n"
            "LIMIT_VALUE = 3\n"
            "def near_function():\n    pass\n"
            + filler
            + "near_function()\n"  # too close to nothing: previous occurrence far, but see below
            + filler
            + "y = far_function(LIMIT_VALUE)\n"
            + "z = FarClass()\n"
            + "far_function(1)\n")
    offs = _char_offsets(text)
    probes = build_probes(text, offs, min_gap=3000, max_span=len(text))
    names = [p.name for p in probes]
    # far_function, LIMIT_VALUE, FarClass: first later use is > 3000 tokens after the definition
    assert set(names) == {"far_function", "LIMIT_VALUE", "FarClass", "near_function"}
    by = {p.name: p for p in probes}
    use = text.index("far_function(LIMIT")
    assert by["far_function"].use_start == use and by["far_function"].use_end == use + len("far_function")
    assert by["far_function"].def_token == text.index("far_function")
    assert text[by["FarClass"].use_start:by["FarClass"].use_end] == "FarClass"
    # one probe per name: the final far_function(1) is not a second probe
    assert names.count("far_function") == 1
    # the gap must be >= min_gap from the previous occurrence
    assert all(p.use_start - p.prev_token >= 3000 for p in probes)
    # a window smaller than def->use drops them all; an occurrence in between blocks the probe
    assert build_probes(text, offs, min_gap=3000, max_span=1000) == []
    text2 = text.replace("near_function()\n", "near_function()\nfar_function\n", 1)  # in the middle
    assert "far_function" in {p.name for p in build_probes(text, offs, min_gap=4000, max_span=len(text))}
    assert "far_function" not in {p.name for p in build_probes(text2, _char_offsets(text2), min_gap=4000,
                                                                max_span=len(text2))}
    # short names, keywords/builtins and non-module-level assignments are skipped
    t3 = "abc = 1\n  indented_name = 2\nlist = 3\n" + "#" * 5000 + "\nabc indented_name list\n"
    assert build_probes(t3, _char_offsets(t3), min_gap=100, max_span=10**6) == []


def test_probe_builder_multi_char_tokens():
    text = "def alpha_name():\n    pass\n" + "q " * 50 + "alpha_name()\n"
    # word-level tokens: offsets of each whitespace-separated piece
    import re
    offs = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    ps = build_probes(text, offs, min_gap=40, max_span=10**6)
    assert len(ps) == 1
    p = ps[0]
    assert p.use_end - p.use_start == 1 and text[slice(*offs[p.use_start])].startswith("alpha_name")


def test_window_block_sets():
    bs, topk, T = 4, 4, 40  # 10 blocks
    idx = window_block_idx(T, bs, topk, batch=2, groups=3)
    assert idx.shape == (2, 3, T, topk) and idx.dtype == torch.int32
    assert torch.equal(idx[0, 0], idx[1, 2])
    for i in range(T):
        own = i // bs
        want = {0} | {b for b in range(own - (topk - 2), own + 1) if b >= 0}
        row = idx[0, 0, i].tolist()
        got = [b for b in row if b >= 0]
        assert set(got) == want and len(got) == len(want), (i, row)
        assert row == sorted(row, reverse=True)  # valid ids first, -1 padding last
        assert all(b <= own for b in got)
    assert idx[0, 0, 0].tolist() == [0, -1, -1, -1]
    assert idx[0, 0, 39].tolist() == [9, 8, 7, 0]
    assert idx[0, 0, 12].tolist() == [3, 2, 1, 0]  # own - (topk-2) = 1 > 0: block 0 added, 4 blocks


def test_window_layer_runs_sparse_attention():
    from benchmarks.quality import enable_window
    from msakit.models import M3Config, M3ForCausalLM

    cfg = M3Config.preset("tiny", vocab_size=300, num_hidden_layers=1, index_block_size=8, index_topk_blocks=3)
    torch.manual_seed(0)
    m = M3ForCausalLM(cfg)
    ids = torch.randint(0, 300, (1, 64))
    m.set_attention_mode("dense")
    dense = m(ids, labels=ids).loss
    enable_window(m)
    m.set_attention_mode("dense")
    assert torch.allclose(m(ids, labels=ids).loss, dense)
    m.set_attention_mode("sparse")
    a = m(ids, labels=ids).loss
    assert torch.isfinite(a) and not torch.allclose(a, dense)
    # the selection the layer uses is the window's
    out = m(ids, return_attn_inputs=True, compute_kl=False)
    assert torch.equal(out.attn_inputs[0]["block_idx"], window_block_idx(64, 8, 3, batch=1, groups=cfg.num_key_value_heads))


def test_report_on_empty_folder(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--report", "--root", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no finished sub-runs" in r.stdout and "Traceback" not in r.stderr
