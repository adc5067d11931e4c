"""Depthwise Conv2d forward + backward: bf16 on the CPU's bf16 kernels against the compute policy's fp32 path.

``python -m benchmarks.studies.depthwise_bf16 [--json PATH] [--threads N] [--batch B]``

Why: under the native policy ipex_train computes some depthwise convs in fp32
(:func:`ipex_train.compute_policy.slow_bf16_depthwise`). This measures the evidence for that rule on the machine at
hand: per kernel size, stride, channels and spatial size, the median time of one forward + backward (grads of input
and weight) of a channels-last bf16 conv, run natively and through the policy's fp32 Function (bf16 in, fp32 math,
bf16 out), the two alternated call by call in one process. A ratio above 1 means bf16 is slower than the fp32 path.
The JSON has one row per shape and, per (kernel, stride), the median ratio and whether the rule picks it. It backs
docs/benchmarks.md, "Depthwise convolutions in bf16".
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import report
from benchmarks.common.timing import interleaved
from ipex_train.compute_policy import slow_bf16_depthwise
from ipex_train.compute_policy._functions import _Conv

SHAPES = [(k, s, c, h) for k, s, c, h in itertools.product((3, 5, 7), (1, 2), (32, 96, 240, 672), (4, 8, 16, 32))
          if c * h * h <= 96 * 32 * 32]  # the spatial sizes of EfficientNet/MobileNet/ConvNeXt blocks at 64-128 px


def _time_pair(k: int, s: int, c: int, h: int, batch: int, repeats: int) -> tuple[float, float]:
    x = torch.randn(batch, c, h, h).to(torch.bfloat16, memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(c, 1, k, k, dtype=torch.bfloat16, requires_grad=True)
    args = ([s, s], [k // 2, k // 2], [1, 1], False, [0, 0], c)
    grad = torch.randn_like(F.conv2d(x, w, None, s, k // 2, 1, c))

    def native():
        torch.autograd.grad(F.conv2d(x, w, None, s, k // 2, 1, c), (x, w), grad)

    def fp32_path():
        torch.autograd.grad(_Conv.apply(x, w, None, *args, torch.bfloat16), (x, w), grad)

    # Two warm-up rounds: oneDNN creates its primitives on the first calls.
    median = interleaved({"native": native, "fp32": fp32_path}, repeats, warmup=2).median()
    return median["native"], median["fp32"]


def main(argv: list[str] | None = None) -> dict:
    """Run the grid, print a table and return (and optionally write) the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'k':>2} {'s':>2} {'C':>4} {'H':>3} {'bf16 ms':>8} {'fp32 ms':>8} {'bf16/fp32':>9}")
    for k, s, c, h in SHAPES:
        bf16, fp32 = _time_pair(k, s, c, h, args.batch, args.repeats)
        rows.append({"kernel": k, "stride": s, "channels": c, "size": h, "bf16_ms": bf16 * 1e3,
                     "fp32_path_ms": fp32 * 1e3, "ratio": bf16 / fp32})
        print(f"{k:>2} {s:>2} {c:>4} {h:>3} {bf16 * 1e3:8.3f} {fp32 * 1e3:8.3f} {bf16 / fp32:9.2f}", flush=True)
    groups = []
    for k, s in itertools.product((3, 5, 7), (1, 2)):
        ratios = [r["ratio"] for r in rows if (r["kernel"], r["stride"]) == (k, s)]
        picked = slow_bf16_depthwise(torch.nn.Conv2d(8, 8, k, s, groups=8))
        groups.append({"kernel": k, "stride": s, "median_ratio": statistics.median(ratios), "fp32_by_rule": picked})
        print(f"k{k} s{s}: bf16 / fp32 path median {statistics.median(ratios):.2f}; rule: "
              f"{'fp32' if picked else 'bf16'}")
    return report.write(args.json, {"meta": {"batch": args.batch}, "rows": rows, "groups": groups}, indent=1)


if __name__ == "__main__":
    main()
