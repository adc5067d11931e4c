"""SwiGLU's gating: torch's ``F.silu(gate) * up`` against ``ipex_train.swiglu``'s fused op, alone and in a whole
Llama training step.

``python -m benchmarks.studies.swiglu [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5] [--no-step]
[--no-op]``

Why: the native policy routes Hugging Face Llama-family MLPs to the fused op
(:func:`ipex_train.compute_policy.routes_swiglu`). This measures the evidence on the machine at hand:

- op: forward + backward (grads of gate and up), bf16, at (1, 2048, 2048) and (4, 256, 2048) (a Llama MLP of
  intermediate size 2048 over 2048 and 1024 tokens); torch and fused called alternately in interleaved rounds
  (median ms, and the median of the per-round ratio fused / torch).
- step: the benchmark suite's ``llama_s256`` model (8-layer Llama, hidden 768, MLP 2048, b4 s256, fed embeddings)
  under ``optimize(dtype=bf16, bf16_compute="native")``, MSE on its head, SGD momentum; routed against the same
  model with ``routes_swiglu`` patched to False, steps interleaved with a second unrouted instance (``control``:
  the ratio two identical models give here).

Backs docs/compute_policy.md, "SwiGLU".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common.route_study import route_step_row, run_two_column_study
from benchmarks.common.timing import interleaved

BF16 = torch.bfloat16
OP_SHAPES = ((1, 2048, 2048), (4, 256, 2048))


def _op_row(shape: tuple, rounds: int) -> dict:
    from ipex_train.swiglu import silu_mul

    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=gen) * 2).to(BF16).requires_grad_()
    up = torch.randn(shape, generator=gen).to(BF16).requires_grad_()
    g = torch.randn(shape, generator=gen).to(BF16)

    def unfused():
        return torch.autograd.grad(F.silu(gate) * up, (gate, up), g)

    def fused():
        return torch.autograd.grad(silu_mul(gate, up), (gate, up), g)

    rs = interleaved({"torch": unfused, "fused": fused}, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"shape": list(shape), "torch_ms": med["torch"] * 1e3, "fused_ms": med["fused"] * 1e3,
            "ratio": rs.paired("fused", "torch").median}


def _step_row(rounds: int) -> dict:
    from ipex_train.compute_policy import _swiglu

    return route_step_row("llama_s256", _swiglu, "swiglu", rounds)


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step row, print tables and return (and optionally write) the JSON."""
    return run_two_column_study(__doc__.splitlines()[0], OP_SHAPES, _op_row, _step_row, "shape", argv)


if __name__ == "__main__":
    main()
