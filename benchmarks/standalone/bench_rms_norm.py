"""Forward and forward + backward time of one RMSNorm on bf16 and fp32 activations: ipex_train.rms_norm against
Hugging Face's LlamaRMSNorm (torch ops under autograd) and torch's ``F.rms_norm``, on the same input and weight.

Run from the repository root (on a quiet machine)::

    python -m benchmarks.standalone.bench_rms_norm [--threads 2] [--steps 6] [--json out.json]

Each time is the best of 5 rounds of ``--repeats`` calls, the variants interleaved round by round. The fp32 rows
take fp32 input and an fp32 weight (as the norms of an fp32-fed model under ``optimize``, or under autocast).

``--steps N`` also times N train steps (median) of benchmarks/common/train_models.py's ``llama_s256`` model under
``optimize(bf16)`` (native policy), routed against the same model with the policy's RMSNorm routing removed,
alternating step by step: fed bf16 embeddings (its RMSNorms see bf16 activations) and fed fp32 embeddings as
benchmarks/suite/bench_train_step.py feeds it (the residual stream and so every RMSNorm stay fp32).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ipex_train.rms_norm import rms_norm

from ..common import report
from ..common.timing import best_of_rounds, interleaved

# (batch, sequence, hidden): benchmarks/common/train_models.py's llama_s256 activations, and a wider model's.
SHAPES = ((4, 256, 768), (2, 512, 2048))


def _variants(shape):
    hf = LlamaRMSNorm(shape[-1], eps=1e-6).to(torch.bfloat16)
    hf32 = LlamaRMSNorm(shape[-1], eps=1e-6)
    x = torch.randn(shape).to(torch.bfloat16).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    grad = torch.randn(shape).to(torch.bfloat16)
    fns = {
        "hf LlamaRMSNorm": hf,
        "ipex_train.rms_norm": lambda t: rms_norm(t, hf.weight, hf.variance_epsilon),
        "torch F.rms_norm": lambda t: F.rms_norm(t, (shape[-1],), hf.weight, hf.variance_epsilon),
        "hf LlamaRMSNorm fp32": lambda t: hf32(x32),
        "ipex_train.rms_norm fp32": lambda t: rms_norm(x32, hf32.weight, hf32.variance_epsilon),
    }

    def forward(fn):
        def call():
            with torch.no_grad():
                fn(x)
        return call

    def forward_backward(fn):
        def call():
            out = fn(x)
            out.backward(grad.to(out.dtype))
        return call

    out = {}
    for name, fn in fns.items():
        out[f"{name} fwd"] = forward(fn)
        out[f"{name} fwd+bwd"] = forward_backward(fn)
    return out


def _steps(n: int, dtype: torch.dtype) -> dict:
    import ipex_train
    from benchmarks.common.train_models import LlamaLike
    from ipex_train import compute_policy

    torch.manual_seed(0)
    model = LlamaLike()
    model, optimizer = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=1e-3), dtype=torch.bfloat16,
                                           bf16_compute="native")
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    routed = {m: m.forward for m in norms}  # the policy's instance-level forwards
    x = torch.randn(4, 256, 768).to(dtype)
    y = torch.randint(0, 10, (4,))

    def step():
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def set_routed(on: bool):
        for m in norms:
            if on:
                m.forward = routed[m]
            else:
                vars(m).pop("forward", None)

    def routed_step(on: bool):
        set_routed(on)
        step()

    timed = interleaved({"routed": lambda: routed_step(True), "not routed": lambda: routed_step(False)}, n)
    set_routed(True)
    assert all(compute_policy.routes_rms_norm(m) is False for m in norms)
    return {k: 1e3 * v for k, v in timed.median().items()}


def main(argv=None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for shape in SHAPES:
        variants = _variants(shape)
        best = best_of_rounds(variants, rounds=5, repeats=args.repeats)
        row = {"shape": list(shape), "ms": {k: 1e3 * v for k, v in best.items()}}
        rows.append(row)
        print(f"{tuple(shape)}: " + "  ".join(f"{k} {v:.3f}" for k, v in row["ms"].items()) + " ms", flush=True)
    steps = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)) if args.steps else ():
        steps[name] = _steps(args.steps, dtype)
        print(f"llama_s256 train step fed {name} embeddings, median ms: "
              + "  ".join(f"{k} {v:.1f}" for k, v in steps[name].items()), flush=True)
    report.write(args.json, {"rows": rows, "llama_s256_step_ms": steps or None})


if __name__ == "__main__":
    main()
