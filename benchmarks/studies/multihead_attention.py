"""``nn.MultiheadAttention`` self-attention: the class's forward (torch's sequence-first functional around
ipex_train's attention) against the native policy's route on the batch-first layout, alone and in whole training
steps.

``python -m benchmarks.studies.multihead_attention [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5]
[--no-step] [--no-op]``

Why: the native policy routes ``nn.MultiheadAttention`` self-attention calls
(:func:`ipex_train.compute_policy.routes_multihead_attention`). This measures the evidence:

- op: forward + backward of one module under ``optimize(dtype=bf16, bf16_compute="native")``, routed against the
  same module with the route switched off, called alternately in interleaved rounds (median ms, and the median of the
  per-round ratio routed / class): ViT-B/16's attention (batch 4, 197 tokens, width 768, 12 heads, batch-first) and
  an ``nn.TransformerEncoderLayer``-style one (batch 8, 256 tokens, width 512, 8 heads, sequence-first, a boolean key
  padding mask).
- step: torchvision's ViT-B/16 of bench_train_step (batch 4, 224 px, SGD) routed against the same model with the
  route off, steps interleaved with a second unrouted instance (``control``).

Backs docs/compute_policy.md, "nn.MultiheadAttention self-attention".
"""
from __future__ import annotations

from unittest import mock

import torch

from benchmarks.common.route_study import route_step_row, run_study, step_line
from benchmarks.common.timing import interleaved

BF16 = torch.bfloat16
# (batch, seq, width, heads, batch_first, key padding mask)
OP_CASES = ((4, 197, 768, 12, True, False), (8, 256, 512, 8, False, True))


def _module(width: int, heads: int, batch_first: bool, routed: bool):
    import ipex_train
    from ipex_train.compute_policy import _mha

    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(width, heads, batch_first=batch_first).train()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    with mock.patch.object(_mha, "routable", _mha.routable if routed else (lambda m: False)):
        module, _ = ipex_train.optimize(module, opt, dtype=BF16, bf16_compute="native")
    return module


def _op_row(case, rounds: int) -> dict:
    batch, seq, width, heads, batch_first, padded = case
    gen = torch.Generator().manual_seed(1)
    shape = (batch, seq, width) if batch_first else (seq, batch, width)
    x = torch.randn(shape, generator=gen).to(BF16).requires_grad_()
    g = torch.randn(shape, generator=gen).to(BF16)
    kpm = None
    if padded:  # the last quarter of every other sequence is padding
        kpm = torch.zeros(batch, seq, dtype=torch.bool)
        kpm[::2, seq - seq // 4:] = True

    def call(module):
        def run():
            out, _ = module(x, x, x, key_padding_mask=kpm, need_weights=False)
            return torch.autograd.grad(out, [x, *module.parameters()], g)
        return run

    rs = interleaved({"class": call(_module(width, heads, batch_first, False)),
                      "routed": call(_module(width, heads, batch_first, True))}, rounds, repeats=3, warmup=3)
    med = rs.median()
    return {"batch": batch, "seq": seq, "width": width, "heads": heads, "batch_first": batch_first,
            "key_padding_mask": padded, "class_ms": med["class"] * 1e3, "routed_ms": med["routed"] * 1e3,
            "ratio": rs.paired("routed", "class").median, "spread": rs.paired("routed", "class").spread}


def _op_line(row: dict) -> str:
    layout = "batch-first" if row["batch_first"] else "seq-first, padded"
    return (f"op b{row['batch']} s{row['seq']} e{row['width']} h{row['heads']} {layout}: "
            f"class {row['class_ms']:.2f} ms, routed {row['routed_ms']:.2f} ms, ratio {row['ratio']:.3f} "
            f"(spread {row['spread']:.3f})")


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step row, print them and return (and optionally write) the JSON."""
    from ipex_train.compute_policy import _mha

    return run_study(
        __doc__.splitlines()[0], op_cases=OP_CASES, op_row=_op_row, op_header="", op_line=_op_line,
        step_row_of=lambda _, rounds: route_step_row("vit_b16", _mha, "multihead_attention", rounds),
        step_line_of=step_line, argv=argv)


if __name__ == "__main__":
    main()
