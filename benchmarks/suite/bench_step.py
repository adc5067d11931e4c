"""Optimizer-step throughput of the fused kernels against a memory-bandwidth roof and torch's fused optimizers.

Run from the repository root::

    python -m benchmarks.suite.bench_step [--sizes 10M,50M] [--quick | --smoke] [--json PATH]

For each optimizer x storage layout at each size (parameters split over ``--tensors`` tensors) it reports the
median ns/param over the timed steps after warm-up, the GB/s that implies given the minimum bytes the kernel must
move per element (``bytes_per_element``), that as a % of a bandwidth roof, and the ratio to torch's ``fused=True``
fp32 optimizer. The roof is an in-place ``a.add_(b)`` of two fp32 tensors of the row's size (12 bytes/element, far
larger than the caches at 10M), timed step by step between ours and torch's: this VM's bandwidth drifts by 20-30%
within a minute (other tenants), so a roof taken only at the start or the end would compare rows with a different
machine. A 1 GiB roof at the start and the end is printed too, for reference. Targets are printed as PASS/FAIL,
never asserted. ``run(args) -> dict`` is the entry point for other scripts.

Lamb rows also time ``lamb_traffic.c`` in the same loop: Lamb's two passes over the same layout and chunks with next
to no arithmetic, i.e. what moving Lamb's bytes alone costs here. Its ratio to torch's fused Adam (``floor``) is the
best any kernel with Lamb's data movement could show against the ``<= 1.5x`` target on this machine.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from ipex_train.optim import _layouts

from ..common import report
from ..common.optim_steps import (
    BASELINE,
    DEFAULT_LAYOUTS,
    LAYOUTS,
    OPTIMIZERS,
    ROOF_BYTES_PER_ELEMENT,
    TARGET_ROOF,
    OurStep,
    TorchStep,
    fmt_size,
    parse_size,
    state_tensors,
)
from ..common.targets import Target, print_targets
from ..common.timing import interleaved
from . import bench_state

# Bytes per element of each layout: reading the working value (fp32/fp64, whether plain, split or a master),
# writing it back (plus the 16-bit copy for the master layouts, written but never read), the grad, and one element
# of optimizer state.
_LAY = {name: _layouts.BY_NAME[name] for name in LAYOUTS}
READ = {n: lay.state.itemsize for n, lay in _LAY.items()}
WRITE = {n: READ[n] + (lay.param.itemsize if lay.aux == torch.float32 else 0) for n, lay in _LAY.items()}
GRAD = {n: lay.grad.itemsize for n, lay in _LAY.items()}
STATE = {n: lay.state.itemsize for n, lay in _LAY.items()}

TARGET_SPLIT_ADAMW = 0.95
TARGET_LAMB = 1.5


def bytes_per_element(opt: str, layout: str) -> int:
    """Minimum bytes one step must move per parameter element, counted from the kernel's passes.

    One-pass rules read and write the working value, read the grad, read and write each state tensor. Lamb's first
    pass reads value and grad and updates both moments; its second reads value and moments and writes the value.
    Lars's first pass reads value and grad for the norms; its second is a one-pass momentum step.
    """
    r, w, g, s = READ[layout], WRITE[layout], GRAD[layout], STATE[layout]
    if opt == "lamb":
        return (r + g + 4 * s) + (r + w + 2 * s)
    if opt == "lars":
        return (r + g) + (r + w + g + 2 * s)
    return r + w + g + 2 * s * state_tensors(opt)


def measure_roof(elems: int, warmup: int, repeats: int) -> dict:
    """In-place add of two ``elems``-element fp32 tensors, timed on its own (the reference roof)."""
    a = torch.ones(elems)
    b = torch.ones(elems)
    ns = interleaved({"roof": lambda: a.add_(b)}, repeats, warmup=warmup).summary("roof").median * 1e9
    return {"elements": elems, "median_ns": ns, "gbps": ROOF_BYTES_PER_ELEMENT * elems / ns}


class _TrafficTensor(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("param", ctypes.c_void_p), ("aux", ctypes.c_void_p),
                ("grad", ctypes.c_void_p), ("m", ctypes.c_void_p), ("v", ctypes.c_void_p)]


TRAFFIC_LAYOUT = {"fp32": 0, "split_bf16": 1, "bf16_master": 2, "fp16_master": 2}  # lamb_traffic.c's enum


def load_traffic_kernel():
    """``lamb_traffic.c`` compiled with the system C compiler and loaded, or None (saying why) where that fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("lamb traffic floor: skipped (no C compiler found)")
        return None
    src = Path(__file__).with_name("lamb_traffic.c")
    lib_path = Path(tempfile.mkdtemp(prefix="ipex_train_bench_")) / "lamb_traffic.so"
    cmd = [cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(lib_path.parent, ignore_errors=True)
        print(f"lamb traffic floor: skipped ({' '.join(cmd)} failed: {done.stderr.strip()[-300:]})")
        return None
    lib = ctypes.CDLL(str(lib_path))
    lib_path.unlink()  # the loaded mapping stays valid; nothing is left in the temp dir
    lib_path.parent.rmdir()
    lib.lamb_traffic.restype = ctypes.c_float
    lib.lamb_traffic.argtypes = [ctypes.POINTER(_TrafficTensor), ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


class LambTraffic:
    """One call of ``lamb_traffic.c`` over tensors shaped and stored like :class:`OurStep`'s Lamb (own copies)."""

    def __init__(self, lib, layout: str, n: int, tensors: int):
        self.lib, self.layout = lib, TRAFFIC_LAYOUT[layout]
        step = OurStep("lamb", layout, n, tensors)
        self.keep = []  # the tensors the structs point into
        structs = []
        for p, a, g in zip(step.params, step.aux, step.grads):
            m, v = torch.zeros(p.numel()), torch.zeros(p.numel())
            self.keep += [p, a, g, m, v]
            structs.append(_TrafficTensor(p.numel(), p.data_ptr(), a.data_ptr() if a is not None else None,
                                          g.data_ptr(), m.data_ptr(), v.data_ptr()))
        self.structs = (_TrafficTensor * len(structs))(*structs)

    def __call__(self) -> None:
        self.lib.lamb_traffic(self.structs, len(self.structs), self.layout, torch.get_num_threads())


def bench_size(n: int, args) -> list[dict]:
    """All optimizer x layout rows at size ``n``; ours, torch's baseline and the roof alternate step by step."""
    rows = []
    roof_a, roof_b = torch.ones(n), torch.ones(n)

    def roof() -> None:
        roof_a.add_(roof_b)

    for base in dict.fromkeys(BASELINE[o] for o in args.optimizers):
        theirs = TorchStep(base, n, args.tensors)
        for opt in [o for o in args.optimizers if BASELINE[o] == base]:
            for layout in args.layouts:
                ours = OurStep(opt, layout, n, args.tensors)
                floor = LambTraffic(args.traffic_kernel, layout, n, args.tensors) \
                    if opt == "lamb" and args.traffic_kernel is not None else None
                variants = {"ours": ours, "torch": theirs, "roof": roof, **({"floor": floor} if floor else {})}
                timed = interleaved(variants, args.repeats, warmup=args.warmup)
                del ours, floor, variants
                gc.collect()
                med = timed.median()
                ns, ns_torch = med["ours"] * 1e9, med["torch"] * 1e9
                roof_gbps = ROOF_BYTES_PER_ELEMENT * n / (med["roof"] * 1e9)
                nbytes = bytes_per_element(opt, layout)
                gbps = nbytes * n / ns
                rows.append({
                    "optimizer": opt, "layout": layout, "size": n, "bytes_per_element": nbytes,
                    "ns_per_param": ns / n, "gbps": gbps, "roof_gbps": roof_gbps, "pct_roof": 100 * gbps / roof_gbps,
                    "baseline": f"torch fused fp32 {base}", "baseline_ns_per_param": ns_torch / n,
                    "ratio_to_baseline": ns / ns_torch, "ratio_spread": timed.paired("ours", "torch").spread,
                })
                if "floor" in med:
                    rows[-1]["traffic_floor_ratio"] = med["floor"] / med["torch"]
                print(_row_line(rows[-1]), flush=True)
        del theirs
        gc.collect()
    return rows  # the roof's tensors go with this frame


def targets(rows: list[dict]) -> list[dict]:
    """PASS/FAIL of each row: its share of the roof, and the ratios to torch's fused optimizer."""
    out = []
    for r in rows:
        where = f"{r['optimizer']}/{r['layout']} @ {fmt_size(r['size'])}"
        out.append(Target(where, TARGET_ROOF, ">=", text=f"{where}: >= {TARGET_ROOF:.0%} of roof")
                   .judge(r["pct_roof"] / 100))
        if r["optimizer"] == "adamw" and r["layout"] == "split_bf16":
            out.append(Target(f"{where}: torch fused fp32 AdamW", TARGET_SPLIT_ADAMW,
                              text=f"{where}: <= {TARGET_SPLIT_ADAMW}x torch fused fp32 AdamW")
                       .judge(r["ratio_to_baseline"]))
        if r["optimizer"] == "lamb":
            out.append(Target(f"{where}: torch fused fp32 Adam", TARGET_LAMB,
                              text=f"{where}: <= {TARGET_LAMB}x torch fused fp32 Adam")
                       .judge(r["ratio_to_baseline"], floor=r.get("traffic_floor_ratio")))
    return out


HEADER = (f"{'optimizer':<9} {'layout':<12} {'size':>5} {'B/elem':>6} {'ns/param':>9} {'GB/s':>6} {'roof':>6} "
          f"{'%roof':>6} {'torch ns/p':>10} {'ratio':>6}  baseline")


def _row_line(r: dict) -> str:
    return (f"{r['optimizer']:<9} {r['layout']:<12} {fmt_size(r['size']):>5} {r['bytes_per_element']:>6} "
            f"{r['ns_per_param']:>9.3f} {r['gbps']:>6.2f} {r['roof_gbps']:>6.2f} {r['pct_roof']:>5.1f}% "
            f"{r['baseline_ns_per_param']:>10.3f} {r['ratio_to_baseline']:>6.2f}  {r['baseline']}"
            + (f" (Lamb's bytes alone: {r['traffic_floor_ratio']:.2f})" if "traffic_floor_ratio" in r else ""))


def parser() -> argparse.ArgumentParser:
    """The command-line options (also the fields ``run`` reads from its ``args``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="comma-separated parameter counts, e.g. 10M,50M "
                   "(default: 10M,50M; 10M with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, 10M only unless --sizes is given")
    p.add_argument("--smoke", action="store_true", help="seconds-long plumbing check for tests (200K params, "
                   "4Mi-element roof, 2 repeats unless given); its numbers mean little")
    p.add_argument("--json", type=Path, help="write machine description, roof and all rows to this file")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(DEFAULT_LAYOUTS))
    p.add_argument("--tensors", type=int, default=4, help="parameters are split over this many tensors")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed steps per row (default 15; 5 with --quick, 2 with --smoke)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row before timing")
    p.add_argument("--state-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="also time reduced-byte state (bf16, int8) and the low-bit peers (benchmarks/suite/"
                   "bench_state.py)")
    p.add_argument("--roof-elements", type=parse_size, default=None,
                   help="elements in each tensor of the add_ roof (default 256Mi = 1 GiB each; 4Mi with --smoke)")
    return p


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args`` (as :func:`parser` builds them); print the table and targets, write
    JSON if ``args.json`` is set, and return the same dict."""
    default_sizes = "200K" if args.smoke else "10M" if args.quick else "10M,50M"
    sizes = [parse_size(s) for s in (args.sizes or default_sizes).split(",")]
    args.repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 15)
    args.roof_elements = args.roof_elements or (4 * 2**20 if args.smoke else 256 * 2**20)
    args.traffic_kernel = load_traffic_kernel() if "lamb" in args.optimizers else None
    info = report.machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items() if k != "isa"))
    print("isa: " + ", ".join(info.get("isa", [])))
    print("bytes/element moved (minimum, from the kernels' passes):")
    for opt in args.optimizers:
        print(f"  {opt:<8} " + "  ".join(f"{lay}={bytes_per_element(opt, lay)}" for lay in args.layouts))

    roof_runs = 5 if args.quick or args.smoke else 10
    large = [measure_roof(args.roof_elements, 2, roof_runs)]
    print(f"reference roof (a.add_(b), {args.roof_elements} fp32 elements each): {large[0]['gbps']:.2f} GB/s; "
          "each row's roof is its own, timed between its steps", flush=True)
    print(HEADER)
    rows = []
    for n in sizes:
        rows += bench_size(n, args)
    state_rows = []
    if args.state_rows:
        print("\nreduced-byte optimizer state (split-bf16 AdamW) and low-bit peers, interleaved with torch's fused "
              "fp32 AdamW and the roof:")
        for n in sizes:
            state_rows += bench_state.bench_size(n, args)
    large.append(measure_roof(args.roof_elements, 2, roof_runs))
    row_roofs = [r["roof_gbps"] for r in rows]
    print(f"reference roof again at the end: {large[1]['gbps']:.2f} GB/s; the rows' roofs ranged "
          f"{min(row_roofs):.2f}-{max(row_roofs):.2f} GB/s")
    rows.sort(key=lambda r: (r["size"], OPTIMIZERS.index(r["optimizer"]), LAYOUTS.index(r["layout"])))

    print("\n" + HEADER)
    for r in rows:
        print(_row_line(r))
    checks = targets(rows) + (bench_state.targets(state_rows) if args.state_rows else [])
    print_targets(checks, digits=2)
    result = {"machine": info, "settings": {"sizes": sizes, "tensors": args.tensors, "repeats": args.repeats,
                                            "warmup": args.warmup, "quick": args.quick,
                                            "smoke": args.smoke},
              "roof": {"bytes_per_element": ROOF_BYTES_PER_ELEMENT, "reference_runs": large,
                       "gbps": statistics.median(row_roofs), "row_min_gbps": min(row_roofs),
                       "row_max_gbps": max(row_roofs)},
              "results": rows, "state_rows": state_rows, "targets": checks}
    return report.write(args.json, result)


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point."""
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
