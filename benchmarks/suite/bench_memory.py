"""Memory of an AdamW training step at ~100M parameters: peak RSS per variant, bytes per parameter, and the step
time of the step inside backward against the normal step.

Run from the repository root::

    python -m benchmarks.suite.bench_memory [--quick] [--json out.json] [--layers N] [--threads N]

The model is a stack of ``--layers`` Linear(2048, 2048) + ReLU blocks (24 layers: 100.7M parameters) fed a batch
of 16 rows, so parameters, grads and optimizer state dominate and activations are small (~3 MB). Each variant of
VARIANTS runs in a fresh subprocess with glibc's mmap threshold pinned (bench_train_step._pin_mmap_threshold: freed
tensors go back to the OS, so RSS follows the live tensors): after the model and optimizer are set up the process's
peak RSS is reset (/proc/self/clear_refs), then STEPS steps run (the first creates the optimizer state). Bytes per
parameter = (peak RSS during the steps - baseline RSS) / parameters, the baseline taken after two steps of a tiny
model of the same variant (so torch's code pages and thread pools are in it); beside it,
ipex_train.memory_report()'s accounting of the same configuration (tensors only).

Step time: every available variant in one process, steps interleaved round-robin (A, B, C, A, B, C, ...), median
per variant; the ratio of interest is optimize(bf16, step_in_backward=True) against optimize(bf16).

Adding a variant (a reduced optimizer-state format, say) is one VARIANTS entry: its optimize() keyword arguments.
An entry whose options this build's optimize() does not take is reported as unavailable and skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import ipex_train

from ..common import report
from ..common.memory import pin_mmap_threshold, reset_peak, status_kb
from ..common.targets import Target, print_targets
from ..common.timing import interleaved

REPO_ROOT = Path(__file__).resolve().parents[2]
WIDTH, BATCH, STEPS = 2048, 16, 3
BASELINE = "torch_fp32"


@dataclass(frozen=True)
class Variant:
    """One configuration: ``options`` for ipex_train.optimize(inplace=True), or None for plain torch with its fused
    fp32 AdamW."""

    label: str
    options: dict | None = None


BF16 = torch.bfloat16
VARIANTS: dict[str, Variant] = {
    BASELINE: Variant("torch fused fp32 AdamW"),
    "optimize_bf16": Variant("optimize(bf16)", {"dtype": BF16}),
    "optimize_bf16_bf16state": Variant("optimize(bf16, bf16 state)", {"dtype": BF16, "optimizer_state_dtype": BF16}),
    "optimize_bf16_int8state": Variant("optimize(bf16, 8-bit state)", {"dtype": BF16, "optimizer_state_dtype": "int8"}),
    "optimize_bf16_release": Variant("optimize(bf16, step_in_backward)", {"dtype": BF16, "step_in_backward": True}),
    "optimize_bf16_bf16state_release": Variant(
        "optimize(bf16, bf16 state, step_in_backward)",
        {"dtype": BF16, "optimizer_state_dtype": BF16, "step_in_backward": True}),
    "optimize_bf16_int8state_release": Variant(
        "optimize(bf16, 8-bit state, step_in_backward)",
        {"dtype": BF16, "optimizer_state_dtype": "int8", "step_in_backward": True}),
}
TARGET_VARIANT, TARGET_RATIO = "optimize_bf16_int8state_release", 0.5  # the memory target: half of torch's fp32 AdamW


def available(name: str) -> bool:
    """Whether this build's optimize() takes the options of variant ``name``."""
    options = VARIANTS[name].options or {}
    return set(options) <= set(ipex_train.OptimizeConfig.__dataclass_fields__)


def build(name: str, layers: int, width: int = WIDTH):
    """(model, optimizer, step) of variant ``name``; ``step()`` runs one training step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))
    if VARIANTS[name].options is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        model, optimizer = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                               inplace=True, **VARIANTS[name].options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, width, generator=g)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    return model, optimizer, step


def memory_worker(name: str, layers: int) -> dict:
    """One variant's memory in this (fresh) process; see the module docstring."""
    pinned = pin_mmap_threshold()
    # A tiny model of the same variant first: the code pages and thread pools a training step touches count in the
    # RSS once loaded, and belong to the baseline, not to the parameters.
    for _ in range(2):
        build(name, 1, 64)[2]()
    base_kb = status_kb("VmRSS")
    model, optimizer, step = build(name, layers)
    params = sum(p.numel() for p in model.parameters())
    reset = reset_peak()
    for _ in range(STEPS):
        step()
    peak_kb = status_kb("VmHWM")
    accounted = ipex_train.memory_report(model, optimizer)
    return {"variant": name, "params": params, "base_rss_mb": base_kb / 1024, "peak_rss_mb": peak_kb / 1024,
            "bytes_per_param": (peak_kb - base_kb) * 1024 / params, "mmap_threshold_pinned": pinned,
            "peak_reset_after_setup": reset, "accounted": accounted.to_dict()}


def time_worker(names: list[str], layers: int, steps: int) -> dict:
    """Median and fastest step time of each variant, their steps interleaved in this one process (on a shared
    machine the fastest is the least disturbed by other processes' load)."""
    built = {n: build(n, layers)[2] for n in names}
    timed = interleaved(built, steps, warmup=1)  # the warm-up creates the optimizer state
    return {n: {"median_step_s": timed.summary(n).median, "min_step_s": timed.summary(n).best,
                "spread": timed.summary(n).spread, "step_times_s": list(timed.per_round[n])} for n in names}


def _subprocess(args: list[str], threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.suite.bench_memory", *args]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 timed steps per variant (default 20)")
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--layers", type=int, default=24, help="Linear(2048, 2048) layers (24: 100.7M params)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's default)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--worker", choices=["memory", "time"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.worker == "memory":
        print(json.dumps(memory_worker(args.variants[0], args.layers)))
        return
    if args.worker == "time":
        print(json.dumps(time_worker(args.variants, args.layers, 5 if args.quick else 20)))
        return
    if BASELINE not in args.variants:
        parser.error(f"--variants must include {BASELINE}, the reference for ratios")

    started = time.perf_counter()
    names = [n for n in args.variants if available(n)]
    skipped = [n for n in args.variants if n not in names]
    for n in skipped:
        missing = set(VARIANTS[n].options) - set(ipex_train.OptimizeConfig.__dataclass_fields__)
        print(f"{n}: skipped, this build's optimize() does not take {', '.join(sorted(missing))}")
    common = ["--layers", str(args.layers)] + (["--quick"] if args.quick else [])
    results = [_subprocess(["--worker", "memory", "--variants", n] + common, args.threads) for n in names]
    timing = _subprocess(["--worker", "time", "--variants", *names] + common, args.threads)
    base = results[0]["bytes_per_param"]
    base_time = timing[BASELINE]["median_step_s"]
    print(f"{'variant':<34} {'peak MB':>8} {'B/param':>8} {'x torch':>8} {'accounted':>10} {'step s':>7} "
          f"{'x torch':>8}")
    for r in results:
        r.update(ratio_vs_torch_fp32=r["bytes_per_param"] / base, label=VARIANTS[r["variant"]].label,
                 options={k: str(v) for k, v in VARIANTS[r["variant"]].options.items()}
                 if VARIANTS[r["variant"]].options else None, **timing[r["variant"]])
        r["step_time_vs_torch_fp32"] = r["median_step_s"] / base_time
        print(f"{r['label']:<34} {r['peak_rss_mb']:>8.0f} {r['bytes_per_param']:>8.2f} "
              f"{r['ratio_vs_torch_fp32']:>8.3f} {r['accounted']['bytes_per_parameter']['total']:>10.2f} "
              f"{r['median_step_s']:>7.3f} {r['step_time_vs_torch_fp32']:>8.3f}")
    by_name = {r["variant"]: r for r in results}
    if "optimize_bf16_release" in by_name and "optimize_bf16" in by_name:
        release, normal = by_name["optimize_bf16_release"], by_name["optimize_bf16"]
        print(f"step inside backward: step time {release['median_step_s'] / normal['median_step_s']:.3f}x the "
              f"normal optimize(bf16) step (median; fastest steps {release['min_step_s'] / normal['min_step_s']:.3f}x;"
              " same process, interleaved)")
    targets = []
    if TARGET_VARIANT in by_name:
        value = by_name[TARGET_VARIANT]["ratio_vs_torch_fp32"]
        text = (f"{VARIANTS[TARGET_VARIANT].label} bytes/param <= {TARGET_RATIO}x torch fp32 (peak RSS of a "
                "100M-param AdamW step)")
        targets.append(Target(text, TARGET_RATIO, text=text).judge(value))
    print_targets(targets)
    load = os.getloadavg()
    print(f"total {time.perf_counter() - started:.0f} s; load average at end {load[0]:.1f}")
    meta = {"layers": args.layers, "batch": BATCH, "steps": STEPS, "quick": args.quick, "skipped": skipped,
            "load_average_at_end": load}
    report.write(args.json, {"meta": meta, "results": results, "targets": targets})


if __name__ == "__main__":
    main()
