"""Each MSA op at one shape, in its own process with a time limit: finds which configuration of a
kernel hangs or is slow (a hang in one launch cannot stop the other cases).

    python benchmarks/probe_ops.py [--timeout 40] [--T 4096]

Prints one line per case (first and second call seconds, or TIMEOUT / the error) and writes
probe_ops.json into $OUT (or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, op, G, Hq, D, Di, block_size, topk, init_blocks, extra config for index_topk)
CASES = [
    ("topk b64k8 i0", "topk", 2, 14, 64, 64, 64, 8, 0, None),
    ("topk b64k8 i1", "topk", 2, 14, 64, 64, 64, 8, 1, None),
    ("topk b64k8 i1 noTMA", "topk", 2, 14, 64, 64, 64, 8, 1, {"TMA": False}),
    ("topk b64k8 i1 noSHFL", "topk", 2, 14, 64, 64, 64, 8, 1, {"SHFL": False}),
    ("topk b128k16 i0", "topk", 2, 14, 64, 64, 128, 16, 0, None),
    ("topk b128k16 i1", "topk", 2, 14, 64, 64, 128, 16, 1, None),
    ("topk G4 Di128 b128k16 i0", "topk", 4, 64, 128, 128, 128, 16, 0, None),
    ("topk G4 Di128 b128k16 i1", "topk", 4, 64, 128, 128, 128, 16, 1, None),
    ("topk G2 Di128 b128k16 i0", "topk", 2, 14, 64, 128, 128, 16, 0, None),
    ("topk G4 Di64 b128k16 i0", "topk", 4, 64, 128, 64, 128, 16, 0, None),
    ("sparse b64k8", "sparse", 2, 14, 64, 64, 64, 8, 1, None),
    ("sparse b128k16", "sparse", 2, 14, 64, 64, 128, 16, 1, None),
    ("kl b64k8", "kl", 2, 14, 64, 64, 64, 8, 1, None),
    ("kl b128k16", "kl", 2, 14, 64, 64, 128, 16, 1, None),
]

CHILD = r'''
import json, sys, time, torch
from msakit import ops
name, op, G, Hq, D, Di, bs, k, init, cfg, T = json.loads(sys.argv[1])
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
qi, ki = r(1, T, G, Di), r(1, T, Di)
sel = dict(block_size=bs, topk=k, local_blocks=1, init_blocks=init)
if op == "topk":
    if cfg:
        from msakit.ops.index_topk.triton import index_topk_triton
        from msakit.ops.index_topk import Selection
        fn = lambda: index_topk_triton(qi, ki, Selection(**sel), config=cfg)
    else:
        fn = lambda: ops.index_topk(qi, ki, **sel)
else:
    bi = ops.index_topk(qi, ki, **sel, backend="reference")
    q, kk, v = r(1, T, Hq, D), r(1, T, G, D), r(1, T, G, D)
    if op == "sparse":
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, v))
        def fn():
            o = ops.sparse_attention(qg, kg, vg, bi, block_size=bs)
            o.float().square().mean().backward()
            return o
    else:
        qg, kg = qi.clone().requires_grad_(), ki.clone().requires_grad_()
        def fn():
            l = ops.index_kl_loss(q, kk, qg, kg, bi, block_size=bs)
            l.backward()
            return l
torch.cuda.synchronize()
out = {}
for tag in ("first", "second"):
    t0 = time.perf_counter()
    res = fn()
    torch.cuda.synchronize()
    out[tag] = round(time.perf_counter() - t0, 4)
    print(f"{tag} {out[tag]}", flush=True)
if op == "topk":
    ref = ops.index_topk(qi, ki, **sel, backend="reference")
    out["same_sets"] = float((res.sort(-1).values == ref.sort(-1).values).all(-1).float().mean())
print("RESULT " + json.dumps(out), flush=True)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=40.0)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    args = ap.parse_args()
    rows = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    for case in CASES:
        if args.only and not any(s in case[0] for s in args.only.split(",")):
            continue
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, json.dumps([*case, args.T])], capture_output=True,
                               text=True, timeout=args.timeout, env=env, cwd=ROOT)
            res = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            row = dict(case=case[0], rc=p.returncode, **(res[0] if res else {}))
            if p.returncode != 0:
                row["error"] = p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else "?"
        except subprocess.TimeoutExpired as e:
            row = dict(case=case[0], rc="TIMEOUT", partial=(e.stdout or b"").decode()[-200:]
                       if isinstance(e.stdout, bytes) else (e.stdout or "")[-200:])
        row["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(os.environ.get("OUT", "."))
    (out / "probe_ops.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
