"""One variant of bench_train_step from this checkout and from another (the code before a change), against fp32, in
one run: ``python -m benchmarks.standalone.train_step_before_after --baseline PATH [--variant NAME] [--models ...]
[--steps N] [--threads N] [--json out.json]``.

PATH is a checkout of the baseline (e.g. ``git worktree add /tmp/base main``, with its C++ extension built) holding
this checkout's ``benchmarks/`` (copy it there, so that both sides train the same models the same way). Per model
three workers run their steps round-robin: fp32 and the variant from here, the variant from PATH; each ratio is a
median within the run (wall time, and process CPU time, which at ``--threads 1`` on a shared machine counts a
step's own work rather than the time other processes held the core).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from ..common import report
from ..common.train_harness import REPO_ROOT, Worker, run_workers
from ..common.train_models import MODELS, QUICK_MODELS


def compare(model: str, variant: str, baseline: Path, steps: int, threads: int | None) -> dict:
    """fp32, ``variant`` here and ``variant`` at ``baseline``, interleaved; ratios against fp32."""
    workers = {label: Worker(model, name, threads, root=root)
               for label, name, root in (("fp32", "fp32", REPO_ROOT), ("after", variant, REPO_ROOT),
                                         ("before", variant, baseline))}
    res, _ = run_workers(workers, dict.fromkeys(workers, steps), dict.fromkeys(workers, 1), None,
                         dict.fromkeys(workers, 1))
    fp32 = res["fp32"]
    row = {"model": model, "variant": variant, "steps": steps, "threads": threads,
           "fp32_step_s": fp32["median_step_s"], "fp32_cpu_s": fp32["median_cpu_s"]}
    for label in ("after", "before"):
        r = res[label]
        row[label] = {"step_s": r["median_step_s"], "x_fp32": r["median_step_s"] / fp32["median_step_s"],
                      "cpu_s": r["median_cpu_s"], "cpu_x_fp32": r["median_cpu_s"] / fp32["median_cpu_s"],
                      "final_loss": r["losses"][-1]}
    row["fp32_final_loss"] = fp32["losses"][-1]
    return row


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--variant", default="optimize_bf16_emulated")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(QUICK_MODELS))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per worker (after one warm-up step)")
    parser.add_argument("--threads", type=int, help="torch threads per worker (default: torch's default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not (args.baseline / "benchmarks" / "suite" / "bench_train_step.py").exists():
        parser.error(f"--baseline {args.baseline} holds no benchmarks/suite/bench_train_step.py (copy this checkout's "
                     "benchmarks/ there)")
    started = time.perf_counter()
    rows = []
    for model in args.models:
        row = compare(model, args.variant, args.baseline.resolve(), args.steps, args.threads)
        rows.append(row)
        a, b = row["after"], row["before"]
        print(f"{model}: fp32 {row['fp32_step_s'] * 1e3:.0f} ms; {args.variant} x fp32: after {a['x_fp32']:.2f} "
              f"(cpu {a['cpu_x_fp32']:.2f}), before {b['x_fp32']:.2f} (cpu {b['cpu_x_fp32']:.2f}); final loss "
              f"fp32 {row['fp32_final_loss']:.4f}, after {a['final_loss']:.4f}, before {b['final_loss']:.4f}",
              flush=True)
    load = os.getloadavg()
    print(f"total {time.perf_counter() - started:.0f} s; load average at end {load[0]:.1f}")
    report.write(args.json, {"baseline": str(args.baseline), "load_average_at_end": load, "results": rows})


if __name__ == "__main__":
    main()
