"""The per-claim scripts' CPU-side logic: prefill's arguments, generate's kernel kinds,
train_speed's FLOP count, spec's step-matched recipes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import generate, prefill, spec, train_speed  # noqa: E402


def test_prefill_arguments(tmp_path):
    a = prefill.parse_args([])
    assert a.T == [16384, 131072, 1048576] and a.train_T == [16384, 131072]
    assert a.kinds == ["random", "trained-like", "real-like"] and a.check == [16384]
    q = prefill.parse_args(["--quick"])
    assert q.T == prefill.QUICK["T"] and q.train_T == prefill.QUICK["train_T"]
    with pytest.raises(SystemExit):
        prefill.parse_args(["--kinds", "dumped"])  # needs the file
    f = tmp_path / "sel.pt"
    torch.save({"block_idx": torch.zeros(1, 4, 300, 16, dtype=torch.int32)}, f)
    d = prefill.parse_args(["--selection-file", str(f)])
    assert d.kinds[-1] == "dumped" and prefill.load_block_idx_T(str(f)) == 300
    assert prefill.kinds_at(300, d.kinds, str(f)) == ["random", "trained-like", "real-like", "dumped"]
    assert prefill.kinds_at(16384, d.kinds, str(f)) == ["random", "trained-like", "real-like"]


def test_prefill_flop_counts():
    T = 131072
    # dense causal: half of 4 Hq D T^2; sparse: 4 Hq D (topk * block) per query; index: half of 2 G Di T^2
    assert prefill.flops_dense(T) == 4 * 64 * 128 * T * T / 2
    assert prefill.flops_attn(T) == 4 * 64 * 128 * 16 * 128 * T
    assert prefill.flops_index(T) == 2 * 4 * 128 * T * T / 2


@pytest.mark.parametrize("name,kind", [
    ("_score2_kernel", "msa_decode"), ("_attn_kernel", "msa_decode"), ("_merge1_kernel", "msa_decode"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("void at::native::(anonymous namespace)::radixSortKVInPlace<...>", "moe_routing"),
    ("void at::native::_scatter_gather_elementwise_kernel<...>", "moe_routing"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<grouped>>", "grouped_gemm"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblem",
     "grouped_gemm"),  # torch._grouped_mm's kernel, mangled
    ("_gate_up_kernel", "routed_experts"), ("_down_kernel", "routed_experts"),
    ("nvjet_tst_128x64_64x6_1x1_v_bz_coopA_TNT", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("something_unheard_of", "other"),
])
def test_kernel_kinds(name, kind):
    assert generate.kernel_kind(name) == kind


def test_per_step_kernel_table():
    a = generate.kernel_table([("_attn_kernel", 2.0), ("nvjet_x", 1.0)])
    b = generate.kernel_table([("_attn_kernel", 2.0)] * 5 + [("nvjet_x", 1.0)] * 9 + [("Memset", 0.5)])
    ps = generate.per_step(a, b, 4)
    assert ps["msa_decode"] == {"count": 1.0, "us": 2.0} and ps["gemm"] == {"count": 2.0, "us": 2.0}
    assert ps["copy"] == {"count": 0.25, "us": 0.125}


def test_train_speed_flops_count_active_parameters():
    from msakit.models import M3Config, M3ForCausalLM

    cfg = M3Config.preset("tiny")
    model = M3ForCausalLM(cfg)
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    dense = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    experts = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 3 and p.shape[0] == E)
    assert experts > 0 and train_speed.active_params(model) == pytest.approx(dense + experts * k / E)
    T = 4096
    d = train_speed.attn_fwd_flops_per_token(cfg, T, "dense")
    s = train_speed.attn_fwd_flops_per_token(cfg, T, "sparse")
    keys = cfg.index_topk_blocks * cfg.index_block_size
    assert d == cfg.num_hidden_layers * 2 * cfg.num_attention_heads * cfg.head_dim * T
    assert s == cfg.num_hidden_layers * (4 * cfg.num_attention_heads * cfg.head_dim * keys
                                         + cfg.index_n_heads * cfg.index_head_dim * T)
    assert train_speed.model_flops_per_token(model, T, "dense") == pytest.approx(
        6 * train_speed.active_params(model) + 3 * d)


def test_spec_recipes_fill_only_defaulted_flags():
    ap = argparse.ArgumentParser()
    for f, kw in (("--target-steps", dict(type=int)), ("--dense-warmup-steps", dict(type=int)),
                  ("--pool-rows", dict(type=int)), ("--drafter-steps", dict(type=int)),
                  ("--no-ablation", dict(action="store_true")), ("--budgets", dict(default="off,profiled")),
                  ("--speed-batches", dict(type=int, nargs="*")), ("--speed-reps", dict(type=int)),
                  ("--recipe", dict(default=None)), ("--quick", dict(action="store_true"))):
        ap.add_argument(f, **kw)
    a = ap.parse_args(["--recipe", "run17", "--drafter-steps", "10"])
    spec.apply_recipe(a, ap)
    assert (a.target_steps, a.dense_warmup_steps, a.pool_rows, a.no_ablation, a.budgets) == (358, 133, 2048, True, "off")
    assert a.drafter_steps == 10  # explicit flags win
    q = ap.parse_args(["--quick"])
    spec.apply_recipe(q, ap)
    assert q.recipe == "quick" and q.speed_batches == [1] and q.target_steps == spec.RECIPES["quick"]["target_steps"]
    n = ap.parse_args([])
    spec.apply_recipe(n, ap)
    assert n.target_steps is None and n.budgets == "off,profiled"


def test_prefill_extrapolates_only_missing_dense_steps():
    rows = [{"T": 16384, "dense_train_ms": 10.0, "msa_train_ms": 5.0, "speedup_train": 2.0},
            {"T": 131072, "dense_train_ms": 640.0, "msa_train_ms": 80.0, "speedup_train": 8.0},
            {"T": 262144, "dense_train_ms": None, "msa_train_ms": 160.0},
            {"T": 524288, "dense_train_ms": None, "error": "oom"}]
    prefill.extrapolate_dense(rows)
    assert rows[1]["dense_train_ms"] == 640.0 and "dense_train_extrapolated_from_T" not in rows[1]
    assert rows[2]["dense_train_ms"] == 640.0 * 4 and rows[2]["speedup_train"] == 16.0
    assert rows[2]["dense_train_extrapolated_from_T"] == 131072 and "speedup_train" not in rows[3]


def _cpu_wall_s(fn, reps=3):
    import time

    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def test_generate_main_on_a_tiny_cpu_model(tmp_path, monkeypatch):
    """generate.py end to end on CPU: the tiny preset instead of "small", host timing."""
    import json

    from msakit.models import M3Config, M3ForCausalLM

    def build(context, new, batch, seed=0):
        torch.manual_seed(seed)
        cfg = M3Config.preset("tiny", vocab_size=64, max_position_embeddings=context + 4 * new + 8)
        model = M3ForCausalLM(cfg).eval()
        model.set_attention_mode("dense")  # no interpreted kernels: the script's logic is under test
        return model, torch.randint(0, 64, (batch, context))

    monkeypatch.setattr(generate, "build", build)
    monkeypatch.setattr(generate, "wall_s", _cpu_wall_s)
    monkeypatch.setattr(generate, "RESULTS", tmp_path, raising=False)
    monkeypatch.setattr(sys.modules["benchmarks.common"], "RESULTS", tmp_path)
    generate.main(["--contexts", "12", "--new", "2", "--reps", "1", "--eager", "--tag", "_t", "--out", str(tmp_path / "o")])
    data = json.loads((tmp_path / "o" / "generate_cpu_t.json").read_text())
    row = data["rows"][0]
    assert row["context"] == 12 and row["new_tokens"] == 2 and "error" not in row, row
    assert row["tok_s_e2e"] > 0 and row["prefill_ms"] > 0 and "eager" in row
    assert data["env"]["tree_digest"] and "commit" in data["env"]


def test_generate_step_time_repeats_within_the_pool():
    """step_time restarts from the prompt each repetition: with a pool sized for one sequence of
    max_len, five repetitions of 4 steps fit (they would run out of pages without the reset)."""
    from msakit.models import M3Config, M3ForCausalLM

    torch.manual_seed(0)
    cfg = M3Config.preset("tiny", vocab_size=64, max_position_embeddings=256)
    model = M3ForCausalLM(cfg).eval()
    model.set_attention_mode("dense")
    ids = torch.randint(0, 64, (1, 40))
    r = generate.step_time(model, ids, 40 + 8, compile=False, steps=4, reps=5)
    assert r["reps"] == 5 and 0 < r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"], r


def test_decode_main_with_a_fake_bench(tmp_path, monkeypatch):
    """decode.py's driver logic (arguments, read-flush rows, JSON) over a stand-in for tools.bench.decode."""
    import json
    import types

    from benchmarks import decode

    calls = {}
    row = lambda B, N, idx: {"B": B, "N": N, "idx": idx, "nq": 1, "msa_ms": 0.1, "floor_ms": 0.05,  # noqa: E731
                             "vs_floor": 2.0, "dense_ms": 0.5, "speedup": 5.0}
    fake = types.SimpleNamespace(
        HQ=64, G=4, D=128, DI=128, PS=128, TOPK=16, READ_BW=4.16e12, LAUNCHES=("split", "ticket"),
        graph_check=lambda launches: {"ok": True},
        run=lambda Bs, Ns, idxs, nq=(1,), launches=("split",): calls.setdefault(
            "run", [row(B, N, i) for N in Ns for B in Bs for i in idxs]),
        dense_ms=lambda B, N, read_flush=False: {"dense_ms": 0.5, "dense_read_ms": 0.45},
        bench_case=lambda B, N, idx, detail=True, read_flush=False, launch="split": {"msa_ms": 0.1,
                                                                                    "msa_read_ms": 0.09},
        print_table=lambda rows: calls.setdefault("printed", len(rows)))
    monkeypatch.setattr(decode, "bench", fake)
    monkeypatch.setattr(decode, "RESULTS", tmp_path)
    monkeypatch.setattr(sys.modules["benchmarks.common"], "RESULTS", tmp_path)
    monkeypatch.setattr(decode, "plot", lambda rows, path: None)
    decode.main(["--quick", "--read-flush", "--launch", "split", "ticket", "--tag", "_t", "--out", str(tmp_path / "o")])
    data = json.loads((tmp_path / "o" / "decode_cpu_t.json").read_text())
    assert [(r["B"], r["N"]) for r in data["rows"]] == [(1, 16384), (1, 16384), (1, 1048576), (1, 1048576)]
    assert "graph_check" not in data  # --quick skips it
    assert [(r["N"], r["idx"], r["launch"]) for r in data["read_flush"]] == [
        (1048576, "bf16", "split"), (1048576, "bf16", "ticket"), (1048576, "fp8", "split"), (1048576, "fp8", "ticket")]
    assert data["launches"] == ["split", "ticket"]
    assert data["read_flush"][0]["speedup_read_flush"] == pytest.approx(5.0) and calls["printed"] == 4


def test_prefill_main_at_toy_sizes_on_cpu(tmp_path, monkeypatch):
    """prefill.py's flow (kinds, forward and training rows, check, JSON) on CPU: a toy layer shape,
    the reference ops, host timing; the GPU-only parts (CUDA timing, memory) stand in."""
    import json
    import time
    import types

    from msakit import ops

    for name, val in dict(HQ=4, G=2, D=16, DI=16, BS=16, TOPK=4).items():
        monkeypatch.setattr(prefill, name, val)

    def inputs(T, seed=0, grad=False):
        g = torch.Generator().manual_seed(seed)
        ts = [torch.randn(*s, generator=g) for s in ((1, T, 4, 16), (1, T, 2, 16), (1, T, 2, 16), (1, T, 2, 16),
                                                      (1, T, 16))]
        return [t.requires_grad_(grad) for t in ts]

    ref = types.SimpleNamespace(
        index_topk=lambda *a, **k: ops.index_topk(*a, backend="reference", **k),
        sparse_attention=lambda *a, **k: ops.sparse_attention(*a, backend="reference", **k),
        index_kl_loss=lambda *a, **k: ops.index_kl_loss(*a, backend="reference", **k),
        sparse_attention_with_kl=lambda *a, **k: ops.sparse_attention_with_kl(*a, backend="reference", **k),
        msa_attention=lambda *a, **k: ops.msa_attention(*a, backend="reference", **k))

    def host_ms(fn, **kw):
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    monkeypatch.setattr(prefill, "inputs", inputs)
    monkeypatch.setattr(prefill, "ops", ref)
    monkeypatch.setattr(prefill, "bench_ms", host_ms)
    monkeypatch.setattr(prefill, "dense_cudnn", lambda q, k, v, backward=False: lambda: ops.dense_attention(q, k, v))
    monkeypatch.setattr(prefill, "peak_extra_gib", lambda fn, keep=0: (fn(), 0.0)[1])
    monkeypatch.setattr(prefill, "plot", lambda *a: None)
    monkeypatch.setattr(prefill, "RESULTS", tmp_path)
    monkeypatch.setattr(sys.modules["benchmarks.common"], "RESULTS", tmp_path)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    prefill.main(["--T", "64", "96", "--train-T", "64", "--tag", "_t", "--out", str(tmp_path / "o")])
    data = json.loads((tmp_path / "o" / "prefill_cpu_t.json").read_text())
    assert [(r["T"], r["kind"], r["score"]) for r in data["forward"]] == [
        (T, kind, score) for T in (64, 96) for kind, score in (("random", "bf16"), ("trained-like", "bf16"),
                                                               ("real-like", "bf16"), ("random", "fp8"))]
    assert [(r["T"], r["kind"]) for r in data["train"]] == [(64, "random"), (64, "trained-like"), (64, "real-like")]
    assert not any("error" in r for r in data["forward"] + data["train"]), data
    f64 = data["forward"][:3]
    assert all(r["max_row_rel_err"] == 0.0 for r in f64)  # the reference against itself
    assert "max_row_rel_err" not in data["forward"][4]  # checked at the smallest T only
    assert all(r["speedup_fwd"] > 0 for r in data["forward"])
    assert all(r["sparse_attn_tflops"] > 0 for r in data["forward"] if r["score"] == "bf16")
    fp8 = [r for r in data["forward"] if r["score"] == "fp8"]
    assert all(0.5 < r["recall_vs_bf16"] <= 1.0 and 0.0 <= r["same_set_frac"] <= 1.0 for r in fp8), fp8
    assert "partial" not in data and data["kinds"] == ["random", "trained-like", "real-like"]


def test_prefill_recall_counts_shared_valid_blocks():
    ref = torch.tensor([[[[0, 1, 2, -1], [3, 4, 5, 6]]]])
    sel = torch.tensor([[[[2, 1, 7, -1], [6, 5, 4, -1]]]])
    # row 0: {0, 1, 2} against {1, 2, 7}: 2 of 3; row 1: {3, 4, 5, 6} against {4, 5, 6}: 3 of 4
    assert prefill.recall_vs(sel, ref) == 5 / 7
    assert prefill.recall_vs(ref, ref) == 1.0 and prefill.recall_vs(sel, ref, rows=1) == 5 / 7


def test_train_speed_measure_on_cpu(monkeypatch):
    """One MSA and one dense measurement of train_speed.py on the tiny preset on CPU (the step's
    calls into the model and optimizer; the numbers mean nothing)."""
    monkeypatch.setattr(train_speed, "wall_s", _cpu_wall_s)
    rows = {m: train_speed.measure(64, 64, m, steps=1, warmup=0, dense_backend="default", peak=1.0, profile=False,
                                   preset="tiny", device="cpu") for m in ("dense", "sparse")}
    for m, r in rows.items():
        assert r["batch"] == 1 and r["tokens_per_step"] == 64 and r["step_ms"] > 0 and r["mfu"] > 0, r
    assert "mfu_dense_equiv" in rows["sparse"] and rows["sparse"]["model_tflop_per_step"] < rows["dense"][
        "model_tflop_per_step"] * 2


@pytest.mark.parametrize("name", ["common", "selections", "prefill", "decode", "generate", "train_speed", "qat", "spec",
                                  "spec_report", "quality", "gpu", "ops_edges"])
def test_every_script_imports(name):
    """What a script imports at module level exists in the tree (the GPU runs them; CI cannot)."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{name}")
    if hasattr(mod, "main"):
        assert callable(mod.main)


def test_convert_eval_run_streams_logs_and_stops_a_hang(tmp_path, capsys):
    import time

    from benchmarks import convert_eval

    log = tmp_path / "log.txt"
    r = convert_eval.run([sys.executable, "-c", "print('one'); print('two')"], 60, log)
    assert r["rc"] == 0 and "two" in r["tail"]
    assert log.read_text().splitlines() == ["one", "two"]
    assert "one" in capsys.readouterr().out  # streamed as it came
    t0 = time.time()
    r = convert_eval.run([sys.executable, "-c", "import time; print('start', flush=True); time.sleep(60)"], 1.0)
    assert r["rc"] != 0 and "start" in r["tail"] and time.time() - t0 < 30


@pytest.mark.parametrize("event,kind", [
    (("_sa_fwd_kernel", 1.0, ("msakit::sparse_attention_fwd",)), "sparse_attn_fwd"),
    (("void at::native::vectorized_elementwise_kernel<4>", 1.0, ("aten::mul", "msakit::sparse_attention_bwd")),
     "sparse_attn_bwd"),
    (("_wl_entry_kernel", 1.0, ("msakit::index_kl_fwd", "Torch-Compiled Region: 0/0")), "index_kl"),
    (("_index_topk_kernel", 1.0, ()), "index_topk"),
    (("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1.0, ("aten::_scaled_dot_product_cudnn_attention",)),
     "sdpa"),
    (("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 1.0, ("Optimizer.step#AdamW.step",)),
     "optimizer"),
    (("triton_poi_fused__to_copy_add_mul_rsqrt_0", 1.0, ("Torch-Compiled Region: 1/0",)), "elementwise"),
    (("triton_per_fused_add_mean_pow_1", 1.0, ()), "reduce"),
    (("nvjet_tst_128x64_64x6_1x1_v_bz_coopA_TNT", 1.0, ("aten::mm",)), "gemm"),
    (("Memcpy DtoD (Device -> Device)", 1.0, ("aten::copy_",)), "copy"),
])
def test_train_kernel_kinds(event, kind):
    from benchmarks.common import kernel_table

    t = kernel_table([event, event], train_speed.TRAIN_KERNEL_KINDS, train_speed.TRAIN_OP_KINDS)
    assert t == {kind: {"count": 2, "us": 2.0}}


def test_train_speed_compiled_row_on_cpu(monkeypatch):
    """--compile's row on CPU: the layers compiled (dynamo + AOTAutograd here: inductor's CPU
    compile is slow), the first step's seconds and the graph counts recorded."""
    import functools

    from msakit.train import trainer

    monkeypatch.setattr(train_speed, "wall_s", _cpu_wall_s)
    monkeypatch.setattr(trainer, "compile_layers", functools.partial(trainer.compile_layers, backend="aot_eager"))
    r = train_speed.measure(64, 64, "dense", steps=1, warmup=0, dense_backend="default", peak=1.0, profile=False,
                            preset="tiny", device="cpu", compile=True)
    assert r["compiled"] and r["layers"] == "compiled" and r["first_step_s"] > 0 and r["graphs"] >= 2, r
    assert r["graph_breaks"] == 0 and r["step_ms"] > 0


def test_profiled_kernels_walks_the_ops_around_each_launch(monkeypatch):
    """with_ops: each device event once, with its device time; one the profiler linked to a CPU op
    gets that op and its ancestors, one linked to none comes by name alone (synthetic events)."""
    from types import SimpleNamespace as NS

    from benchmarks.common import profiled_kernels

    step = NS(name="Optimizer.step#AdamW.step", cpu_parent=None, id=1, device_type="DeviceType.CPU", kernels=[])
    op = NS(name="aten::_fused_adamw_", cpu_parent=step, id=2, device_type="DeviceType.CPU",
            kernels=[NS(name="fused_adam_kernel", duration=3.0)])
    dev = lambda name, corr: NS(name=name, device_type="DeviceType.CUDA", linked_correlation_id=corr,  # noqa: E731
                                time_range=NS(elapsed_us=lambda: 2.0))
    events = [step, op, dev("fused_adam_kernel", 2), dev("lonely_kernel", 9)]

    class FakeProfile:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ev, top = profiled_kernels(lambda: None, with_ops=True)
    assert ev == [("fused_adam_kernel", 2.0, ("aten::_fused_adamw_", "Optimizer.step#AdamW.step")),
                  ("lonely_kernel", 2.0, ())]
    ev, _ = profiled_kernels(lambda: None)
    assert ev == [("fused_adam_kernel", 2.0), ("lonely_kernel", 2.0)]


def test_generate_inductor_options_parse_and_refuse():
    from benchmarks.generate import parse_inductor_options

    assert parse_inductor_options(["max_autotune=True", "coordinate_descent_tuning=False",
                                   "max_autotune_gemm_backends=TRITON"]) == {
        "max_autotune": True, "coordinate_descent_tuning": False, "max_autotune_gemm_backends": "TRITON"}
    assert parse_inductor_options(['pre_grad_fusion_options={"batch_linear_lhs": {"min_fuse_set_size": 2}}']) == {
        "pre_grad_fusion_options": {"batch_linear_lhs": {"min_fuse_set_size": 2}}}
    for bad in ("max_autotune", "no_such_option=1", "pre_grad_fusion_options={bad json"):
        with pytest.raises(SystemExit, match="--inductor"):
            parse_inductor_options([bad])
