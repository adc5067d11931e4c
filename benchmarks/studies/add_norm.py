"""Dropout + residual add + LayerNorm: torch's three ops against ``ipex_train.add_norm``'s fused op, alone and in a
whole BERT-base training step.

``python -m benchmarks.studies.add_norm [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5] [--no-step]
[--no-op]``

Why: the native policy routes Hugging Face post-norm output blocks (``BertSelfOutput`` / ``BertOutput``) to the fused
op (:func:`ipex_train.compute_policy.routes_add_norm`). This measures the evidence on the machine at hand:

- op: forward + backward (grads of x, residual, weight and bias) at BERT-base's shape, (8, 128, 768), bf16 x, fp32
  LayerNorm parameters (as optimize keeps them), a bf16 residual (models fed input_ids) and an fp32 one (models whose
  embeddings stay fp32), dropout p = 0 and 0.1; torch (``F.layer_norm(F.dropout(x) + residual)``) and fused called
  alternately in interleaved rounds (median ms, and the median of the per-round ratio fused / torch).
- step: a 12-layer BERT-base (``BertModel``, b8 s128, input_ids, MSE loss on the last hidden state, SGD momentum)
  under ``optimize(dtype=bf16, bf16_compute="native")``, routed against the same model with ``routes_add_norm``
  patched to False, hidden dropout 0.0 and 0.1 (attention dropout 0), steps interleaved with a second unrouted
  instance (``control``: the ratio two identical models give here).

Backs docs/compute_policy.md, "Dropout + residual add + LayerNorm".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common.route_study import routed_step, run_study, step_row
from benchmarks.common.timing import interleaved

BF16 = torch.bfloat16
SHAPE = (8, 128, 768)


def _op_row(residual_dtype: torch.dtype, p: float, rounds: int) -> dict:
    from ipex_train.add_norm import add_layer_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=gen).to(BF16).requires_grad_()
    r = torch.randn(SHAPE, generator=gen).to(residual_dtype).requires_grad_()
    w = torch.ones(SHAPE[-1], requires_grad=True)
    b = torch.zeros(SHAPE[-1], requires_grad=True)
    g = torch.randn(SHAPE, generator=gen).to(residual_dtype)

    def unfused():
        y = F.layer_norm(F.dropout(x, p, True) + r, SHAPE[-1:], w, b, 1e-12)
        return torch.autograd.grad(y, (x, r, w, b), g)

    def fused():
        y = add_layer_norm(x, r, w, b, 1e-12, p, True)
        return torch.autograd.grad(y, (x, r, w, b), g)

    rs = interleaved({"torch": unfused, "fused": fused}, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"residual": str(residual_dtype).replace("torch.", ""), "p": p, "torch_ms": med["torch"] * 1e3,
            "fused_ms": med["fused"] * 1e3, "ratio": rs.paired("fused", "torch").median}


def _bert_step(dropout: float, routed: bool):
    """A zero-argument step of a fresh 12-layer BERT-base under optimize(bf16, native), and its routed blocks."""
    import transformers

    from ipex_train.compute_policy import _add_norm

    config = transformers.BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, SHAPE[:2], generator=gen)
    target = torch.randn(SHAPE, generator=gen)
    return routed_step(lambda: transformers.BertModel(config, add_pooling_layer=False),
                       lambda model: (model(input_ids=ids).last_hidden_state.float() - target).pow(2).mean(),
                       _add_norm, "add_norm", routed)


def _step_row(dropout: float, rounds: int) -> dict:
    return {"hidden_dropout": dropout, **step_row(lambda routed: _bert_step(dropout, routed), rounds)}


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step rows, print tables and return (and optionally write) the JSON."""
    return run_study(
        __doc__.splitlines()[0],
        op_cases=[(r, p) for r in (BF16, torch.float32) for p in (0.0, 0.1)],
        op_row=lambda case, rounds: _op_row(*case, rounds),
        op_header=f"op {SHAPE} bf16 x, fp32 weight: {'residual':>9}{'p':>5}{'torch':>9}{'fused':>9}{'ratio':>7}  (ms)",
        op_line=lambda row: (f"{'':<34}{row['residual']:>9}{row['p']:>5}{row['torch_ms']:9.2f}{row['fused_ms']:9.2f}"
                             f"{row['ratio']:7.3f}"),
        step_cases=(0.0, 0.1), step_row_of=_step_row,
        step_header=(f"BERT-base step b8 s128: {'dropout':>8}{'unrouted':>10}{'routed':>9}{'ratio':>7}{'spread':>8}"
                     f"{'control':>9}{'ratio':>7}  (ms)"),
        step_line_of=lambda row: (f"{'':<23}{row['hidden_dropout']:>8}{row['unrouted_ms']:10.1f}"
                                  f"{row['routed_ms']:9.1f}{row['ratio']:7.3f}{row['ratio_spread']:8.3f}"
                                  f"{row['control_ms']:9.1f}{row['control_ratio']:7.3f}"),
        meta={"shape": list(SHAPE)}, argv=argv)


if __name__ == "__main__":
    main()
