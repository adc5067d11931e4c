"""glibc's malloc thresholds and a training step: page faults, system CPU time and step time of optimize(bf16) steps
with glibc's defaults against ``GLIBC_TUNABLES`` that keep freed memory in the heap.

``python -m benchmarks.studies.malloc_tunables [--json PATH] [--threads N] [--model vit_b16] [--rounds 2] [--steps 6]``

Why: glibc serves large allocations with mmap and gives them back at free (above a threshold it raises only up to
32 MiB), and trims the heap's top; a training step allocates and frees activations and gradients of many MiB, so
every step faults fresh zeroed pages in again. The tunables ``mmap_threshold`` (32 MiB, its largest) and
``trim_threshold`` (4 GiB) keep that memory in the heap. Each round runs the suite's ``--model`` in a fresh process
per setting (alternating), 2 warm-up steps, then ``--steps`` timed ones: median step ms, and per step the process's
minor page faults and user / system CPU ms (getrusage).

Backs docs/environment.md, "Settings of other libraries".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def worker(model_name: str, steps: int) -> None:
    """Run the steps and print one JSON line of the measurements (in the subprocess)."""
    import resource
    import time

    from benchmarks.common.train_harness import _build, batches
    from benchmarks.common.train_models import MODELS

    step, dtype, _ = _build(model_name, "optimize_bf16")
    x, y = batches(MODELS[model_name], dtype)[0]
    for _ in range(2):
        step(x, y)
    r0, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(steps):
        t = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"median_ms": sorted(times)[len(times) // 2] * 1e3,
                      "page_faults": (r1.ru_minflt - r0.ru_minflt) / steps,
                      "user_ms": (r1.ru_utime - r0.ru_utime) / steps * 1e3,
                      "system_ms": (r1.ru_stime - r0.ru_stime) / steps * 1e3}), flush=True)


def _run(model: str, threads: int, steps: int, tunables: bool) -> dict:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = TUNABLES
    cmd = [sys.executable, "-m", "benchmarks.studies.malloc_tunables", "--worker", "--model", model,
           "--threads", str(threads), "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    """Alternate the two settings over the rounds, print one line per run and return (optionally write) the JSON."""
    from benchmarks.common import report

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="vit_b16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.model, args.steps)
        return {}
    runs = []
    for r in range(args.rounds):
        for tunables in (False, True):
            row = {"round": r, "tunables": TUNABLES if tunables else None,
                   **_run(args.model, args.threads, args.steps, tunables)}
            runs.append(row)
            print(f"{'tunables' if tunables else 'defaults':>9}: step {row['median_ms']:7.0f} ms, "
                  f"{row['page_faults']:8.0f} page faults, user {row['user_ms']:6.0f} ms, "
                  f"system {row['system_ms']:5.1f} ms per step", flush=True)
    return report.write(args.json, {"meta": {"threads": args.threads, "model": args.model, "steps": args.steps},
                                    "runs": runs}, indent=1)


if __name__ == "__main__":
    main()
