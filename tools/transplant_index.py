"""Put the index branches of a converted model onto the original backbone, in the backbone's dtype.

A warm-up run in bfloat16 (`msakit convert --dtype bfloat16 --train index`) saves its backbone in
bfloat16, which rounds the original float32 weights.  This builds the converted model again from
the original folder (same MSA settings, read from the warmed folder's config.json), copies the
warmed index weights into it (cast to the backbone's dtype) and saves it, so that an evaluation
compares the warmed indexer against dense attention on exactly the original weights.

    python tools/transplant_index.py --source ORIGINAL_HF_FOLDER --index WARMED_MODEL_FOLDER --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from msakit.models.convert import load_for_conversion  # noqa: E402
from msakit.models.hf import CONFIG_KEY, MSASettings, MSAWrappedModel, is_msa_folder  # noqa: E402


def transplant(source: Path, index: Path, out: Path) -> Path:
    if not is_msa_folder(index):
        raise ValueError(f"--index {index} is not a saved MSA model")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty")
    settings = MSASettings.from_dict(json.loads((index / "config.json").read_text())[CONFIG_KEY])
    hf = load_for_conversion(source)
    model = MSAWrappedModel(hf, settings, seed=None)
    want = set(model.adapter.index_weight_names(model.hf, settings.layers))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(index.glob("*.safetensors")):
        tensors.update({n: t for n, t in load_file(str(f)).items() if n in want})
    model.adapter.load_index_state_dict(model.hf, settings.layers, tensors)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, required=True, help="the original dense HF folder")
    p.add_argument("--index", type=Path, required=True, help="the converted (warmed) model folder")
    p.add_argument("--out", type=Path, required=True, help="new folder for the result")
    a = p.parse_args(argv)
    try:
        print(transplant(a.source.expanduser(), a.index.expanduser(), a.out.expanduser()))
    except (ValueError, FileNotFoundError) as e:
        print(f"transplant_index: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
