"""benchmarks/gpu.py: argument parsing, scheduling, the comparison table, bundling, one fake run."""

from __future__ import annotations

import json
import random
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu  # noqa: E402
from benchmarks.common import commit_info, tree_digest  # noqa: E402


def test_parse_args(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = gpu.parse_args(["prefill", "decode", "--out", "/tmp/x", "--quick", "--tag", "_r"])
    assert a.claims == ["prefill", "decode"] and a.quick and a.tag == "_r" and a.budget_s == 540
    for bad in (["nope", "--out", "x"], ["prefill", "prefill", "--out", "x"], ["prefill"], ["--out", "x"],
                ["prefill", "--out", "x", "--baseline", "prefill"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(bad)
    assert gpu.parse_args(["--list"]).list


def test_claim_commands_name_their_results_apart():
    c = gpu.claim_command("spec", gpu.CLAIMS["spec"], quick=False, tag="_r18", python="py")
    assert c[1].endswith("benchmarks/spec.py") and c[2:] == ["--recipe", "run17", "--speed-batches", "1", "--tag", "_r18"]
    assert gpu.claim_command("spec", gpu.CLAIMS["spec"], quick=True, tag="", python="py")[2:] == ["--quick", "--tag", ""]
    p = gpu.claim_command("generate_profile", gpu.CLAIMS["generate_profile"], quick=False, tag="_r", python="py")
    assert p[2:] == ["--profile", "--tag", "_r_profile"]
    pq = gpu.claim_command("generate_profile", gpu.CLAIMS["generate_profile"], quick=True, tag="_r", python="py")
    assert pq[-1] == "_r_profile"
    for name in ("quality", "forward_check"):  # scripts that name their own files
        assert "--tag" not in gpu.claim_command(name, gpu.CLAIMS[name], quick=False, tag="_r", python="py")
    for name, c in gpu.CLAIMS.items():  # every claim's script exists
        assert (gpu.HERE / c.script).is_file(), name


def test_schedule_balances_queues_and_keeps_order_on_one_gpu():
    names = ["prefill", "decode", "generate", "spec"]
    assert gpu.schedule(names, 1, quick=False) == [names]
    two = gpu.schedule(names, 2, quick=False)
    assert sorted(sum(two, [])) == sorted(names) and all(two)
    loads = [sum(gpu.CLAIMS[n].expect_s for n in q) for q in two]
    assert max(loads) <= sum(loads) - max(gpu.CLAIMS[n].expect_s for n in names) + 1e-9 or len(two[0]) == 1


def test_pick_and_verdict():
    data = {"forward": [{"T": 16, "msa_fwd_ms": 2.0}, {"T": 16, "kind": "trained-like", "msa_fwd_ms": 3.0}],
            "rows": [{"context": 1, "graph": {"x": 5}}]}
    assert gpu.pick(data, ("forward", {"T": 16, "kind": "random"}, "msa_fwd_ms")) == 2.0  # default kind
    assert gpu.pick(data, ("forward", {"T": 16, "kind": "trained-like"}, "msa_fwd_ms")) == 3.0
    assert gpu.pick(data, ("rows", {"context": 1}, "graph", "x")) == 5
    assert gpu.pick(data, ("rows", {"context": 2}, "graph")) is None
    assert gpu.pick(data, ("forward", "T")) is None and gpu.pick(data, None) is None
    assert gpu.verdict(100.0, 96.0, True) == (0.96, "ok")
    assert gpu.verdict(100.0, 94.0, True)[1] == "WORSE"
    assert gpu.verdict(100.0, 106.0, True)[1] == "better"
    assert gpu.verdict(10.0, 10.4, False)[1] == "ok"  # a time 4% longer: within 5%
    assert gpu.verdict(10.0, 10.6, False)[1] == "WORSE"
    assert gpu.verdict(10.0, 9.0, False)[1] == "better"
    assert gpu.verdict(None, 3.0, True) == (None, "new")
    assert gpu.verdict(3.0, None, True) == (None, "missing")
    assert gpu.verdict(3.0, float("nan"), True) == (None, "missing")


def test_compare_against_a_fake_old_result(tmp_path):
    old = {"forward": [{"T": 16384, "msa_fwd_ms": 4.0, "speedup_fwd": 1.5}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    new = {"forward": [{"T": 16384, "kind": "random", "msa_fwd_ms": 5.0, "speedup_fwd": 1.52},
                       {"T": 16384, "kind": "trained-like", "msa_fwd_ms": 4.4}]}
    base = [("prefill", "16K ms", "old.json", ("forward", {"T": 16384}, "msa_fwd_ms"), None, False),
            ("prefill", "16K speedup", "old.json", ("forward", {"T": 16384}, "speedup_fwd"), None, True),
            ("prefill", "16K tl ms", None, None, ("forward", {"T": 16384, "kind": "trained-like"}, "msa_fwd_ms"), False),
            ("decode", "not run", "old.json", ("x",), None, True)]
    rows = gpu.compare({"prefill": new}, base, results_dir=tmp_path)
    assert [r["metric"] for r in rows] == ["16K ms", "16K speedup", "16K tl ms"]
    assert rows[0]["ratio"] == pytest.approx(1.25) and rows[0]["verdict"] == "WORSE"
    assert rows[1]["verdict"] == "ok" and rows[2]["verdict"] == "new" and rows[2]["old"] is None
    text = gpu.table_text(rows)
    assert "1.250" in text and "1.013" in text and "WORSE" in text and "1 worse: prefill 16K ms" in text
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"forward": [{"T": 16384, "msa_fwd_ms": 5.0}]}))
    rows = gpu.compare({"prefill": new}, base[:1], results_dir=tmp_path, overrides={"prefill": str(other)})
    assert rows[0]["verdict"] == "ok" and rows[0]["old_file"] == "other.json"


def test_every_baseline_resolves_in_the_committed_results():
    old_files = {spec[2] for spec in gpu.BASELINES if spec[2]}
    for f in old_files:
        data = json.loads((gpu.RESULTS / f).read_text())
        for spec in gpu.BASELINES:
            if spec[2] == f:
                assert isinstance(gpu.pick(data, spec[3]), (int, float)), (f, spec[1])


def _files(d: Path, sizes: dict[str, int]) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name, n in sizes.items():
        p = d / name
        p.write_bytes(random.Random(n).randbytes(n))  # incompressible
        out.append(p)
    return out


def test_bundle_keeps_to_the_return_limits(tmp_path):
    prim = _files(tmp_path / "a", {f"c{i}.json": 1000 for i in range(10)})
    extra = _files(tmp_path / "b", {"p.png": 5000, "big.bin": 40_000})
    out = tmp_path / "out"
    m = gpu.bundle(out, prim, extra, max_files=8, max_bytes=30_000)
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and "gpu_extras.tgz" in names and m["files"] == [*[f"c{i}.json" for i in range(7)],
                                                                             "gpu_extras.tgz"]
    assert all((out / n).stat().st_size <= 30_000 for n in names)
    with tarfile.open(out / "gpu_extras.tgz") as tf:
        inside = sorted(tf.getnames())
    assert inside == sorted(["a/c7.json", "a/c8.json", "a/c9.json", "b/p.png"]) == sorted(m["archived"])
    assert m["left_out"] == ["b/big.bin"]  # would push the archive past max_bytes
    assert all(p.parent == out for p in out.iterdir())  # nothing deeper than out itself
    m2 = gpu.bundle(tmp_path / "out2", prim[:3], [])  # few files: all plain, no archive
    assert m2["files"] == ["c0.json", "c1.json", "c2.json"] and not (tmp_path / "out2" / "gpu_extras.tgz").exists()


def test_commit_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("MSAKIT_COMMIT", raising=False)
    f = tmp_path / "COMMIT"
    assert commit_info(f)["commit_reliable"] is False  # only git rev-parse left
    f.write_text("abc123\n")
    assert commit_info(f) == {"commit": "abc123", "commit_source": "COMMIT", "commit_reliable": True}
    monkeypatch.setenv("MSAKIT_COMMIT", "def456")
    assert commit_info(f)["commit"] == "def456"
    assert commit_info(f, override="0f0f")["commit"] == "0f0f"
    (tmp_path / "msakit").mkdir()
    (tmp_path / "msakit" / "a.py").write_text("x = 1\n")
    d1 = tree_digest(tmp_path, ("msakit",))
    (tmp_path / "msakit" / "a.py").write_text("x = 2\n")
    assert tree_digest(tmp_path, ("msakit",)) != d1


FAKE = '''
import json, os, sys, time
tag = sys.argv[sys.argv.index("--tag") + 1]
if "--sleep" in sys.argv:
    time.sleep(60)
out = os.environ["OUT"]
json.dump({"env": {"gpu": "Fake GPU", "torch": "t", "triton": "tr", "cuda": "c"}, "rows": [{"x": 2.0}]},
          open(os.path.join(out, f"fake_cpu{tag}.json"), "w"))
open(os.path.join(out, "fake.png"), "wb").write(b"png")
print("fake done")
'''


def test_driver_runs_claims_compares_and_bundles(tmp_path, monkeypatch, capsys):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    (tmp_path / "old.json").write_text(json.dumps({"rows": [{"x": 2.05}]}))
    monkeypatch.setitem(gpu.CLAIMS, "fake", gpu.Claim(str(script), (), (), budget_s=60, quick_budget_s=60))
    monkeypatch.setitem(gpu.CLAIMS, "slow", gpu.Claim(str(script), ("--sleep",), (), budget_s=1.5, prefix="fake"))
    monkeypatch.setattr(gpu, "BASELINES", [("fake", "x", str(tmp_path / "old.json"), ("rows", {}, "x"), None, True)])
    monkeypatch.setenv("MSAKIT_COMMIT", "cafe")
    out = tmp_path / "out"
    rc = gpu.main(["fake", "slow", "--out", str(out), "--tag", "_t", "--gpus", "1"])
    text = capsys.readouterr().out
    assert rc == 1  # the slow claim timed out
    summary = json.loads((out / "gpu_summary.json").read_text())
    assert summary["claims"]["fake"]["status"] == "ok" and summary["claims"]["slow"]["status"].startswith("timed out")
    assert summary["env"]["commit"] == "cafe" and summary["env"]["gpu"] == "Fake GPU"
    assert summary["comparison"][0]["verdict"] == "ok"
    assert "fake x" in text and "0.976" in text and "commit cafe" in text
    names = sorted(p.name for p in out.iterdir())
    assert names == ["fake_cpu_t.json", "gpu_extras.tgz", "gpu_log.txt", "gpu_summary.json"]
    assert "fake done" in (out / "gpu_log.txt").read_text()


def test_result_notes_name_recipe_differences_failures_and_partial_runs():
    res = {"spec": {"recipe": {"name": "run17", "differs_from_run17": "steps fixed"}, "partial": True},
           "prefill": {"forward": [{"T": 16, "kind": "trained-like", "error": "OOM"}, {"T": 16, "kind": "random"},
                                   {"T": 32, "sparse_attn_ms": 2.0}, {"T": 32, "kind": "trained-like", "sparse_attn_ms": 2.5}]}}
    notes = gpu.result_notes(res)
    assert any("forward T=32: trained-like / random sparse_attn_ms = 1.250" in n for n in notes)
    assert any("differs from run 17: steps fixed" in n for n in notes)
    assert any("spec: PARTIAL" in n for n in notes)
    assert any("prefill: forward {'T': 16, 'kind': 'trained-like'} failed: OOM" in n for n in notes)
    assert len(notes) == 4
