"""msakit.config_io: config.json in and out and the field readers (re-exported by msakit.models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from msakit import config_io
from msakit.config_io import (check_fixed_fields, get_field, get_int_field, get_rotary_dim, load_config_file,
                              read_config_json, write_config_json)

REPO = Path(__file__).resolve().parents[2]


def test_write_read_round_trip(tmp_path: Path) -> None:
    d = {"a": 1, "b": [1, 2], "c": {"d": None}}
    f = write_config_json(tmp_path / "new" / "folder", d)
    assert f == tmp_path / "new" / "folder" / "config.json"
    assert read_config_json(f.parent) == (d, f) == read_config_json(f)
    g = write_config_json(tmp_path / "x" / "drafter.json", d)  # a *.json path is the file itself
    assert g.name == "drafter.json" and json.loads(g.read_text()) == d


def test_read_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="drafter config not found"):
        read_config_json(tmp_path, "drafter config")
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"n": 1.5}')
    with pytest.raises(ValueError, match=r"config\.json: config field 'n' must be an integer"):
        load_config_file(tmp_path, lambda raw: get_int_field(raw, "n"))
    assert load_config_file(tmp_path, lambda raw: raw["n"]) == 1.5


def test_field_readers() -> None:
    cfg = {"a": None, "b": 0, "n": 3, "f": 4.0, "t": True, "s": "x"}
    assert get_field(cfg, "a", 7) == 7 and get_field(cfg, "b", 7) == 0 and get_field(cfg, "zz", 7) == 7
    assert get_int_field(cfg, "n") == 3 and get_int_field(cfg, "f") == 4
    assert get_int_field(cfg, "a", 5) == 5 and get_int_field(cfg, "zz", required=False) == 0
    for key in ("t", "s"):
        with pytest.raises(ValueError, match=f"'{key}' must be an integer"):
            get_int_field(cfg, key)
    with pytest.raises(ValueError, match="missing required field 'zz'"):
        get_int_field(cfg, "zz")


def test_check_fixed_fields() -> None:
    check_fixed_fields({"use_qk_norm": True}, [("use_qk_norm", True), ("gate", False)])  # missing: the wanted value
    with pytest.raises(ValueError, match="'gate'=True is unsupported"):
        check_fixed_fields({"gate": True}, [("gate", False)])


def test_rotary_dim() -> None:
    assert get_rotary_dim({}, 128) == 64
    assert get_rotary_dim({"partial_rotary_factor": 0.25}, 128) == 32
    assert get_rotary_dim({"rotary_dim": 16, "partial_rotary_factor": 0.5}, 128) == 16  # no check: rotary_dim wins
    with pytest.raises(ValueError, match="inconsistent config: rotary_dim=16"):
        get_rotary_dim({"rotary_dim": 16, "partial_rotary_factor": 0.5}, 128, check=True)


def test_models_reexports_and_no_torch() -> None:
    import msakit.models as models

    for name in config_io.__all__:
        assert getattr(models, name) is getattr(config_io, name) and name in models.__all__
    code = "import sys, msakit.config_io; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
