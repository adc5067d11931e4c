"""Does bench_train_step agree with itself and with a plain loop? Compares reports of back-to-back runs made with
``--check-plain-loop``: per model and variant, each run's ratio to fp32 and to autocast (median / median, and
best / best), how far the runs are apart, and each run's harness / plain-loop agreement.

    python -m benchmarks.suite.bench_train_step --models bert_base --variants fp32 autocast_bf16 optimize_bf16 \\
        --threads 2 --steps 4 --max-warmup 4 --no-memory --check-plain-loop --json run1.json   # then run2.json
    python -m benchmarks.studies.train_step_agreement run1.json run2.json [--json PATH]

It backs docs/benchmarks.md, "The train-step harness: agreement with itself and with a plain loop".
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import report

REFERENCES = ("fp32", "autocast_bf16")


def ratios(data: dict) -> dict[tuple[str, str, str, str], float]:
    """(model, variant, reference, 'median' or 'best') -> the run's step-time ratio."""
    by_model: dict[str, dict[str, dict]] = {}
    for r in data["results"]:
        by_model.setdefault(r["model"], {})[r["variant"]] = r
    out = {}
    for model, rows in by_model.items():
        for name, r in rows.items():
            for ref in REFERENCES:
                if ref in rows and ref != name and "median_step_s" in rows[ref]:
                    out[(model, name, ref, "median")] = r["median_step_s"] / rows[ref]["median_step_s"]
                    out[(model, name, ref, "best")] = r["min_step_s"] / rows[ref]["min_step_s"]
    return out


def compare(runs: list[dict]) -> dict:
    """Per ratio: each run's value and the spread between runs (largest / smallest - 1); and each run's plain-loop
    agreement rows as the benchmark wrote them."""
    per_run = [ratios(d) for d in runs]
    keys = [k for k in per_run[0] if all(k in r for r in per_run)]
    rows = []
    for key in keys:
        values = [r[key] for r in per_run]
        rows.append({"model": key[0], "variant": key[1], "reference": key[2], "kind": key[3], "runs": values,
                     "between_runs": max(values) / min(values) - 1})
    return {"ratios": rows, "plain_loop": [d.get("plain_loop_agreement", []) for d in runs]}


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="bench_train_step JSON reports, in run order")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    runs = [json.loads(p.read_text()) for p in args.reports]
    result = compare(runs)
    for r in result["ratios"]:
        values = " ".join(f"{v:.3f}" for v in r["runs"])
        print(f"{r['model']}/{r['variant']} x {r['reference']} ({r['kind']}): runs {values}; apart "
              f"{r['between_runs']:.1%}")
    for i, rows in enumerate(result["plain_loop"], 1):
        for row in rows:
            a = row["agreement"]
            print(f"run {i}: {row['model']}/{row['variant']} harness / plain loop: best {a['best']:.3f}, "
                  f"median {a['median']:.3f}")
    return report.write(args.json, {"reports": [str(p) for p in args.reports], **result})


if __name__ == "__main__":
    main()
