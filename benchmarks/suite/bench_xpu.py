"""Step time of the fused optimizers on the SYCL CPU device (kernels_xpu, SYCL-RTC kernels run by Intel's OpenCL
CPU driver) against kernels_cpu and torch's fused Adam, in the same process on the same host CPU.

    python -m benchmarks.suite.bench_xpu [--quick] [--json PATH]

All three run on the same cores: the SYCL CPU device is a SYCL runtime on the host CPU, not an accelerator. Times
are per optimizer step (median over timed steps, after warm-up steps that also compile the kernels). The split-bf16
AdamW rows, with fp32, bf16 and int8 optimizer state on both devices, are timed interleaved step by step.
"""
from __future__ import annotations

import argparse
import collections
import functools

import torch

import ipex_train
from ipex_train.optim import fused, registry

from ..common import report
from ..common.timing import interleaved


def _time_interleaved(fns: dict, warmup: int, iters: int) -> dict[str, float]:
    """Median ms per call of each zero-argument callable, timed in interleaved rounds."""
    return {k: v * 1e3 for k, v in interleaved(fns, iters, warmup=warmup).median().items()}


def _adam_group(decoupled: bool) -> dict:
    return dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
                decoupled_weight_decay=decoupled)


def run(args) -> dict:
    """Run the benchmark; ``args`` has ``quick`` (bool). Returns a dict of step times in ms and the setup."""
    import ipex_train.xpu as sx

    if not sx.is_available():
        raise SystemExit(f"bench_xpu: no SYCL device: {sx.unavailable_reason()}")
    q = sx.default_queue()
    n = 1_000_000 if args.quick else 10_000_000
    warmup, iters = (2, 5) if args.quick else (3, 15)
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    results: dict[str, float] = {}

    # fp32 Adam: kernels_xpu on the SYCL CPU device, kernels_cpu, torch fused.
    group = _adam_group(decoupled=False)
    p_dev, g_dev, st_dev = sx.to_usm(w, q), sx.to_usm(g, q), collections.defaultdict(dict)
    p_cpu, st_cpu = w.clone(), collections.defaultdict(dict)
    p_t = torch.nn.Parameter(w.clone())
    p_t.grad = g.clone()
    opt = torch.optim.Adam([p_t], lr=1e-3, weight_decay=0.01, fused=True)
    results.update(_time_interleaved({
        "adam_fp32_sycl_cpu_device_ms": lambda: sx.fused_step("adam", group, st_dev, [p_dev], [None], [g_dev], q),
        "adam_fp32_kernels_cpu_ms": lambda: fused.fused_step(registry.get("adam"), group, st_cpu, [p_cpu], [None],
                                                             [g]),
        "adam_fp32_torch_fused_ms": opt.step}, warmup, iters))

    # split-bf16 AdamW: bf16 top + int16 residual, bf16 grad; fp32, bf16 (stochastic rounding) or int8 state.
    top, res = ipex_train.base.ops.split_bf16(w)
    gb = g.bfloat16()
    steps = {}
    for state_name, state_dtype in (("", None), ("_bf16_state", torch.bfloat16), ("_int8_state", "int8")):
        group = dict(_adam_group(decoupled=True), state_dtype=state_dtype)
        top_dev, res_dev, gb_dev = sx.to_usm(top, q), sx.to_usm(res, q), sx.to_usm(gb, q)
        steps[f"adamw_split_bf16{state_name}_sycl_cpu_device_ms"] = functools.partial(
            sx.fused_step, "adam", dict(group), collections.defaultdict(dict), [top_dev], [res_dev], [gb_dev], q)
        steps[f"adamw_split_bf16{state_name}_kernels_cpu_ms"] = functools.partial(
            fused.fused_step, registry.get("adam"), dict(group), collections.defaultdict(dict), [top.clone()],
            [res.clone()], [gb])
    results.update(_time_interleaved(steps, warmup, iters))

    dev = q.sycl_device
    return {
        "elements": n,
        "timed_steps": iters,
        "sycl_device": f"{dev.name} ({dev.backend.name}:{dev.device_type.name}, SYCL CPU device)",
        "torch_threads": torch.get_num_threads(),
        "kernel_variant": ipex_train.base.ops.kernel_variant(),
        "torch": torch.__version__,
        "results_ms": results,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M elements and fewer steps (smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    args = parser.parse_args(argv)
    out = run(args)
    for key, ms in out["results_ms"].items():
        print(f"{key:48s} {ms:9.2f} ms")
    print(f"({out['elements']:,} elements, {out['sycl_device']}, torch threads {out['torch_threads']}, "
          f"kernels_cpu variant {out['kernel_variant']})")
    report.write(args.json, out)


if __name__ == "__main__":
    main()
