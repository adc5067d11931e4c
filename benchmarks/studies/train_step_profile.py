"""Where an optimize(bf16) train step spends its time: torch.profiler self CPU time per op.

``python -m benchmarks.studies.train_step_profile [--models bert_base vit_b16] [--variant optimize_bf16]
[--threads 2] [--steps 2] [--top 25]``

Builds the model and variant exactly as bench_train_step does (benchmarks/common/train_models.py and
train_variants.py), runs warm-up steps, then profiles ``--steps`` steps and prints, per op, the self CPU time per step
(ms), its share of the step and the calls per step. It backs docs/benchmarks.md, "Where the bf16 transformer step
goes".
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common.train_harness import _build, batches
from benchmarks.common.train_models import MODELS


def profile_model(name: str, variant: str, steps: int, top: int, shapes: tuple[str, ...] = ()) -> None:
    step, dtype, _ = _build(name, variant)
    data = batches(MODELS[name], dtype)
    for i in range(3):
        step(*data[i % len(data)])
    t0 = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU], record_shapes=bool(shapes)) as prof:
        for i in range(steps):
            step(*data[i % len(data)])
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / steps / 1e3
    print(f"\n### {name} / {variant}: {wall:.0f} ms per step unprofiled, {total:.0f} ms self time profiled\n")
    print("| op | ms per step | share | calls per step |")
    print("| --- | ---: | ---: | ---: |")
    for e in rows[:top]:
        ms = e.self_cpu_time_total / steps / 1e3
        print(f"| `{e.key}` | {ms:.1f} | {100 * ms / total:.1f}% | {e.count / steps:.0f} |")
    if shapes:  # the named ops split by input shapes
        by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in shapes]
        print("\n| op | input shapes | ms per step | calls per step |\n| --- | --- | ---: | ---: |")
        for e in sorted(by_shape, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
            ms = e.self_cpu_time_total / steps / 1e3
            print(f"| `{e.key}` | {e.input_shapes} | {ms:.1f} | {e.count / steps:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bert_base", "vit_b16"], choices=sorted(MODELS))
    parser.add_argument("--variant", default="optimize_bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--shapes", nargs="*", default=[], help="ops to split by input shapes (e.g. aten::copy_)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models:
        profile_model(name, args.variant, args.steps, args.top, tuple(args.shapes))


if __name__ == "__main__":
    main()
