"""Files a model folder's safetensors index names must lie inside the folder: a manifest that names
`../outside/x.safetensors`, an absolute path or a link out of the folder is refused before anything
is read, by msakit's loader and before transformers loads an HF folder."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from msakit.models import M3Config, M3ForCausalLM
from msakit.models.io import INDEX_FILE, manifest_entries, weight_files


def _folder_with_index(tmp_path, target: str):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"lm_head.weight": target}}))
    return folder


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_manifest_outside_the_folder_is_refused(tmp_path, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(outside / "x.safetensors"))
    target = {"dotdot": "../outside/x.safetensors", "absolute": str(outside / "x.safetensors"),
              "link": "linked/x.safetensors"}[how]
    folder = _folder_with_index(tmp_path, target)
    if how == "link":
        os.symlink(outside, folder / "linked")
    with pytest.raises(ValueError, match="outside"):
        weight_files(folder)
    with pytest.raises(ValueError, match="outside"):
        manifest_entries(folder)


def test_manifest_inside_the_folder_loads(tmp_path):
    cfg = M3Config.preset("tiny", num_hidden_layers=1, vocab_size=64)
    model = M3ForCausalLM(cfg)
    model.save_pretrained(tmp_path / "m", max_shard_size=20_000)  # sharded: an index naming its shards
    assert (tmp_path / "m" / INDEX_FILE).is_file()
    again = M3ForCausalLM.from_pretrained(tmp_path / "m")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_bad_manifest_json_is_a_value_error(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": ["not", "a", "dict"]}))
    with pytest.raises(ValueError, match="not a safetensors index"):
        weight_files(folder)
