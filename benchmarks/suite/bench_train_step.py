"""End-to-end train step: time, loss and peak memory of plain fp32 torch, torch autocast bf16, the bf16 compute
policies, and ipex_train.optimize(dtype=bf16 / fp32), against fp32.

Run from the repository root::

    python -m benchmarks.suite.bench_train_step --quick [--json out.json] [--threads N]

The models are in train_models.MODELS (a small ResNet-style CNN, an nn.TransformerEncoder, a BERT-base-like
HuggingFace encoder, a torchvision ViT, torchvision ResNet-50, and timm's resnet18, mobilenetv3_small, vit_tiny,
convnext_atto and efficientnet_b0 at batch 8/64 px with timm's AdamW; full-size transformers for the attention work:
a 12-layer BERT-base at b8 s128, torchvision ViT-B/16 at 224 px and a Llama-style decoder at s256, for which the step's
share of the bf16 matmul roof (a 2048^3 bf16 matmul timed before and after their steps) is printed beside the share
that the step's matrix products alone reach in bf16 (roof.gemm_only_bound: the most any step can reach); quick mode
runs QUICK_MODELS), each
trained with every variant in VARIANTS (QUICK_VARIANTS in quick mode) on the same learnable data (bf16-weight
variants keep fp32 master weights). Each (model, variant) pair runs in its own subprocess so that its peak RSS
(resource.getrusage ru_maxrss) is its own; the driver interleaves their steps round-robin so that
load from other processes hits every variant alike. Step time is the median over the steps after
warm-up (see Timing below). Variants that run torch's bf16 kernels
are slow on CPUs without bf16 units (read from the CPU), so there they get few steps (one, in quick mode); with bf16
units they are timed like the others. Quick mode leaves out the compile variants of the large models.
``--cpu-isa avx2`` runs every worker as on an AVX2-only CPU without bf16 units (see train_variants.AVX2_ENV), so
that the targets for such CPUs can be measured on one with AVX-512 and bf16 units.

Memory is measured in a second, untimed phase (MEMORY_STEPS steps per variant, one process at a time) with glibc's
mmap threshold pinned (see benchmarks.common.memory.pin_mmap_threshold): peak RSS and its growth during the run then
follow the tensors a variant holds rather than the allocator's heap retention. The timed phase's peak RSS under
glibc's defaults is printed beside it ('RSS MB') for reference.

Timing (``benchmarks.common.train_harness``): every worker warms up until two consecutive steps agree within
``--steady`` (5%; at least one step, two for torch.compile variants, at most ``--max-warmup``), then the timed
steps run round-robin. Each variant reports its min, median and spread (interquartile range / median) of step
times, each ratio to fp32 as median / median, and its ratio to every other timed variant paired (the median over
rounds of the two steps' ratio in the same round; a target's "within noise" uses that ratio's spread).
``--check-plain-loop`` also times the same builders in one plain process (each variant in turn: 2 warm-up steps,
then the steps, nothing in between) and reports how far the harness's ratios are from it.

Models are in ``benchmarks/common/train_models.py``, variants (one decorated function each) in
``benchmarks/common/train_variants.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ipex_train import compute_policy

from ..common import report
from ..common.roof import gemm_only_bound, matmul_roof_gflops, step_flops
from ..common.targets import Target, print_targets
from ..common.train_harness import Worker, run_plain_loop, run_workers
from ..common.train_models import MODELS, QUICK_MODELS
from ..common.train_variants import AVX2_ENV, CPU_ISA_ENV, QUICK_VARIANTS, VARIANTS, native_bf16

STEADY, MAX_WARMUP, QUICK_MAX_WARMUP = 0.05, 8, 4
AGREEMENT = 0.05  # the harness's ratios against the plain loop's (--check-plain-loop)
PLAIN_WARMUP = 2


def run_model(model_name: str, variants: list[str], quick: bool, threads: int | None, steps: int | None = None,
              steady_within: float | None = STEADY, max_warmup: int | None = None) -> list[dict]:
    """All variants of one model, one worker process each, their steps interleaved (see the module docstring)."""
    most = max_warmup if max_warmup is not None else QUICK_MAX_WARMUP if quick else MAX_WARMUP
    plan = {name: _plan(quick, name, steps) for name in variants}
    for name, (timed, warmup) in plan.items():
        print(f"{model_name}/{name}: {warmup} warm-up steps (more until two agree within {steady_within}, at most "
              f"{max(warmup, most)}) + {timed} timed steps", flush=True)
    workers = {name: Worker(model_name, name, threads) for name in variants}
    # Slow variants (torch's bf16 kernels without bf16 units: minutes a step) keep their fixed warm-up.
    results, rounds = run_workers(workers, {n: p[0] for n, p in plan.items()}, {n: p[1] for n, p in plan.items()},
                                  steady_within,
                                  {n: p[1] if VARIANTS[n].slow else max(p[1], most) for n, p in plan.items()})
    timed = [n for n in results if not VARIANTS[n].slow]
    for name in timed:  # paired against every other timed variant: the median over rounds of the two steps' ratio
        results[name]["paired"] = {ref: {"ratio": rounds.paired(name, ref).median,
                                         "spread": rounds.paired(name, ref).spread} for ref in timed if ref != name}
    return list(results.values())


MEMORY_STEPS = 3


# The variants memory targets are stated for (and their reference); the others' memory is not measured.
MEMORY_VARIANTS = ("fp32", "optimize_bf16", "optimize_bf16_autocast", "optimize_bf16_emulated",
                   "optimize_bf16_contiguous")


def memory_run(model_name: str, variants: list[str], threads: int | None) -> dict[str, dict]:
    """Peak RSS of each variant in MEMORY_VARIANTS over MEMORY_STEPS untimed steps, glibc's mmap threshold pinned
    (common.memory.pin_mmap_threshold), one worker at a time."""
    out = {}
    for name in variants:
        if name not in MEMORY_VARIANTS or VARIANTS[name].slow:
            continue
        w = Worker(model_name, name, threads, pin_malloc=True)
        for _ in range(MEMORY_STEPS):
            w.step()
        r = w.finish(0)
        out[name] = {"peak_mb": r["peak_rss_mb"], "run_mb": r["peak_rss_mb"] - r["setup_rss_mb"],
                     "pinned": r["mmap_threshold_pinned"]}
    return out


def _plan(quick: bool, variant_name: str, steps: int | None = None) -> tuple[int, int]:
    """(timed steps, warm-up steps) for a variant; ``steps`` overrides the timed steps of the non-slow ones."""
    if VARIANTS[variant_name].slow:
        return (1, 0) if quick else (2, 1)
    warmup = 2 if VARIANTS[variant_name].compiled else 1  # compile, then one compiled step before timing
    return (steps or (6 if quick else 50), warmup)


def _variants_for(model_name: str, variants: list[str], quick: bool) -> list[str]:
    """Quick mode leaves out the torch.compile variants of the large models (minutes of compilation each)."""
    if quick and MODELS[model_name].large:
        return [name for name in variants if not VARIANTS[name].compiled]
    return variants


# When fp32's final loss is below SOLVED times its first one the task is solved, and relative gaps between losses
# of ~1e-4 are noise (autocast's own gap reached 16-73% there): the final gap is then taken against the first loss
# and held to SOLVED_BOUND of it (0.1%: on a first loss of 2.3, runs ending within 0.0023 of each other).
SOLVED, SOLVED_BOUND = 0.01, 0.001


def _loss_gap(losses: list[float], reference: list[float]) -> dict:
    n = min(len(losses), len(reference))
    per_step = [abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n])]
    mean, ref_mean = statistics.fmean(losses[:n]), statistics.fmean(reference[:n])
    final_gap_of_first = abs(losses[n - 1] - reference[n - 1]) / abs(reference[0])
    solved = abs(reference[n - 1]) < SOLVED * abs(reference[0])
    return {"steps": n, "mean_rel_diff": abs(mean - ref_mean) / ref_mean,
            "final_rel_diff": per_step[-1], "max_rel_diff": max(per_step),
            "final_gap_of_first_loss": final_gap_of_first, "solved": solved,
            "final_target_gap": final_gap_of_first if solved else per_step[-1]}


def _table(results: list[dict]) -> str:
    """One row per run: min and median step seconds, their spread (IQR / median), the median against fp32's.
    'cpu x': median process CPU time per step against fp32's (with --threads 1 on a shared machine, the step's own
    work without the time other processes held the core). 'peak MB' and '+MB run' are the memory phase's (glibc
    mmap threshold pinned, see common.memory.pin_mmap_threshold); 'RSS MB' is the timed phase's peak RSS with
    glibc's default, for reference."""
    head = f"{'model':<20} {'variant':<23} {'params':>7} {'warm':>4} {'steps':>5} {'min s':>7} {'step s':>7} " \
           f"{'spread':>6} {'x fp32':>7} {'cpu x':>6} {'peak MB':>8} {'+MB run':>8} {'RSS MB':>7} {'loss[-1]':>9} " \
           f"{'final loss vs fp32':>19}"
    lines = [head, "-" * len(head)]
    for r in results:
        gap = r.get("loss_vs_fp32")
        gap_text = f"{100 * gap['final_rel_diff']:.3f}% @{gap['steps']}" if gap else "-"
        mem = r.get("memory")
        peak, run = (f"{mem['peak_mb']:.0f}", f"{mem['run_mb']:.0f}") if mem else ("-", "-")
        lines.append(
            f"{r['model']:<20} {r['variant']:<23} {r['params'] / 1e6:>6.2f}M {r['warmup']:>4} "
            f"{len(r['step_times_s']):>5} {r['min_step_s']:>7.3f} {r['median_step_s']:>7.3f} {r['spread']:>6.1%} "
            f"{r['ratio_vs_fp32']:>7.2f} {r['cpu_ratio_vs_fp32']:>6.2f} {peak:>8} {run:>8} {r['peak_rss_mb']:>7.0f} "
            f"{r['losses'][-1]:>9.4f} {gap_text:>19}"
        )
    return "\n".join(lines)


def _relative(results: list[dict], model: str, variant_name: str, reference: str) -> tuple[float, float] | None:
    """(median / median step time, the spread of the paired per-round ratio) of two variants of ``model``."""
    by_name = {r["variant"]: r for r in results if r["model"] == model}
    if variant_name not in by_name or reference not in by_name or VARIANTS[reference].slow:
        return None
    a, b = by_name[variant_name], by_name[reference]
    spread = a.get("paired", {}).get(reference, {}).get("spread", max(a["spread"], b["spread"]))
    return a["median_step_s"] / b["median_step_s"], spread


# (variant, reference, bound, needs bf16 units): step-time ratio targets, measured within the run.
RATIO_TARGETS = (
    ("optimize_bf16", "autocast_bf16", 0.8, True),
    ("optimize_bf16_compile", "autocast_compile", 0.8, True),
    ("optimize_bf16_emulated", "fp32", 1.0, False),
    # Limited to AVX2 (--cpu-isa avx2), optimize(bf16) is the emulated policy: the CPU-without-bf16-units target.
    ("optimize_bf16", "fp32", 1.0, None),
)


# The transformers at the roof (ModelSpec.roof): optimize(bf16) against autocast and autocast + torch.compile, and
# the share of the bf16 matmul roof its step reaches (docs/attention.md).
ROOF_RATIO_TARGETS = (
    ("optimize_bf16", "autocast_bf16", 0.85, True),
    ("optimize_bf16", "autocast_compile", 0.9, True),
)
ROOF_SHARE = 0.85
STEP_BOUND, LOSS_BOUND = 1.15, 0.01  # optimize() step time and final-loss gap against fp32


def _print_loss(r: dict) -> None:
    gap = r["loss_vs_fp32"]
    print(f"{r['model']}/{r['variant']}: step time {r['ratio_vs_fp32']:.3f}x fp32 (target <= {STEP_BOUND}x); "
          f"loss vs fp32 over {gap['steps']} steps: mean {100 * gap['mean_rel_diff']:.3f}%, "
          f"final {100 * gap['final_rel_diff']:.3f}% ({100 * gap['final_gap_of_first_loss']:.3f}% of the first "
          f"loss), max {100 * gap['max_rel_diff']:.3f}% (target < 1% at 50 steps)")


def _memory_targets(r: dict, fp32: dict) -> list[dict]:
    """Step time, peak RSS, RSS growth and final loss of one optimize() variant against fp32."""
    label = f"{r['model']} {r['variant']}"
    mem, mem32, gap = r["memory"], fp32["memory"], r["loss_vs_fp32"]
    solved = " (task solved: gap < 0.1% of the first loss)" if gap["solved"] else ""
    return [
        Target(label, STEP_BOUND, text=f"{label} step time <= {STEP_BOUND}x fp32").judge(r["ratio_vs_fp32"]),
        Target(label, 1.0, text=f"{label} peak RSS <= fp32 (MB, mmap threshold pinned)")
        .judge(mem["peak_mb"] / mem32["peak_mb"]),
        Target(label, 1.0, text=f"{label} RSS growth during the run <= fp32 (MB, mmap threshold pinned)")
        .judge(mem["run_mb"] / max(1.0, mem32["run_mb"])),
        Target(label, SOLVED_BOUND if gap["solved"] else LOSS_BOUND,
               text=f"{label} final loss within 1% of fp32 after {gap['steps']} steps (the target is stated at 50: "
                    f"full mode){solved}").judge(gap["final_target_gap"]),
    ]


def _targets(results: list[dict], by_model_fp32: dict[str, dict]) -> list[dict]:
    """PASS/FAIL rows: time, memory and loss of the optimize() variants against fp32, and the ratio targets (a
    ratio missing its bound by less than the steps' spread is still a FAIL, marked within noise)."""
    targets = []
    for r in results:
        if r["variant"] != "fp32" and not VARIANTS[r["variant"]].slow:
            _print_loss(r)
        if r["variant"] in MEMORY_VARIANTS[1:] and "memory" in r:
            targets += _memory_targets(r, by_model_fp32[r["model"]])
    for model in dict.fromkeys(r["model"] for r in results):
        targets_here = RATIO_TARGETS + (ROOF_RATIO_TARGETS if MODELS[model].roof else ())
        for name, reference, bound, needs_bf16_units in targets_here:
            measured = _relative(results, model, name, reference)
            applies = (os.environ.get(CPU_ISA_ENV) == "avx2" if needs_bf16_units is None
                       else native_bf16() or not needs_bf16_units)
            if applies and measured is not None:
                text = f"{model} {name} step time <= {bound}x {reference}"
                targets.append(Target(text, bound, text=text).judge(*measured))
    for r in results:
        if r["variant"] == "optimize_bf16" and "share_of_bf16_roof" in r and native_bf16():
            text = f"{r['model']} optimize_bf16 step >= {ROOF_SHARE} of the bf16 matmul roof"
            targets.append(Target(text, ROOF_SHARE, ">=", text=text).judge(r["share_of_bf16_roof"]))
    return targets


def _roof(model_name: str, by_variant: dict[str, dict], roof: float) -> None:
    """The roof fields of a roof model's rows: its step's share of the bf16 matmul roof and the GEMM-only bound."""
    roof = max(roof, matmul_roof_gflops())  # before and after the interleaved steps: the better one
    flops, bound_s = step_flops(MODELS[model_name]), gemm_only_bound(MODELS[model_name])["seconds"]
    for r in by_variant.values():
        r["roof_gflops"], r["step_gflop"], r["gemm_only_s"] = roof, flops / 1e9, bound_s
        r["share_of_bf16_roof"] = flops / r["median_step_s"] / 1e9 / roof
        r["gemm_only_share_of_roof"] = flops / bound_s / 1e9 / roof


def plain_loop_agreement(model_name: str, by_variant: dict[str, dict], plain: dict[str, dict]) -> list[dict]:
    """Each variant's ratio to fp32 from the harness against the plain loop's: best / best and median / median."""
    rows = []
    for name, r in by_variant.items():
        if name == "fp32" or name not in plain or VARIANTS[name].slow:
            continue
        harness = {"best": r["min_step_s"] / by_variant["fp32"]["min_step_s"], "median": r["ratio_vs_fp32"]}
        loop = {"best": plain[name]["best_s"] / plain["fp32"]["best_s"],
                "median": plain[name]["median_s"] / plain["fp32"]["median_s"]}
        rows.append({"model": model_name, "variant": name, "harness_ratio": harness, "plain_loop_ratio": loop,
                     "agreement": {k: harness[k] / loop[k] for k in harness}})
        print(f"{model_name}/{name} x fp32: harness best {harness['best']:.3f} / median {harness['median']:.3f}; "
              f"plain loop best {loop['best']:.3f} / median {loop['median']:.3f}; harness / plain "
              f"{rows[-1]['agreement']['best']:.3f} (best), {rows[-1]['agreement']['median']:.3f} (median)",
              flush=True)
    return rows


def _agreement_targets(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        for kind, value in row["agreement"].items():
            text = f"{row['model']} {row['variant']}: harness ratio ({kind}) within {AGREEMENT:.0%} of the plain loop's"
            out.append(Target(text, AGREEMENT, text=text).judge(abs(value - 1)))
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"6 steps (one for slow variants), models {' '.join(QUICK_MODELS)}, compile variants only "
                             f"for {' '.join(n for n in QUICK_MODELS if not MODELS[n].large)}")
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--threads", type=int, help="torch threads per run (default: torch's default)")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default: 50, or 6 with --quick)")
    parser.add_argument("--steady", type=float, default=STEADY,
                        help="warm up until two consecutive steps agree within this fraction (default %(default)s; "
                             "0: only the fixed warm-up steps)")
    parser.add_argument("--max-warmup", type=int,
                        help=f"most warm-up steps per variant (default {MAX_WARMUP}; {QUICK_MAX_WARMUP} with --quick)")
    parser.add_argument("--check-plain-loop", action="store_true",
                        help=f"also time the same builders in one plain process ({PLAIN_WARMUP} warm-up steps, then "
                             f"the timed ones, variant after variant) and report the harness's agreement with it")
    parser.add_argument("--no-memory", action="store_true", help="leave out the memory phase")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        help=f"default: all; with --quick: {' '.join(QUICK_MODELS)}")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS),
                        help=f"default: all; with --quick: {' '.join(QUICK_VARIANTS)}")
    parser.add_argument("--cpu-isa", choices=("avx2",),
                        help="run as on an AVX2-only CPU without bf16 units: oneDNN, MKL, ATen and ipex_train "
                             "kernels limited to AVX2, optimize(bf16) on the emulated policy, torch's bf16 kernels "
                             "counted slow (sets " + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items())
                             + " for the workers)")
    return parser


def _run_model(model_name: str, args) -> tuple[dict[str, dict], list[dict]]:
    """One model: the interleaved variants, the roof fields, the memory phase, ratios and the plain-loop check."""
    variants = _variants_for(model_name, args.variants, args.quick)
    roof = matmul_roof_gflops() if MODELS[model_name].roof else None
    by_variant = {r["variant"]: r for r in run_model(model_name, variants, args.quick, args.threads, args.steps,
                                                     args.steady or None, args.max_warmup)}
    if roof is not None:
        _roof(model_name, by_variant, roof)
    if not args.no_memory:
        for name, mem in memory_run(model_name, args.variants, args.threads).items():
            by_variant[name]["memory"] = mem
    fp32 = by_variant["fp32"]
    for name, r in by_variant.items():
        r["ratio_vs_fp32"] = r["median_step_s"] / fp32["median_step_s"]
        r["cpu_ratio_vs_fp32"] = r["median_cpu_s"] / fp32["median_cpu_s"]
        if name != "fp32":
            r["loss_vs_fp32"] = _loss_gap(r["losses"], fp32["losses"])
    agreement = []
    if args.check_plain_loop:
        steps = len(fp32["step_times_s"])
        plain = run_plain_loop(model_name, [n for n in variants if not VARIANTS[n].slow], steps, PLAIN_WARMUP,
                               args.threads)
        for name, row in plain.items():
            by_variant[name]["plain_loop"] = row
        agreement = plain_loop_agreement(model_name, by_variant, plain)
    return by_variant, agreement


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.cpu_isa == "avx2":
        os.environ.update(AVX2_ENV)  # read by each worker's kernel libraries when they start
    args.variants = args.variants or list(QUICK_VARIANTS if args.quick else VARIANTS)
    args.models = args.models or list(QUICK_MODELS if args.quick else MODELS)
    if "fp32" not in args.variants:
        parser.error("--variants must include fp32, the reference for ratios and losses")

    started = time.perf_counter()
    results, by_model_fp32, agreement = [], {}, []
    for model_name in args.models:
        by_variant, rows = _run_model(model_name, args)
        by_model_fp32[model_name] = by_variant["fp32"]
        results += by_variant.values()
        agreement += rows

    print(_table(results))
    for r in results:
        if "share_of_bf16_roof" in r:
            print(f"{r['model']}/{r['variant']}: {r['step_gflop']:.0f} GFLOP per step (matmul-class) at "
                  f"{r['step_gflop'] / r['median_step_s']:.0f} GFLOP/s = {100 * r['share_of_bf16_roof']:.1f}% of the "
                  f"bf16 matmul roof measured in this run ({r['roof_gflops']:.0f} GFLOP/s, 2048^3); its products "
                  f"alone in bf16: {r['gemm_only_s']:.3f} s = {100 * r['gemm_only_share_of_roof']:.1f}% (the bound)")
    for r in results:
        copies = r.get("copies_per_step")
        if copies:
            print(f"{r['model']}/{r['variant']}: copies per step (one untimed step, as ATen sees them): "
                  + ", ".join(f"{name} {c['calls']} calls / {c['mib']:.0f} MiB" for name, c in copies.items()))
    targets = _targets(results, by_model_fp32) + _agreement_targets(agreement)
    print_targets(targets)
    load = os.getloadavg()
    print(f"total {time.perf_counter() - started:.0f} s; load average at end {load[0]:.1f} "
          f"(other processes on this machine skew step times)")
    meta = {"cpu_features": compute_policy._features(), "policy_here": compute_policy.info(), "quick": args.quick,
            "load_average_at_end": load, "cpu_isa_limit": args.cpu_isa,
            "limit_env": AVX2_ENV if args.cpu_isa else None, "steady": args.steady, "max_warmup": args.max_warmup}
    report.write(args.json, {"meta": meta, "results": results, "targets": targets, "plain_loop_agreement": agreement})


if __name__ == "__main__":
    main()
