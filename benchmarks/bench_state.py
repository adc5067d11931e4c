"""Reduced-byte optimizer state rows of ``bench_step``: split-bf16 AdamW with bf16 (stochastic rounding) and int8
state, beside torch's fused fp32 AdamW, the bandwidth roof and the low-bit peers that install and run on a CPU
(torchao AdamW8bit, bitsandbytes AdamW8bit, torch-optimi AdamW with bf16 weights and Kahan summation), all timed
step by step in one loop. Called by :func:`benchmarks.bench_step.run` (``--state-rows``, on by default).
"""
from __future__ import annotations

import gc
import statistics

import torch

from ipex_train.optim import _state_formats

from . import bench_step as bs

FORMATS = {"bf16_state": torch.bfloat16, "int8_state": "int8"}
TARGET = {"bf16_state": 0.70, "int8_state": 0.60}  # x torch fused fp32 AdamW's step time


def bytes_per_element(fmt: str) -> float:
    """Minimum bytes per element of a split-bf16 AdamW step with state ``fmt``: the split value read and written
    (4 + 4), the bf16 grad (2), two moments read and written (2 bytes each in bf16; 1 byte plus a 4-byte scale per
    256 elements in int8)."""
    state = 2.0 if fmt == "bf16_state" else 1.0 + 4.0 / _state_formats.Q8_BLOCK
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
        ours.group[_state_formats.GROUP_KEY] = dtype
        steps[fmt] = ours
    for name, make in _peers().items():
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
