"""Smoke tests of the recipes and the benchmark suite: each runs for a couple of steps at tiny sizes, in a subprocess,
exactly as a user starts it, and its JSON and PNG outputs are checked."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 2
BOTH = ["ipex_train bfloat16", "torch fp32"]


def _run(cmd: list[str], timeout: float = 240) -> str:
    """Run ``python cmd...`` from the repository root; fail with its output unless it exits 0."""
    # One thread each: the runs are tiny, and the machine may be shared with other jobs.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def _check_png(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, image.shape


def _check_losses(losses: list[float]) -> None:
    assert len(losses) == STEPS
    assert all(math.isfinite(v) for v in losses), losses


RECIPES = [
    ("digits", ["--image-size", "8"], BOTH),
    ("resnet50", ["--image-size", "32", "--test-size", "8"], BOTH),
    # Non-default flags: another optimizer, contiguous layout, fp32 through ipex_train, no comparison run.
    ("resnet50", ["--image-size", "32", "--test-size", "8", "--optimizer", "lars", "--no-channels-last",
                  "--dtype", "float32", "--no-compare-fp32"], ["ipex_train float32"]),
    ("transformer_lamb", ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--test-size", "8"],
     BOTH),
    # Reduced-byte optimizer state (the models' weight matrices have >= 4096 elements, so it is used).
    ("digits", ["--image-size", "8", "--state-dtype", "int8", "--no-compare-fp32"],
     ["ipex_train bfloat16, int8 state"]),
    ("transformer_lamb", ["--d-model", "64", "--layers", "1", "--heads", "2", "--seq-len", "16", "--test-size", "8",
                          "--state-dtype", "bfloat16", "--no-compare-fp32"], ["ipex_train bfloat16, bfloat16 state"]),
]


@pytest.mark.parametrize("recipe,flags,runs", RECIPES, ids=[f"{r[0]}-{len(r[2])}run" for r in RECIPES])
def test_recipe(tmp_path, recipe, flags, runs):
    metrics, plot = tmp_path / "metrics.json", tmp_path / "plot.png"
    out = _run(["-m", f"recipes.{recipe}", "--steps", str(STEPS), "--batch-size", "4", "--no-progress",
                "--json", str(metrics), "--plot", str(plot), *flags])
    assert "samples/s" in out  # the report table was printed
    data = json.loads(metrics.read_text())
    assert data["recipe"] == recipe
    assert data["machine"]["torch"]
    assert [r["name"] for r in data["runs"]] == runs
    for r in data["runs"]:
        assert r["steps"] == STEPS and r["batch_size"] == 4
        _check_losses(r["losses"])
        assert math.isfinite(r["final_loss"])
        assert len(r["step_times_s"]) == STEPS and all(t > 0 for t in r["step_times_s"])
        assert r["median_step_ms"] > 0 and r["samples_per_s"] > 0
        # Each run is its own process, which at least holds torch.
        assert 50 < r["peak_rss_mib"] < 16 * 1024
        assert 0.0 <= r["accuracy"] <= 1.0
    _check_png(plot)


def test_accelerate_recipe(tmp_path):
    pytest.importorskip("accelerate")
    metrics = tmp_path / "metrics.json"
    _run(["recipes/accelerate_train.py", "--steps", str(STEPS), "--batch-size", "4", "--grad-accum", "1",
          "--no-progress", "--json", str(metrics)])
    data = json.loads(metrics.read_text())
    assert data["plugin"] is not None and data["dtype"] == "torch.bfloat16"
    assert data["steps"] == STEPS and data["num_processes"] == 1
    _check_losses(data["losses"])
    assert data["median_step_ms"] > 0 and data["samples_per_s"] > 0
    assert 0.0 <= data["test_accuracy"] <= 1.0


def test_benchmark_suite_smoke(tmp_path):
    out = tmp_path / "bench"
    _run(["-m", "benchmarks", "--only", "step", "--smoke", "--out", str(out)], timeout=180)
    report = (out / "report.md").read_text()
    assert "## Targets" in report
    assert "| PASS |" in report or "| FAIL |" in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["extra_args"] == ["--smoke"]
    [step] = summary["benchmarks"]
    assert step["name"] == "step" and step["returncode"] == 0
    assert step["data"]["settings"]["smoke"] and step["data"]["results"]
    # Lamb rows carry the time of lamb_traffic.c (built with the C compiler the package build needs anyway).
    lamb = [r for r in step["data"]["results"] if r["optimizer"] == "lamb"]
    assert lamb and all(r["traffic_floor_ratio"] > 0 for r in lamb)
    assert "Lamb's bytes alone" in report
    # The reduced-byte state rows (benchmarks/suite/bench_state.py) are in the same run: ours timed against torch's
    # fused fp32 AdamW with their targets in the report, and each low-bit peer either timed or saying why it is not.
    state = {r["contestant"]: r for r in step["data"]["state_rows"]}
    assert all(state[c]["ratio_to_baseline"] > 0 and state[c]["pct_roof"] > 0 for c in ("bf16_state", "int8_state"))
    assert {"torchao AdamW8bit", "bitsandbytes AdamW8bit", "torch-optimi AdamW bf16+Kahan"} <= state.keys()
    assert all("ratio_to_baseline" in r or r["error"] for r in state.values())
    assert all(f"split_bf16 {c} @ " in report for c in ("bf16_state", "int8_state"))
    assert "<= 0.6x torch fused fp32 AdamW" in report
    _check_png(out / "step_roofline.png")


@pytest.mark.parametrize("layout", ["fp32", "split_bf16", "bf16_master", "fp16_master"])
def test_lamb_traffic_kernel_moves_what_lamb_moves(layout):
    # bench_step's "Lamb's bytes alone" is a floor only if lamb_traffic.c really reads and writes all that Lamb does:
    # value, grad and both moments of every element, writing the moments and the value (the 16-bit copy too, for the
    # master layouts). Its stand-in arithmetic, m = 0.9 m + g, v = 0.99 v + g, w -= 1e-3 m - 1e-9 v, is recomputed
    # here from the inputs (16-bit grads read as int16 * 1e-6; the split value as (top << 16) | residual).
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.suite import bench_step
    finally:
        sys.path.remove(str(ROOT))
    lib = bench_step.load_traffic_kernel()
    assert lib is not None, "no C compiler: the benchmark's traffic floor cannot be built"
    n = 2 * (1 << 15) + 13  # two full chunks and a partial one, with a vector tail
    traffic = bench_step.LambTraffic(lib, layout, n, 1)
    p, a, g, m, v = traffic.keep
    m.normal_()
    v.uniform_()

    def value(p, a):
        if layout == "fp32":
            return p.clone()
        if layout == "split_bf16":
            bits = (p.view(torch.int16).int() << 16) | (a.int() & 0xFFFF)
            return bits.view(torch.float32)
        return a.clone()

    g32 = g.clone() if layout == "fp32" else g.view(torch.int16).float() * 1e-6
    m1 = m * 0.9 + g32
    v1 = v * 0.99 + g32
    w1 = value(p, a) - 1e-3 * m1 + v1 * 1e-9
    g_before = g.clone()
    traffic()
    tol = dict(rtol=1e-5, atol=1e-7)  # built with -ffast-math: contractions may round differently
    torch.testing.assert_close(m, m1, **tol)
    torch.testing.assert_close(v, v1, **tol)
    torch.testing.assert_close(value(p, a), w1, **tol)
    assert torch.equal(g, g_before)
    if layout in ("bf16_master", "fp16_master"):
        assert torch.equal(p.view(torch.int16), (a.view(torch.int32) >> 16).to(torch.int16))


def test_hf_trainer_recipe(tmp_path):
    pytest.importorskip("transformers")
    metrics = tmp_path / "metrics.json"
    # GPT-2 only: BERT's Trainer checkpoints are tested in test_transformers.py.
    _run(["-m", "recipes.hf_trainer", "--models", "gpt2", "--steps", str(STEPS), "--batch-size", "4", "--width", "16",
          "--no-progress", "--no-compare-fp32", "--out", str(tmp_path), "--json", str(metrics)])
    data = json.loads(metrics.read_text())
    assert data["checks"] == {"gpt2": {"resume_exact": True, "reload_exact": True}}
    [run] = data["runs"]
    assert run["name"] == "gpt2 ipex_train bfloat16"
    _check_losses(run["losses"])
    assert 0.0 <= run["accuracy"] <= 1.0
    _check_png(tmp_path / "hf_trainer.png")


def test_timm_recipe(tmp_path):
    pytest.importorskip("timm")
    metrics = tmp_path / "metrics.json"
    _run(["-m", "recipes.timm_train", "--model", "test_vit", "--optimizer", "lamb", "--steps", str(STEPS),
          "--batch-size", "4", "--no-progress", "--no-compare-fp32", "--out", str(tmp_path), "--json", str(metrics)])
    data = json.loads(metrics.read_text())
    assert data["resume_exact"] and data["reload_exact"]
    [run] = data["runs"]
    assert run["name"] == "ipex_train bfloat16"
    _check_losses(run["losses"])
    _check_png(tmp_path / "timm_train.png")


def test_memory_benchmark_smoke(tmp_path):
    # Every variant of bench_memory runs (a 1-layer model: 4.2M parameters) and its bytes/param is what
    # memory_report accounts for, within the allocator's slack.
    path = tmp_path / "memory.json"
    _run(["-m", "benchmarks.suite.bench_memory", "--quick", "--layers", "1", "--threads", "1", "--json", str(path)],
         timeout=180)
    data = json.loads(path.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    from benchmarks.suite.bench_memory import VARIANTS

    assert rows.keys() == VARIANTS.keys()
    assert all(r["median_step_s"] > 0 and r["bytes_per_param"] > 0 for r in rows.values())
    accounted = {n: r["accounted"]["bytes_per_parameter"]["total"] for n, r in rows.items()}
    assert accounted["optimize_bf16_int8state_release"] < accounted["optimize_bf16_bf16state_release"] < 8.5
    assert [t["target"] for t in data["targets"]]


def test_train_step_benchmark_as_on_an_avx2_cpu(tmp_path):
    # --cpu-isa avx2 measures the targets for CPUs without bf16 units on any x86 CPU: every worker's kernels are
    # limited to AVX2 and optimize(bf16) takes the emulated policy there, as it would on such a CPU.
    path = tmp_path / "train.json"
    _run(["-m", "benchmarks.suite.bench_train_step", "--quick", "--cpu-isa", "avx2", "--models", "resnet_cnn",
          "--variants", "fp32", "optimize_bf16", "--threads", "1", "--json", str(path)], timeout=300)
    data = json.loads(path.read_text())
    assert data["meta"]["cpu_isa_limit"] == "avx2" and data["meta"]["policy_here"]["bf16_compute"] == "emulated"
    results = {r["variant"]: r for r in data["results"]}
    assert results.keys() == {"fp32", "optimize_bf16"}
    assert all(r["cpu_capability"] == "AVX2" for r in results.values())
    assert results["optimize_bf16"]["bf16_compute"] == "emulated"
    assert all(len(r["step_times_s"]) == 6 and "memory" in r for r in results.values())
    assert any(t["target"] == "resnet_cnn optimize_bf16 step time <= 1.0x fp32" for t in data["targets"])


def test_fsdp_recipe_two_processes(tmp_path):
    """torchrun --nproc_per_node 2 -m recipes.fsdp_train: FSDP2 + optimize(bf16), JSON, PNG, a DCP checkpoint."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics, png, ckpt = tmp_path / "metrics.json", tmp_path / "fsdp.png", tmp_path / "ckpt"
    _run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
          str(port), "-m", "recipes.fsdp_train", "--steps", str(STEPS), "--hidden", "32", "--layers", "1",
          "--seq-len", "16", "--batch-size", "2", "--no-progress", "--json", str(metrics), "--plot", str(png),
          "--checkpoint", str(ckpt)], timeout=300)
    data = json.loads(metrics.read_text())
    assert data["world_size"] == 2 and data["runs"][0]["batch_size"] == 4
    _check_losses(data["runs"][0]["losses"])
    _check_png(png)
    assert (ckpt / ".metadata").exists()


def test_fsdp_recipe_two_nodes_on_one_host(tmp_path):
    """The multi-node launch of docs/distributed.md, both "nodes" on this host: two torchrun processes (--nnodes 2,
    --node_rank 0 and 1, one process each) meeting at a c10d rendezvous on 127.0.0.1; ~20 s."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = tmp_path / "metrics.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node",
         "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         # Both "nodes" match the endpoint's host: say which one hosts the rendezvous store instead of letting
         # both try to bind it (the loser retrying as a client), a race that once left node 0 waiting at exit.
         "--rdzv-conf", f"is_host={int(rank == 0)}", "-m", "recipes.fsdp_train",
         "--steps", str(STEPS), "--hidden", "32", "--layers", "1", "--seq-len", "16", "--batch-size", "2",
         "--no-progress", "--json", str(metrics), "--plot", str(tmp_path / "fsdp.png")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-4000:]
    data = json.loads(metrics.read_text())
    assert data["world_size"] == 2 and data["runs"][0]["batch_size"] == 4
    _check_losses(data["runs"][0]["losses"])


@pytest.mark.parametrize("mode,variants", [("lora", "torch,ipex-int8-sib-ckpt"), ("full", "ipex-int8-sib"),
                                           ("trainer", "ipex")])
def test_llm_finetune(tmp_path, mode, variants):
    out = _run(["-m", "recipes.llm_finetune", "--size", "tiny", "--mode", mode, "--variants", variants, "--steps",
                str(STEPS), "--batch-size", "2", "--seq-len", "16", "--corpus-mib", "1", "--no-progress", "--out",
                str(tmp_path)])
    assert "tokens/s" in out
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["recipe"] == "llm_finetune"
    assert [r["name"] for r in data["runs"]] == variants.split(",")
    for r in data["runs"]:
        _check_losses(r["losses"])
        assert r["tokens_per_s"] > 0 and r["peak_rss_added_mib"] >= 0
        assert (r["parameters"] == r["trainable"]) if mode == "full" else (r["parameters"] > r["trainable"] > 0)
        assert r["memory_report"]["trainable"] > 0
        if mode != "full" and r["name"].startswith("ipex"):
            assert r["memory_report"]["frozen"] == pytest.approx(2.0)  # the bf16 base: no residual
    _check_png(tmp_path / "llm_finetune.png")
    assert data["args"]["warmup_steps"] == (10 if mode == "full" else 0)


def test_llm_finetune_warmup():
    from recipes.llm_finetune import warmup

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-4)
    sched, lrs = warmup(opt, 4), []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
