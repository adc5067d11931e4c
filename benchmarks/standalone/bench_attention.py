"""Forward + backward time of one attention at training shapes: ipex_train.attention against torch's attention in
bf16 (the backend torch picks: flash, or math with dropout; and its math backend) and in fp32. The routing rule of
docs/attention.md comes from this table.

Run from the repository root (on a quiet machine)::

    python -m benchmarks.standalone.bench_attention [--threads 2] [--json out.json]

Inputs are in Hugging Face's layout ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)); each time is the
best of 3 rounds of ``--repeats`` calls, the variants interleaved round by round.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ipex_train import attention

from ..common import report
from ..common.timing import best_of_rounds

# (batch, heads, query/key length, head dim, dropout, causal)
SHAPES = (
    (8, 12, 128, 64, 0.0, False),
    (8, 12, 128, 64, 0.1, False),
    (4, 12, 197, 64, 0.0, False),
    (4, 12, 256, 64, 0.0, True),
    (8, 12, 256, 64, 0.0, False),
    (4, 12, 512, 64, 0.0, False),
    (2, 12, 1024, 64, 0.0, False),
    (1, 12, 2048, 64, 0.0, True),
)


def _inputs(b, h, s, d, dtype):
    return [torch.randn(b, s, h, d).to(dtype).transpose(1, 2).requires_grad_() for _ in range(3)]


def _variants(b, h, s, d, p, causal):
    bf16 = _inputs(b, h, s, d, torch.bfloat16)
    fp32 = _inputs(b, h, s, d, torch.float32)
    grad16 = torch.randn(b, h, s, d).to(torch.bfloat16)
    grad32 = grad16.float()

    def run(fn, args, grad, backend=None):
        def call():
            if backend is None:
                out = fn(*args, dropout_p=p, is_causal=causal)
            else:
                with sdpa_kernel(backend):
                    out = fn(*args, dropout_p=p, is_causal=causal)
            out.backward(grad)
        return call

    return {
        "ipex_train bf16": run(attention.scaled_dot_product_attention, bf16, grad16),
        # torch's own choice (its flash kernel, or math where flash does not apply: dropout) and its math backend.
        "torch bf16": run(F.scaled_dot_product_attention, bf16, grad16),
        "torch bf16 math": run(F.scaled_dot_product_attention, bf16, grad16, SDPBackend.MATH),
        "torch fp32": run(F.scaled_dot_product_attention, fp32, grad32),
    }


def main(argv=None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for shape in SHAPES:
        b, h, s, d, p, causal = shape
        variants = _variants(*shape)
        best = best_of_rounds(variants, rounds=3, repeats=args.repeats)
        flops = 6 * 2 * b * h * s * s * d * (0.5 if causal else 1.0)  # 2 products forward, 4 backward
        row = {"batch": b, "heads": h, "seq": s, "head_dim": d, "dropout": p, "causal": causal,
               "ms": {k: 1e3 * v for k, v in best.items()},
               "ipex_train_gflops": flops / best["ipex_train bf16"] / 1e9,
               "routed_to_ipex_train": s <= attention.MAX_KEYS}
        rows.append(row)
        cells = "  ".join(f"{k} {v:7.2f}" for k, v in row["ms"].items())
        print(f"b{b} h{h} s{s} d{d} p{p} causal={causal}: {cells} ms; ipex_train {row['ipex_train_gflops']:.0f} "
              "GFLOP/s", flush=True)
    report.write(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
