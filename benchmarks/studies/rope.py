"""Rotary position embeddings: Hugging Face's ``apply_rotary_pos_emb`` (plus the contiguous copies the attention
then makes) against ``ipex_train.rope``'s fused op, alone and in whole Llama training steps.

``python -m benchmarks.studies.rope [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5] [--no-step]
[--no-op]``

Why: the native policy routes Hugging Face Llama-family attention layers' rotary embedding to the fused op
(:func:`ipex_train.compute_policy.routes_rope`). This measures the evidence on the machine at hand:

- op: forward + backward of the query and key rotation, bf16, 12 query heads over 4 key/value heads of 64, at
  (batch 1, seq 2048) and (batch 4, seq 256): torch (the projections' views transposed, rotated by
  ``apply_rotary_pos_emb``, made contiguous as the attention kernels read them) and fused, alternately in
  interleaved rounds (median ms, and the median of the per-round ratio fused / torch).
- step: the 100M-parameter Llama of ``recipes.llm_finetune`` (LoRA, batch 1, seq 2048, AdamW) and the
  ``llama_s256`` model of bench_train_step (full training, b4 s256, SGD), each under ``optimize(dtype=bf16)``
  routed against the same model with ``routes_rope`` patched to False, steps interleaved with a second unrouted
  instance (``control``: the ratio two identical models give here).

Backs docs/compute_policy.md, "Rotary position embeddings".
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch

from benchmarks.common import report
from benchmarks.common.timing import interleaved, op_and_step_arguments, routed_against_unrouted

BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM = 12, 4, 64


def _op_row(batch: int, seq: int, rounds: int) -> dict:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from ipex_train.rope import apply_rotary

    gen = torch.Generator().manual_seed(0)
    qp = torch.randn(batch, seq, HEADS * HEAD_DIM, generator=gen).to(BF16).requires_grad_()
    kp = torch.randn(batch, seq, KV_HEADS * HEAD_DIM, generator=gen).to(BF16).requires_grad_()
    ang = torch.randn(1, seq, HEAD_DIM // 2, generator=gen)
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    gq = torch.randn(batch, HEADS, seq, HEAD_DIM, generator=gen).to(BF16)
    gk = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, generator=gen).to(BF16)
    q_shape, k_shape = (batch, seq, HEADS, HEAD_DIM), (batch, seq, KV_HEADS, HEAD_DIM)

    def unfused():
        q, k = apply_rotary_pos_emb(qp.view(q_shape).transpose(1, 2), kp.view(k_shape).transpose(1, 2), cos, sin)
        return torch.autograd.grad((q.contiguous(), k.contiguous()), (qp, kp), (gq, gk))

    def fused():
        q, k = apply_rotary(qp.view(q_shape), kp.view(k_shape), cos, sin)
        return torch.autograd.grad((q, k), (qp, kp), (gq, gk))

    rs = interleaved({"torch": unfused, "fused": fused}, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"batch": batch, "seq": seq, "torch_ms": med["torch"] * 1e3, "fused_ms": med["fused"] * 1e3,
            "ratio": rs.paired("fused", "torch").median}


def _lora_step(routed: bool):
    from ipex_train.compute_policy import _rope
    from recipes import llm_finetune

    args = argparse.Namespace(size="100m", mode="lora", base_dtype="bfloat16", seq_len=2048, rank=8, lr=None,
                               seed=0, frozen_weights="lossless")
    llm_finetune._import_libraries("lora")
    with mock.patch.object(_rope, "routable", _rope.routable if routed else (lambda module: False)):
        model, opt, _ = llm_finetune._setup(args, "ipex")
    ids = torch.randint(0, llm_finetune.VOCAB, (1, 2048), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return step, model


def _bench_step(routed: bool):
    from benchmarks.common.train_harness import _build, batches
    from benchmarks.common.train_models import MODELS
    from ipex_train.compute_policy import _rope

    with mock.patch.object(_rope, "routable", _rope.routable if routed else (lambda module: False)):
        step, dtype, _ = _build("llama_s256", "optimize_bf16")
    x, y = batches(MODELS["llama_s256"], dtype)[0]
    return lambda: step(x, y), None


def _routed_layers(model) -> int | None:
    if model is None:
        return None
    return sum("forward" in vars(m) and type(m).__name__.endswith("Attention") for m in model.modules())


def _step_row(name: str, build, rounds: int) -> dict:
    routed, model = build(True)
    plain, _ = build(False)
    control, _ = build(False)
    return {"model": name, "layers_routed": _routed_layers(model),
            **routed_against_unrouted(routed, plain, control, rounds)}


def main(argv: list[str] | None = None) -> dict:
    """Time the op rows and the step rows, print tables and return (and optionally write) the JSON."""
    args = op_and_step_arguments(__doc__.splitlines()[0], argv)
    ops = []
    if not args.no_op:
        print(f"op q {HEADS}x{HEAD_DIM}, k {KV_HEADS}x{HEAD_DIM}, bf16: {'batch':>6}{'seq':>6}{'torch':>9}{'fused':>9}"
              f"{'ratio':>7}  (ms)")
    for batch, seq in () if args.no_op else ((1, 2048), (4, 256)):
        row = _op_row(batch, seq, args.op_rounds)
        ops.append(row)
        print(f"{'':<28}{batch:>6}{seq:>6}{row['torch_ms']:9.2f}{row['fused_ms']:9.2f}{row['ratio']:7.3f}", flush=True)
    steps = []
    if not args.no_step:
        print(f"step: {'model':>22}{'unrouted':>10}{'routed':>9}{'ratio':>7}{'spread':>8}{'control':>9}{'ratio':>7}"
              "  (ms)")
        for name, build in (("llm_finetune 100m lora s2048", _lora_step), ("llama_s256", _bench_step)):
            row = _step_row(name, build, args.step_rounds)
            steps.append(row)
            print(f"      {name:>22}{row['unrouted_ms']:10.1f}{row['routed_ms']:9.1f}{row['ratio']:7.3f}"
                  f"{row['ratio_spread']:8.3f}{row['control_ms']:9.1f}{row['control_ratio']:7.3f}", flush=True)
    return report.write(args.json, {"meta": {"threads": torch.get_num_threads()}, "op": ops, "step": steps},
                        indent=1)


if __name__ == "__main__":
    main()
