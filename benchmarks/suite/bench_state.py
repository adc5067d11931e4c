"""Reduced-byte optimizer state rows of ``bench_step``: split-bf16 AdamW with bf16 (stochastic rounding) and int8
state, beside torch's fused fp32 AdamW, the bandwidth roof and the low-bit peers that install and run on a CPU
(torchao AdamW8bit, bitsandbytes AdamW8bit, torch-optimi AdamW with bf16 weights and Kahan summation), all timed
step by step in one loop. Called by :func:`benchmarks.suite.bench_step.run` (``--state-rows``, on by default),
or alone::

    python -m benchmarks.suite.bench_state [--sizes 10M,50M] [--repeats 15] [--compute-elements 256K] [--no-peers]
                                     [--json PATH]

which first times the same steps on one thread over a group small enough to stay in cache (the compute each
format costs per element, without the memory traffic: with T threads no step can be faster than that / T), then
the rows.
"""
from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from ipex_train.optim import state_formats

from ..common import report
from ..common.optim_steps import (
    HYPER,
    ROOF_BYTES_PER_ELEMENT,
    TARGET_ROOF,
    OurStep,
    TorchStep,
    fmt_size,
    parse_size,
    sizes,
)
from ..common.targets import Target, print_targets
from ..common.timing import interleaved

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
    for k in sizes(n, tensors):
        p = torch.nn.Parameter(torch.empty(k).normal_().to(dtype))
        p.grad = torch.empty(k).normal_(std=1e-2).to(dtype)
        params.append(p)
    return params


def _peers() -> dict[str, object]:
    """name -> factory(params) for each peer that imports, or the reason it does not."""
    out: dict[str, object] = {}
    hyper = HYPER["adamw"]
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
    steps: dict[str, object] = {"torch": TorchStep("adamw", n, args.tensors)}
    failed: dict[str, str] = {}
    for fmt, dtype in FORMATS.items():
        ours = OurStep("adamw", "split_bf16", n, args.tensors)
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
    timed = interleaved({**steps, "roof": lambda: roof_a.add_(roof_b)}, args.repeats, warmup=args.warmup)
    med = {name: seconds * 1e9 for name, seconds in timed.median().items()}
    torch_ns = med["torch"]
    roof_gbps = ROOF_BYTES_PER_ELEMENT * n / med["roof"]
    rows = []
    for name in steps:
        if name == "torch":
            continue
        ns = med[name]
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
    size = fmt_size(r["size"])
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
        where = f"adamw/split_bf16 {r['contestant']} @ {fmt_size(r['size'])}"
        limit = TARGET[r["contestant"]]
        out.append(Target(where, limit, text=f"{where}: <= {limit}x torch fused fp32 AdamW")
                   .judge(r["ratio_to_baseline"]))
        out.append(Target(where, TARGET_ROOF, ">=", text=f"{where}: >= {TARGET_ROOF:.0%} of roof")
                   .judge(r["pct_roof"] / 100))
    return out


def compute_rows(n: int, repeats: int) -> list[dict]:
    """Split-bf16 AdamW over ``n`` parameters (one tensor, in cache) with fp32, bf16 and int8 state on one thread,
    interleaved; the fastest of ``repeats`` steps each, in ns/param (includes the op's fixed call cost)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {"fp32_state": OurStep("adamw", "split_bf16", n, 1)}
        for fmt, dtype in FORMATS.items():
            steps[fmt] = OurStep("adamw", "split_bf16", n, 1)
            steps[fmt].group[state_formats.GROUP_KEY] = dtype
        # No separate warm-up: the first call creates the state, and the best of many calls leaves it out.
        best = {k: v * 1e9 for k, v in interleaved(steps, repeats, warmup=0).best().items()}
    finally:
        torch.set_num_threads(threads)
    rows = [{"contestant": k, "size": n, "threads": 1, "ns_per_param": v / n} for k, v in best.items()]
    for r in rows:
        print(f"  {r['contestant']:<12} {fmt_size(n):>5}  1 thread, in cache: {r['ns_per_param']:.3f} ns/param",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point: the in-cache compute rows, then the state rows at each size, and the targets."""
    p = argparse.ArgumentParser(description="reduced-byte optimizer state rows (split-bf16 AdamW)")
    p.add_argument("--sizes", default="10M,50M", help="comma-separated parameter counts")
    p.add_argument("--repeats", type=int, default=15, help="timed steps per contestant and size")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--tensors", type=int, default=4, help="parameters are split over this many tensors")
    p.add_argument("--compute-elements", type=parse_size, default=parse_size("256K"),
                   help="parameters of the in-cache, one-thread compute rows (0: skip them)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also time torchao's, bitsandbytes' and torch-optimi's optimizers where they run")
    p.add_argument("--json", type=Path, help="write the machine description and all rows to this file")
    args = p.parse_args(argv)
    info = report.machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "isa"))
    compute = compute_rows(args.compute_elements, 200) if args.compute_elements else []
    rows = []
    for n in (parse_size(s) for s in args.sizes.split(",")):
        rows += bench_size(n, args)
    checks = targets(rows)
    print_targets(checks, digits=2)
    return report.write(args.json, {"machine": info, "compute_rows": compute, "state_rows": rows, "targets": checks})


if __name__ == "__main__":
    main()
