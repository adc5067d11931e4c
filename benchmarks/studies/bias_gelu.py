"""Bias + GELU of a BERT intermediate block: torch's ``F.gelu(F.linear(x, w, b))`` (addmm, gelu; backward
gelu_backward and the bias's sum) against the route's ``gelu_with_bias_grad(F.linear(x, w, b.detach()), b)`` (the
same forward, the backward one pass with the bias's gradient), alone and in a whole BERT training step; the op rows
also time ``bias_gelu(F.linear(x, w), b)`` (the GEMM without its bias, then one pass each way: ``one_pass``).

``python -m benchmarks.studies.bias_gelu [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5] [--no-step]
[--no-op]``

Why: the native policy routes Hugging Face BERT-style intermediate blocks to the fused op
(:func:`ipex_train.compute_policy.routes_bias_gelu`). This measures the evidence on the machine at hand:

- op: forward + backward (grads of x, w and b), bf16, BERT-base's up-projection (8 x 128 tokens, 768 -> 3072); the
  three called alternately in interleaved rounds (median ms, and the median of the per-round ratio to torch's).
- step: the benchmark suite's ``bert_like`` model (4 BERT-base layers, b8 s128, fed embeddings) under
  ``optimize(dtype=bf16, bf16_compute="native")``, MSE on its head, SGD momentum; routed against the same model with
  ``routes_bias_gelu`` patched to False, steps interleaved with a second unrouted instance (``control``: the ratio
  two identical models give here).

Backs docs/compute_policy.md, "Bias + GELU".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common.route_study import linear_operands, route_step_row, run_two_column_study
from benchmarks.common.timing import interleaved

OP_SHAPES = ((8 * 128, 768, 3072),)  # tokens, in, out


def _op_row(shape: tuple, rounds: int) -> dict:
    from ipex_train.bias_gelu import bias_gelu, gelu_with_bias_grad

    x, w, b, g = linear_operands(*shape)

    def unfused():
        return torch.autograd.grad(F.gelu(F.linear(x, w, b)), (x, w, b), g)

    def fused():
        return torch.autograd.grad(gelu_with_bias_grad(F.linear(x, w, b.detach()), b), (x, w, b), g)

    def one_pass():
        return torch.autograd.grad(bias_gelu(F.linear(x, w), b), (x, w, b), g)

    rs = interleaved({"torch": unfused, "fused": fused, "one_pass": one_pass}, rounds, repeats=3, warmup=3)
    med = rs.median()
    row = {"shape": list(shape), "torch_ms": med["torch"] * 1e3, "fused_ms": med["fused"] * 1e3,
           "ratio": rs.paired("fused", "torch").median, "one_pass_ms": med["one_pass"] * 1e3,
           "one_pass_ratio": rs.paired("one_pass", "torch").median}
    return {**row, **_passes(x, w, b, g, rounds)}


def _passes(x, w, b, g, rounds: int) -> dict:
    """The passes around the GEMM alone (forward, then backward with the bias's gradient), on the same operands:
    torch's (gelu; gelu_backward, sum), the route's (gelu; the kernel's backward) and one_pass's (the kernel both
    ways). The GEMMs dominate the op rows; these isolate what the variants change."""
    with torch.no_grad():
        y = F.linear(x, w)
        pre = F.linear(x, w, b)
    zero = torch.zeros_like(b)
    fw, bw = torch.ops.ipex_train.bias_gelu_forward, torch.ops.ipex_train.bias_gelu_backward
    rs = interleaved({
        "torch": lambda: (F.gelu(pre), torch.ops.aten.gelu_backward(g, pre), g.sum(0)),
        "fused": lambda: (F.gelu(pre), bw(g, pre, zero)),
        "one_pass": lambda: (fw(y, b), bw(g, y, b)),
    }, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"passes_torch_ms": med["torch"] * 1e3, "passes_fused_ms": med["fused"] * 1e3,
            "passes_one_pass_ms": med["one_pass"] * 1e3, "passes_ratio": rs.paired("fused", "torch").median,
            "passes_one_pass_ratio": rs.paired("one_pass", "torch").median}


def _step_row(rounds: int) -> dict:
    from ipex_train.compute_policy import _bias_gelu

    return route_step_row("bert_like", _bias_gelu, "bias_gelu", rounds)


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step row, print tables and return (and optionally write) the JSON."""
    return run_two_column_study(__doc__.splitlines()[0], OP_SHAPES, _op_row, _step_row, "tokens, in, out", argv)


if __name__ == "__main__":
    main()
