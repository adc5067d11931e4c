"""Linear layers with a bias: torch's ``F.linear`` (bf16 on CPU: addmm, which copies the bias into the whole output
before the GEMM) against ``ipex_train.linear.linear`` (oneDNN's matmul with the bias in its epilogue, addmm's
backward), alone and in whole training steps.

``python -m benchmarks.studies.linear_bias [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5] [--no-step]
[--no-op]``

Why: the native policy routes ``nn.Linear`` modules with a bias, and the linears its other routes compute, to the op
(:func:`ipex_train.compute_policy.routes_linear`). This measures the evidence on the machine at hand:

- op: forward alone and forward + backward (grads of x, weight and bias), bf16, at BERT-base's shapes (8 x 128
  tokens: 768 -> 768, 768 -> 3072, 3072 -> 768) and ViT-B/16's packed attention projection (4 x 197 tokens,
  768 -> 2304); torch and ours called alternately in interleaved rounds (median ms, median of the per-round ratio).
- step: the benchmark suite's ``bert_base_tokens`` and ``vit_b16`` under ``optimize(dtype=bf16,
  bf16_compute="native")``, MSE on the head, SGD momentum; with the op against the same model with every linear on
  ``F.linear`` (the op's probe patched to fail, every other route on), steps interleaved with a second instance
  without the op (``control``: the ratio two identical models give here).

Backs docs/compute_policy.md, "Linear layers with a bias".
"""
from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.common.route_study import linear_operands, patched_suite_step, run_study, step_line
from benchmarks.common.timing import interleaved, routed_against_unrouted

OP_SHAPES = ((8 * 128, 768, 768), (8 * 128, 768, 3072), (8 * 128, 3072, 768), (4 * 197, 768, 2304))
STEP_MODELS = ("bert_base_tokens", "vit_b16")


def _op_row(shape: tuple, rounds: int) -> dict:
    from ipex_train.linear import linear

    x, w, b, g = linear_operands(*shape)
    calls = {"torch_fwd": lambda: F.linear(x.detach(), w.detach(), b.detach()),
             "ours_fwd": lambda: linear(x.detach(), w.detach(), b.detach()),
             "torch": lambda: torch.autograd.grad(F.linear(x, w, b), (x, w, b), g),
             "ours": lambda: torch.autograd.grad(linear(x, w, b), (x, w, b), g)}
    rs = interleaved(calls, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"shape": list(shape), **{f"{name}_ms": med[name] * 1e3 for name in calls},
            "fwd_ratio": rs.paired("ours_fwd", "torch_fwd").median, "ratio": rs.paired("ours", "torch").median}


def _op_line(r: dict) -> str:
    return (f"  {str(tuple(r['shape'])):>20}  forward {r['torch_fwd_ms']:7.3f} {r['ours_fwd_ms']:7.3f} "
            f"({r['fwd_ratio']:.3f})  forward + backward {r['torch_ms']:7.3f} {r['ours_ms']:7.3f} ({r['ratio']:.3f})")


def _suite_step(model_name: str, with_op: bool):
    """A step of the suite's ``model_name`` with its linears through the op, or (its probe patched to fail) all
    through ``F.linear``; and how many modules the linear route holds."""
    import ipex_train
    from ipex_train import linear

    patches = () if with_op else (mock.patch.object(linear, "_probe", lambda: False),)
    step, model = patched_suite_step(model_name, patches)
    return step, ipex_train.compute_policy.routed_modules(model).get("linear", 0)


def _step_row(model_name: str, rounds: int) -> dict:
    ours, n_routed = _suite_step(model_name, True)
    plain, _ = _suite_step(model_name, False)
    control, _ = _suite_step(model_name, False)
    return {"model": model_name, "modules_routed": n_routed, "modules_routed_in_unrouted": n_routed,
            **routed_against_unrouted(ours, plain, control, rounds)}


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step rows, print them and return (and optionally write) the JSON."""
    return run_study(
        __doc__.splitlines()[0], op_cases=OP_SHAPES, op_row=_op_row,
        op_header="op, bf16, ms: (tokens, in, out)  forward torch ours (ratio)  forward + backward torch ours (ratio)",
        op_line=_op_line, step_cases=STEP_MODELS, step_row_of=_step_row,
        step_header="step, ms: 'routed' = linears through the op, 'unrouted' = all F.linear", step_line_of=step_line,
        argv=argv)


if __name__ == "__main__":
    main()
