"""Which IPEX FP32/BF16 oneDNN Graph fusion patterns this torch build and CPU fuse, measured by exporting each one.

    python -m benchmarks.studies.onednn_pattern_survey [--json PATH] [--dtype float32|bfloat16 ...]

Prints one line per pattern and dtype (fused / partial / not fused, with the groups formed) and a summary; the
JSON holds the full result with the torch version, date and CPU capability. The list in the docstring of
ipex_train/inference/jit.py comes from this script; it backs docs/benchmarks.md, "Studies" (the survey's row).
"""
import argparse

import torch

from benchmarks.common import report
from ipex_train.inference import patterns


def run(args):
    """Survey the patterns in args.dtype; returns the result dict (also written to args.json when given)."""
    dtypes = [getattr(torch, name) for name in args.dtype]
    results = patterns.survey(dtypes)
    summary = {}
    for dtype, by_pattern in results.items():
        for name, result in by_pattern.items():
            print(f"{dtype:9s} {name:36s} {result['status']:10s} {' | '.join(result['groups'])}")
        summary[dtype] = {status: sorted(n for n, r in by_pattern.items() if r["status"] == status)
                          for status in ("fused", "partial", "not fused")}
    for dtype, groups in summary.items():
        print(f"\n{dtype}: " + ", ".join(f"{len(names)} {status}" for status, names in groups.items()))
        for status in ("partial", "not fused"):
            print(f"  {status}: {', '.join(groups[status]) or '-'}")
    return report.write(args.json, {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16_supported": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "summary": summary,
        "results": results,
    }, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the full result here")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
