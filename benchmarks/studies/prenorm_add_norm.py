"""Pre-norm residual add + LayerNorm (ViT's layers): torch's add and LayerNorm against
``ipex_train.add_norm.add_layer_norm_with_sum``, alone and in a whole ViT-B/16 training step.

``python -m benchmarks.studies.prenorm_add_norm [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5]
[--no-step] [--no-op]``

Why: the native policy routes Hugging Face pre-norm encoder layers (``ViTLayer`` and the classes with its forward)
to the fused op (:func:`ipex_train.compute_policy.routes_prenorm_add_norm`). This measures the evidence:

- op: forward + backward at ViT-B/16's shape, (4, 197, 768), bf16 x and residual, fp32 LayerNorm parameters (as
  optimize keeps them), p = 0 (ViT's default hidden dropout); both outputs used (y and the sum, as in the layer:
  gradients of both), torch (``s = x + residual; F.layer_norm(s)``) and fused called alternately in interleaved
  rounds (median ms, and the median of the per-round ratio fused / torch).
- step: a 12-layer ViT-B/16 (``ViTModel``, batch 4, 224x224, MSE loss on the last hidden state, SGD momentum) under
  ``optimize(dtype=bf16, bf16_compute="native")``, routed against the same model with ``routes_prenorm_add_norm``
  patched to False, steps interleaved with a second unrouted instance (``control``).

Backs docs/compute_policy.md, "Residual add + LayerNorm in pre-norm layers".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common.route_study import routed_step, run_study, step_line, step_row
from benchmarks.common.timing import interleaved

BF16 = torch.bfloat16
SHAPE = (4, 197, 768)


def _op_row(_, rounds: int) -> dict:
    from ipex_train.add_norm import add_layer_norm_with_sum

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=gen).to(BF16).requires_grad_()
    r = torch.randn(SHAPE, generator=gen).to(BF16).requires_grad_()
    w = torch.ones(SHAPE[-1], requires_grad=True)
    b = torch.zeros(SHAPE[-1], requires_grad=True)
    g, g_sum = (torch.randn(SHAPE, generator=gen).to(BF16) for _ in range(2))

    def unfused():
        s = x + r
        y = F.layer_norm(s, SHAPE[-1:], w, b, 1e-12)
        return torch.autograd.grad((y, s), (x, r, w, b), (g, g_sum))

    def fused():
        y, s = add_layer_norm_with_sum(x, r, w, b, 1e-12)
        return torch.autograd.grad((y, s), (x, r, w, b), (g, g_sum))

    rs = interleaved({"torch": unfused, "fused": fused}, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"torch_ms": med["torch"] * 1e3, "fused_ms": med["fused"] * 1e3, "ratio": rs.paired("fused", "torch").median}


def _vit_step(routed: bool):
    """A zero-argument step of a fresh ViT-B/16 under optimize(bf16, native), and how many layers it routes."""
    import transformers

    from ipex_train.compute_policy import _prenorm

    config = transformers.ViTConfig(attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(SHAPE[0], 3, 224, 224, generator=gen)
    target = torch.randn(SHAPE, generator=gen)
    return routed_step(lambda: transformers.ViTModel(config, add_pooling_layer=False),
                       lambda model: (model(pixel_values=pixels).last_hidden_state.float() - target).pow(2).mean(),
                       _prenorm, "prenorm_add_norm", routed)


def main(argv: list[str] | None = None) -> dict:
    """Time the op row and the step row, print them and return (and optionally write) the JSON."""
    return run_study(
        __doc__.splitlines()[0], op_cases=(SHAPE,), op_row=_op_row, op_header="",
        op_line=lambda row: (f"op {SHAPE} bf16, fp32 weight, grads of y and sum: torch {row['torch_ms']:.2f} ms, "
                             f"fused {row['fused_ms']:.2f} ms, ratio {row['ratio']:.3f}"),
        step_row_of=lambda _, rounds: step_row(_vit_step, rounds),
        step_line_of=lambda row: "ViT-B/16 " + step_line(row).lstrip(), meta={"shape": list(SHAPE)}, argv=argv)


if __name__ == "__main__":
    main()
