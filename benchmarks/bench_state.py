"""Reduced-byte optimizer state rows of ``bench_step``: split-bf16 AdamW with bf16 (stochastic rounding) and int8
state, beside torch's fused fp32 AdamW, the bandwidth roof and the low-bit peers that install and run on a CPU
(torchao AdamW8bit, bitsandbytes AdamW8bit, torch-optimi AdamW with bf16 weights and Kahan summation), all timed
step by step in one loop. Called by :func:`benchmarks.bench_step.run` (``--state-rows``, on by default), or alone::

    python -m benchmarks.bench_state [--sizes 10M,50M] [--repeats 15] [--compute-elements 256K] [--no-peers]
                                     [--json PATH]

which first times the same steps on one thread over a group small enough to stay in cache (the compute each
format costs per element, without the memory traffic: with T threads no step can be faster than that / T), then
the rows.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from ipex_train.optim import state_formats

from . import bench_step as bs

FORMATS = {"bf16_state": torch.bfloat16, "int8_state": "int8"}
TARGET = {"bf16_state": 0.70, "int8_state": 0.60}  # x torch fused fp32 AdamW's step time


def bytes_per_element(fmt: str) -> float:
    """Minimum bytes per element of a split-bf16 AdamW step with state ``fmt``: the split value read and written
    (4 + 4), the bf16 grad (2), two moments read and written (2 bytes each in bf16; 1 byte plus a 4-byte scale per
    256 elements in int8)."""
    state = 2.0 if fmt == "bf16_state" else 1.0 + 4.0 / state_formats.Q8_BLOCK
    return 4 + 4 + 2 + 2 * 2 * state


def _peer_params(n: int, tensors: int, dtype=torch.float32) -> list[torch.Tensor]:
    params = []
    for k in bs._sizes(n, tensors):
        p = torch.nn.Parameter(torch.empty(k).normal_().to(dtype))
        p.grad = torch.empty(k).normal_(std=1e-2).to(dtype)
        params.append(p)
    return params


def _peers() -> dict[str, object]:
    """name -> factory(params) for each peer that imports, or the reason it does not."""
    out: dict[str, object] = {}
    hyper = bs.HYPER["adamw"]
    try:
        from torchao.optim import AdamW8bit

        out["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps, **hyper)
    except Exception as e:  # noqa: BLE001 - any import failure is the row's message
        out["torchao AdamW8bit"] = f"does not import: {type(e).__name__}: {str(e)[:120]}"
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, **hyper)
    except Exception as e:  # noqa: BLE001
        out["bitsandbytes AdamW8bit"] = f"does not import: {type(e).__name__}: {str(e)[:120]}"
    try:
        import optimi

        out["torch-optimi AdamW bf16+Kahan"] = lambda ps: optimi.AdamW(ps, kahan_sum=True, **hyper)
    except Exception as e:  # noqa: BLE001
        out["torch-optimi AdamW bf16+Kahan"] = f"does not import: {type(e).__name__}: {str(e)[:120]}"
    return out


class _PeerStep:
    def __init__(self, name: str, make, n: int, tensors: int):
        dtype = torch.bfloat16 if "optimi" in name else torch.float32
        self.params = _peer_params(n, tensors, dtype)
        self.opt = make(self.params)

    def __call__(self) -> None:
        self.opt.step()


def bench_size(n: int, args) -> list[dict]:
    """The state rows at size ``n``: every step of every contestant alternates with the others and the roof."""
    roof_a, roof_b = torch.ones(n), torch.ones(n)
    steps: dict[str, object] = {"torch": bs.TorchStep("adamw", n, args.tensors)}
    failed: dict[str, str] = {}
    for fmt, dtype in FORMATS.items():
        ours = bs.OurStep("adamw", "split_bf16", n, args.tensors)
        ours.group[state_formats.GROUP_KEY] = dtype
        steps[fmt] = ours
    for name, make in (_peers() if getattr(args, "peers", True) else {}).items():
        if isinstance(make, str):
            failed[name] = make
            continue
        try:
            step = _PeerStep(name, make, n, args.tensors)
            step()
            steps[name] = step
        except Exception as e:  # noqa: BLE001 - a peer that does not run on this CPU gets a row saying so
            failed[name] = f"does not run on CPU: {type(e).__name__}: {str(e)[:120]}"
    times: dict[str, list[int]] = {k: [] for k in [*steps, "roof"]}
    for i in range(args.warmup + args.repeats):
        for name, step in steps.items():
            ns = bs._elapsed_ns(step)
            if i >= args.warmup:
                times[name].append(ns)
        ns = bs._elapsed_ns(lambda: roof_a.add_(roof_b))
        if i >= args.warmup:
            times["roof"].append(ns)
    torch_ns = statistics.median(times["torch"])
    roof_gbps = bs.ROOF_BYTES_PER_ELEMENT * n / statistics.median(times["roof"])
    rows = []
    for name in steps:
        if name == "torch":
            continue
        ns = statistics.median(times[name])
        row = {"optimizer": "adamw", "contestant": name, "size": n, "ns_per_param": ns / n,
               "baseline_ns_per_param": torch_ns / n, "ratio_to_baseline": ns / torch_ns, "roof_gbps": roof_gbps}
        if name in FORMATS:
            row["bytes_per_element"] = bytes_per_element(name)
            row["gbps"] = row["bytes_per_element"] * n / ns
            row["pct_roof"] = 100 * row["gbps"] / roof_gbps
        rows.append(row)
        print(_line(row), flush=True)
    for name, why in failed.items():
        rows.append({"optimizer": "adamw", "contestant": name, "size": n, "error": why})
        print(_line(rows[-1]), flush=True)
    del steps
    gc.collect()
    return rows


def _line(r: dict) -> str:
    size = bs._fmt_size(r["size"])
    if "error" in r:
        return f"  {r['contestant']:<30} {size:>5}  {r['error']}"
    roof = f" {r['bytes_per_element']:5.2f} B/elem {r['gbps']:6.2f} GB/s {r['pct_roof']:5.1f}% roof" \
        if "pct_roof" in r else ""
    return (f"  {r['contestant']:<30} {size:>5} {r['ns_per_param']:7.3f} ns/param, {r['ratio_to_baseline']:5.2f}x "
            f"torch fused fp32 AdamW ({r['baseline_ns_per_param']:.3f}){roof}")


def targets(rows: list[dict]) -> list[dict]:
    """PASS/FAIL of our state rows: the step-time ratio to torch's fused fp32 AdamW, and >= 90% of the roof."""
    out = []
    for r in rows:
        if r.get("contestant") not in TARGET:
            continue
        where = f"adamw/split_bf16 {r['contestant']} @ {bs._fmt_size(r['size'])}"
        out.append({"target": f"{where}: <= {TARGET[r['contestant']]}x torch fused fp32 AdamW",
                    "value": r["ratio_to_baseline"], "pass": r["ratio_to_baseline"] <= TARGET[r["contestant"]]})
        out.append({"target": f"{where}: >= {bs.TARGET_ROOF:.0%} of roof", "value": r["pct_roof"] / 100,
                    "pass": r["pct_roof"] >= 100 * bs.TARGET_ROOF})
    return out


def compute_rows(n: int, repeats: int) -> list[dict]:
    """Split-bf16 AdamW over ``n`` parameters (one tensor, in cache) with fp32, bf16 and int8 state on one thread,
    interleaved; the fastest of ``repeats`` steps each, in ns/param (includes the op's fixed call cost)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {"fp32_state": bs.OurStep("adamw", "split_bf16", n, 1)}
        for fmt, dtype in FORMATS.items():
            steps[fmt] = bs.OurStep("adamw", "split_bf16", n, 1)
            steps[fmt].group[state_formats.GROUP_KEY] = dtype
        best = {k: float("inf") for k in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                t0 = time.perf_counter_ns()
                step()
                best[name] = min(best[name], time.perf_counter_ns() - t0)
    finally:
        torch.set_num_threads(threads)
    rows = [{"contestant": k, "size": n, "threads": 1, "ns_per_param": v / n} for k, v in best.items()]
    for r in rows:
        print(f"  {r['contestant']:<12} {bs._fmt_size(n):>5}  1 thread, in cache: {r['ns_per_param']:.3f} ns/param",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point: the in-cache compute rows, then the state rows at each size, and the targets."""
    p = argparse.ArgumentParser(description="reduced-byte optimizer state rows (split-bf16 AdamW)")
    p.add_argument("--sizes", default="10M,50M", help="comma-separated parameter counts")
    p.add_argument("--repeats", type=int, default=15, help="timed steps per contestant and size")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--tensors", type=int, default=4, help="parameters are split over this many tensors")
    p.add_argument("--compute-elements", type=bs.parse_size, default=bs.parse_size("256K"),
                   help="parameters of the in-cache, one-thread compute rows (0: skip them)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also time torchao's, bitsandbytes' and torch-optimi's optimizers where they run")
    p.add_argument("--json", type=Path, help="write the machine description and all rows to this file")
    args = p.parse_args(argv)
    info = bs.machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "isa"))
    compute = compute_rows(args.compute_elements, 200) if args.compute_elements else []
    rows = []
    for n in (bs.parse_size(s) for s in args.sizes.split(",")):
        rows += bench_size(n, args)
    checks = targets(rows)
    print("targets:")
    for t in checks:
        print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}  (measured {t['value']:.2f})")
    result = {"machine": info, "compute_rows": compute, "state_rows": rows, "targets": checks}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
