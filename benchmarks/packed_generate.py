"""The packed small preset's decode against its BF16 twin (issue 30's generate bar).

One model of the `small` preset (random weights, BF16) is made QAT-ready and saved packed
(`save_quantized`: NVFP4 routed experts, MXFP8 elsewhere), then loaded three ways:

  packed      `load_quantized(...)` (the packed kernels: `backend="auto"`)
  reference   `load_quantized(..., backend="reference")` (dequantize-then-matmul, the fallback)
  bf16        the BF16 model the packed one was made from (the twin)

and each decodes one prompt greedily at batch 1 with `generate(..., compile=True)` (the paged,
graphed, compiled step; eager on the CPU).  Reported: decode tokens/s of each (the time of
`new + 1` tokens less the time of 1, over `new`: prefill excluded), packed / bf16, and whether the
packed path's greedy tokens equal the reference path's (the issue's "identical" bar; the bf16
twin's tokens differ by design: other weights).

    python benchmarks/packed_generate.py [--context 4096] [--new 128] [--reps 3] [--tag _runN]
    python benchmarks/packed_generate.py --tiny      (CPU smoke: the tiny preset, eager)

Writes packed_generate_<gpu>.json under benchmarks/results/ (and $OUT).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_run_args, env_info, gpu_tag, save_json  # noqa: E402
from msakit.generate import generate  # noqa: E402
from msakit.models import M3Config, M3ForCausalLM  # noqa: E402
from msakit.quant import load_quantized, prepare_qat, save_quantized  # noqa: E402


def decode_rate(model, ids: torch.Tensor, new: int, reps: int, compile_: bool) -> tuple[float, torch.Tensor]:
    """(decode tokens/s, the greedy tokens of `new` steps): best of `reps` of (time(new + 1) -
    time(1)) / new, after one warm-up of each length (compilation, graph capture)."""
    def run(n: int) -> tuple[float, torch.Tensor]:
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, ids, n, temperature=0.0, compile=compile_)
        if ids.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    run(1)
    _, toks = run(new + 1)
    best = float("inf")
    for _ in range(reps):
        t1, _ = run(1)
        tn, _ = run(new + 1)
        best = min(best, (tn - t1) / new)
    return 1.0 / best, toks[:, ids.shape[1]:ids.shape[1] + new]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, "fewer tokens")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny preset, eager steps")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.context < 1 or args.new < 1 or args.reps < 1:
        print("packed_generate.py: --context, --new and --reps must be >= 1", file=sys.stderr)
        return 2
    if not args.tiny and not torch.cuda.is_available():
        print("packed_generate.py needs a CUDA GPU (or --tiny for a CPU smoke run)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.tiny else "cuda")
    context, new = (32, 4) if args.tiny else (args.context, 32 if args.quick else args.new)
    preset = "tiny" if args.tiny else "small"
    torch.manual_seed(0)
    cfg = M3Config.preset(preset, max_position_embeddings=max(256, context + new + 8))
    twin = M3ForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(1)).to(dev)
    with tempfile.TemporaryDirectory() as tmp:
        save_quantized(prepare_qat(twin), Path(tmp) / "packed")
        packed = load_quantized(Path(tmp) / "packed", device=dev, dtype=torch.bfloat16).eval()
        ref = load_quantized(Path(tmp) / "packed", device=dev, dtype=torch.bfloat16, backend="reference").eval()
    compile_ = not args.tiny
    rows = {}
    with torch.no_grad():
        for name, model in (("packed", packed), ("reference", ref), ("bf16", twin)):
            rate, toks = decode_rate(model, ids, new, args.reps, compile_)
            rows[name] = {"tok_s": rate, "tokens": toks[0].tolist()}
            print(f"  {name:9s} {rate:9.1f} tok/s")
    same = rows["packed"]["tokens"] == rows["reference"]["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(rows["packed"]["tokens"], rows["reference"]["tokens"])) if a != b),
                 None)
    res = {"env": env_info(), "preset": preset, "context": context, "new": new, "batch": 1, "compile": compile_,
           "rows": rows, "packed_vs_bf16": rows["packed"]["tok_s"] / rows["bf16"]["tok_s"],
           "packed_vs_reference": rows["packed"]["tok_s"] / rows["reference"]["tok_s"],
           "greedy_tokens_identical": same, "first_mismatch": first}
    print(f"packed / bf16 {res['packed_vs_bf16']:.2f}x, packed / dequantize-then-matmul "
          f"{res['packed_vs_reference']:.2f}x; greedy tokens identical to the reference path: {same}"
          + ("" if same else f" (first mismatch at step {first})"))
    path = save_json(f"packed_generate_{gpu_tag(res['env'])}{args.tag}.json", res, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
