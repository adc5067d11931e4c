"""Patch embeddings (a Conv2d whose stride equals its kernel): torch's bf16 convolution against the native policy's
GEMM over the unfolded patches.

``python -m benchmarks.studies.patch_embedding [--json PATH] [--threads N]``

Why: the native policy routes such convolutions (:func:`ipex_train.compute_policy.routes_patch_embedding`) to
``ipex_train.compute_policy._patch_embed.patch_conv``. This measures the evidence on the machine at hand: per shape
(ViT-B/16, ViT-L/16, ViT-H/14 stems at 224 px), the median time of forward + backward (the image needs no grad, as
in training: grads of weight and bias) and of a no-grad forward, the two alternated call by call in one process.
A ratio below 1 means the GEMM is faster. Backs docs/compute_policy.md, "Patch embeddings".
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import report
from benchmarks.common.timing import interleaved
from ipex_train.compute_policy._patch_embed import patch_conv

# (batch, channels, image size, embedding width, patch)
SHAPES = [(4, 3, 224, 768, 16), (8, 3, 224, 768, 16), (4, 3, 224, 1024, 16), (4, 3, 224, 1280, 14)]


def _time(batch: int, c: int, size: int, width: int, patch: int, repeats: int) -> dict:
    x = torch.randn(batch, c, size, size).to(torch.bfloat16)
    w = (torch.randn(width, c, patch, patch) * 0.02).to(torch.bfloat16).requires_grad_()
    b = torch.zeros(width, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, width, size // patch, size // patch).to(torch.bfloat16)

    def conv():
        return F.conv2d(x, w, b, stride=patch)

    def gemm():
        return patch_conv(x, w, b)

    def train(fn):
        return lambda: torch.autograd.grad(fn(), (w, b), grad)

    def infer(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    # Two warm-up rounds: oneDNN creates its primitives on the first calls.
    med = interleaved({"conv_train": train(conv), "gemm_train": train(gemm), "conv_forward": infer(conv),
                       "gemm_forward": infer(gemm)}, repeats, warmup=2).median()
    return {k: v * 1e3 for k, v in med.items()}


def main(argv: list[str] | None = None) -> dict:
    """Time every shape, print a table and return (and optionally write) the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'shape':<24}{'conv fwd+bwd':>13}{'GEMM':>8}{'ratio':>7}{'conv fwd':>10}{'GEMM':>8}{'ratio':>7}  (ms)")
    for shape in SHAPES:
        ms = _time(*shape, args.repeats)
        row = {"batch": shape[0], "channels": shape[1], "size": shape[2], "width": shape[3], "patch": shape[4],
               **{f"{k}_ms": v for k, v in ms.items()},
               "train_ratio": ms["gemm_train"] / ms["conv_train"],
               "forward_ratio": ms["gemm_forward"] / ms["conv_forward"]}
        rows.append(row)
        label = f"b{shape[0]} {shape[2]}px w{shape[3]} p{shape[4]}"
        print(f"{label:<24}{ms['conv_train']:13.2f}{ms['gemm_train']:8.2f}{row['train_ratio']:7.2f}"
              f"{ms['conv_forward']:10.2f}{ms['gemm_forward']:8.2f}{row['forward_ratio']:7.2f}", flush=True)
    return report.write(args.json, {"meta": {"threads": torch.get_num_threads()}, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
