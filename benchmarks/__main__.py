"""The benchmark suite: ``python -m benchmarks [--quick] [--out DIR] [--only step,train,inference,int8,xpu,memory]
[ARGS...]``.

Each benchmark runs in its own process (so one's memory and thread pools never colour another's, and a failing one
does not stop the rest) and writes JSON; the suite then writes, under ``--out`` (default out/bench):

* ``report.md``: the machine (CPU, ISA features, threads, torch), every PASS/FAIL target with its measured ratio,
  and each benchmark's printed table;
* ``summary.json``: the same, machine-readable;
* PNG plots: ``step_roofline.png`` (optimizer-step ns/param against the bandwidth floor measured in the same run),
  ``step_vs_torch.png``, ``train_step.png``, ``inference.png``, ``int8.png`` and ``memory.png`` (ratio bars).

Every figure is a ratio or a median over repeats measured within one run; nothing is compared across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCHMARKS = {
    "step": "benchmarks.suite.bench_step",
    "train": "benchmarks.suite.bench_train_step",
    "inference": "benchmarks.suite.bench_inference",
    "int8": "benchmarks.suite.bench_int8",
    "xpu": "benchmarks.suite.bench_xpu",
    "memory": "benchmarks.suite.bench_memory",
}


def _run_one(name: str, module: str, quick: bool, out: str, extra: list[str]) -> dict:
    path = os.path.join(out, f"{name}.json")
    log = os.path.join(out, f"{name}.txt")
    cmd = [sys.executable, "-m", module, "--json", path] + (["--quick"] if quick else []) + extra
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        for line in proc.stdout:  # echo live: these take minutes, and the user should see progress
            sys.stdout.write(line)
            f.write(line)
        code = proc.wait()
    entry = {"name": name, "module": module, "returncode": code, "seconds": time.perf_counter() - start,
             "log": log}
    if code == 0 and os.path.exists(path):
        with open(path) as f:
            entry["data"] = json.load(f)
    return entry


def _targets(entry: dict) -> list[tuple[str, str, str]]:
    """(verdict, target, measured) rows of one benchmark's JSON, whatever its exact field names."""
    rows = []
    for t in entry.get("data", {}).get("targets", []):
        verdict = t.get("verdict") or ("PASS" if t.get("pass") else "FAIL")
        value = t.get("value", t.get("ratio"))
        measured = "" if value is None else f"{value:.3g}"
        if t.get("floor"):  # bench_step's Lamb rows: the same bytes moved with no arithmetic
            measured += f" (Lamb's bytes alone: {t['floor']:.3g})"
        rows.append((verdict, t.get("target", "?"), measured))
    return rows


def _size(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}K"


def _plot_step(data: dict, out: str) -> list[str]:
    import matplotlib.pyplot as plt

    rows, roof = data["results"], data["roof"]["gbps"]
    made = []
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        sel = [r for r in rows if r["size"] == size]
        xs = sorted({r["bytes_per_element"] for r in sel})
        lo, hi = min(xs) - 2, max(xs) + 2
        ax.plot([lo, hi], [lo / roof, hi / roof], "k--",
                label=f"bandwidth floor ({roof:.1f} GB/s, a.add_(b), median of the rows' roofs)")
        for layout in sorted({r["layout"] for r in sel}):
            pts = [r for r in sel if r["layout"] == layout]
            ax.scatter([r["bytes_per_element"] for r in pts], [r["ns_per_param"] for r in pts], label=layout, s=28)
            for r in pts:
                ax.annotate(r["optimizer"], (r["bytes_per_element"], r["ns_per_param"]), fontsize=7,
                            xytext=(3, 2), textcoords="offset points")
        ax.set(xlabel="minimum bytes moved per parameter", ylabel="ns per parameter",
               title=f"optimizer step, {_size(size)} parameters")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    made.append(os.path.join(out, "step_roofline.png"))
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels, values = [], []
    for r in rows:
        if r.get("ratio_to_baseline") is not None:
            labels.append(f"{r['optimizer']}\n{r['layout']}\n{_size(r['size'])}")
            values.append(r["ratio_to_baseline"])
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set(ylabel="time / torch fused fp32 (lower is better)", title="optimizer step vs torch fused=True")
    fig.tight_layout()
    made.append(os.path.join(out, "step_vs_torch.png"))
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)
    return made


def _bars(path: str, title: str, ylabel: str, groups: dict[str, dict[str, float]], line: float | None) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    variants = sorted({v for g in groups.values() for v in g})
    width = 0.8 / max(1, len(variants))
    for k, variant in enumerate(variants):
        xs = [i + k * width for i, g in enumerate(groups.values()) if variant in g]
        ys = [g[variant] for g in groups.values() if variant in g]
        ax.bar(xs, ys, width, label=variant)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], list(groups), fontsize=8)
    if line is not None:
        ax.axhline(line, color="k", linestyle="--", linewidth=1)
    ax.set(ylabel=ylabel, title=title, yscale="log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _case_bars(data: dict, path: str, title: str) -> list[str]:
    """Bars of each case's variants against eager fp32 (bench_inference and bench_int8 share this layout)."""
    groups = {f"{c['model']} b{c['batch']}": {v: r["vs_eager"] for v, r in c["variants"].items()}
              for c in data["cases"]}
    return [_bars(path, title, "x eager", groups, 1.0)]


def _plot_inference(data: dict, out: str) -> list[str]:
    return _case_bars(data, os.path.join(out, "inference.png"),
                      "inference throughput vs eager fp32 (higher is better)")


def _plot_train(data: dict, out: str) -> list[str]:
    groups: dict[str, dict[str, float]] = {}
    for r in data["results"]:
        groups.setdefault(r["model"], {})[r["variant"]] = r["ratio_vs_fp32"]
    return [_bars(os.path.join(out, "train_step.png"), "train step time vs plain fp32 (lower is better)",
                  "x fp32 step time", groups, 1.0)]


def _plot_int8(data: dict, out: str) -> list[str]:
    return _case_bars(data, os.path.join(out, "int8.png"),
                      "int8 inference throughput vs eager fp32 (higher is better)")


def _plot_memory(data: dict, out: str) -> list[str]:
    groups = {"bytes/param": {r["label"]: r["ratio_vs_torch_fp32"] for r in data["results"]},
              "step time": {r["label"]: r["step_time_vs_torch_fp32"] for r in data["results"]}}
    return [_bars(os.path.join(out, "memory.png"), "100M-param AdamW step vs torch fused fp32 (lower is better)",
                  "x torch fp32", groups, 1.0)]


PLOTS = {"step": _plot_step, "inference": _plot_inference, "train": _plot_train, "int8": _plot_int8,
         "memory": _plot_memory}


def _machine() -> dict:
    import ipex_train

    info = ipex_train.info()
    return {"cpu": info["cpu"], "isa": [k for k, v in info["isa"].items() if v], "threads": info["threads"],
            "torch": info["torch"], "kernel_variant": info["kernel_variant"],
            "bf16_compute_policy": info["bf16_compute_policy"]}


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks, then write the report, summary JSON and plots."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
        epilog="Arguments the suite does not know are passed on to every selected benchmark, e.g. "
               "'python -m benchmarks --only step --smoke' (bench_step's seconds-long smoke mode, which the tests "
               "use) or '--only step --sizes 1M'.")
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode (the suite < 10 min)")
    parser.add_argument("--out", default=os.path.join("out", "bench"), help="output folder")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all; xpu only when a "
                             "SYCL device is available)")
    args, extra = parser.parse_known_args(argv)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    if "xpu" in names and not args.only:
        import ipex_train.xpu

        if not ipex_train.xpu.is_available():
            print(f"xpu: skipped ({ipex_train.xpu.unavailable_reason()})")
            names.remove("xpu")
    os.makedirs(args.out, exist_ok=True)
    machine = _machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))

    entries = [_run_one(n, BENCHMARKS[n], args.quick, args.out, extra) for n in names]
    plots = []
    for e in entries:
        if "data" in e and e["name"] in PLOTS:
            plots += PLOTS[e["name"]](e["data"], args.out)

    lines = ["# ipex_train benchmark report", "",
             f"Machine: {machine['cpu']}; ISA: {' '.join(machine['isa'])}; {machine['threads']} threads; "
             f"torch {machine['torch']}; kernel variant {machine['kernel_variant']}; bf16 compute policy "
             f"{machine['bf16_compute_policy']}. Mode: {'quick' if args.quick else 'full'}"
             f"{''.join(' ' + a for a in extra)}.", "",
             "## Targets", "", "| verdict | target | measured |", "| --- | --- | --- |"]
    for e in entries:
        for verdict, target, value in _targets(e):
            lines.append(f"| {verdict} | {e['name']}: {target} | {value} |")
    for e in entries:
        status = "ok" if e["returncode"] == 0 else f"FAILED (exit {e['returncode']})"
        lines += ["", f"## {e['name']} ({status}, {e['seconds']:.0f} s)", "", "```"]
        with open(e["log"]) as f:
            lines += [f.read().rstrip(), "```"]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    report = os.path.join(args.out, "report.md")
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    summary = {"machine": machine, "quick": args.quick, "extra_args": extra,
               "benchmarks": [{k: v for k, v in e.items() if k != "log"} for e in entries]}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\nreport: {os.path.abspath(report)}")
    for p in plots:
        print(f"plot:   {os.path.abspath(p)}")
    return 0 if all(e["returncode"] == 0 for e in entries) else 1


if __name__ == "__main__":
    raise SystemExit(main())
