"""A Llama decoder layer's residual add + post-attention RMSNorm: torch's ops, torch's add then
``ipex_train.rms_norm``, and ``ipex_train.rms_norm.add_rms_norm``'s fused op, alone and in a whole Llama training step.

``python -m benchmarks.studies.add_rms_norm [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5]
[--no-step] [--no-op]``

Why: the native policy routes Hugging Face Llama-family decoder layers to the fused op
(:func:`ipex_train.compute_policy.routes_add_rms_norm`). This measures the evidence on the machine at hand:

- op: forward + backward (grads of x, the residual and the weight, upstream gradients for y and the sum), bf16
  activations and weight, at (1, 2048, 768); the three called in interleaved rounds (median ms, and the median of
  the per-round ratios to torch).
- step: the benchmark suite's ``llama_s256`` model under ``optimize(dtype=bf16, bf16_compute="native")`` (every
  other route on), routed against the same model with ``routes_add_rms_norm`` patched to False, steps interleaved
  with a second unrouted instance (``control``: the ratio two identical models give here).

Backs docs/compute_policy.md, "Residual add + RMSNorm".
"""
from __future__ import annotations

import torch

from benchmarks.common.route_study import route_step_row, run_study
from benchmarks.common.timing import interleaved

BF16 = torch.bfloat16
OP_SHAPES = ((1, 2048, 768),)


def _op_row(shape: tuple, rounds: int) -> dict:
    from ipex_train.rms_norm import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 2).to(BF16).requires_grad_()
    r = torch.randn(shape, generator=gen).to(BF16).requires_grad_()
    w = (torch.randn(shape[-1], generator=gen) * 0.1 + 1).to(BF16).requires_grad_()
    gy, gs = (torch.randn(shape, generator=gen).to(BF16) for _ in range(2))

    def plain():  # LlamaDecoderLayer's `residual + h` and LlamaRMSNorm's formula in torch ops
        s = r + x
        h = s.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.autograd.grad((w * h.to(BF16), s), (x, r, w), (gy, gs))

    def add_then_op():
        s = r + x
        return torch.autograd.grad((rms_norm(s, w, 1e-6), s), (x, r, w), (gy, gs))

    def fused():
        return torch.autograd.grad(add_rms_norm(x, r, w, 1e-6), (x, r, w), (gy, gs))

    rs = interleaved({"torch": plain, "add_op": add_then_op, "fused": fused}, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"shape": list(shape), "torch_ms": med["torch"] * 1e3, "add_op_ms": med["add_op"] * 1e3,
            "fused_ms": med["fused"] * 1e3, "ratio_torch": rs.paired("fused", "torch").median,
            "ratio_add_op": rs.paired("fused", "add_op").median}


def _step_row(rounds: int) -> dict:
    from ipex_train.compute_policy import _add_rms_norm

    return route_step_row("llama_s256", _add_rms_norm, "add_rms_norm", rounds)


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step row, print tables and return (and optionally write) the JSON."""
    return run_study(
        __doc__.splitlines()[0], op_cases=OP_SHAPES, op_row=_op_row,
        op_header=(f"op bf16 fwd+bwd: {'shape':>16}{'torch':>9}{'add+op':>9}{'fused':>9}{'/torch':>8}"
                   f"{'/add+op':>8}  (ms)"),
        op_line=lambda row: (f"{'':<17}{str(tuple(row['shape'])):>16}{row['torch_ms']:9.2f}{row['add_op_ms']:9.2f}"
                             f"{row['fused_ms']:9.2f}{row['ratio_torch']:8.3f}{row['ratio_add_op']:8.3f}"),
        step_row_of=lambda _, rounds: _step_row(rounds), argv=argv)


if __name__ == "__main__":
    main()
