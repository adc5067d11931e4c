"""peft LoRA layers with the native policy's fused LoRA linear and without it: one layer's forward + backward per
shape of the recipe's 100m model, and the training step of ``recipes.llm_finetune``'s ipex variant, each alternated
with peft's own forward in one process.

``python -m benchmarks.studies.lora_fused_step [--size 100m] [--seq-len 2048] [--rounds 8] [--json PATH]``

Why: under ``optimize(dtype=torch.bfloat16)``'s native policy peft's ``lora.Linear`` layers run ``ipex_train.lora``
(the adapter's product summed into the base output by the matmul; ``compute_policy.routes_lora``). The layer rows
time ``lora_linear`` against peft's ops (``linear(x, W) + linear(linear(x, A), B) * scaling``) on bf16 tensors of
(seq_len x in) -> out with a frozen base, grads for x and both adapters. The step rows time one training step
(forward, backward, AdamW step) of the recipe's model with the LoRA routes on and with only them removed. Interleaved
rounds (benchmarks.common.timing); the paired ratio is fused over peft within a round. It backs
docs/compute_policy.md, "peft LoRA layers".
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import report
from benchmarks.common.timing import interleaved
from ipex_train.lora import lora_linear

# (in, out) of the 100m model's projections: q/o, k/v (4 kv heads of 64), gate/up, down.
LAYER_SHAPES = {"q_proj/o_proj": (768, 768), "k_proj/v_proj": (768, 256), "gate_proj/up_proj": (768, 2048),
                "down_proj": (2048, 768)}


def _layer_variants(tokens, in_features, out_features, rank, scaling=2.0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(torch.bfloat16)
    a = (torch.randn(rank, in_features, generator=g) / in_features ** 0.5).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(out_features, rank, generator=g) / rank ** 0.5).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(tokens, out_features, generator=g).to(torch.bfloat16)

    def run(fn):
        def call():
            fn().backward(grad)
            x.grad = a.grad = b.grad = None
        return call

    return {"fused": run(lambda: lora_linear(x, w, None, a, b, scaling)),
            "peft": run(lambda: F.linear(x, w) + F.linear(F.linear(x, a), b) * scaling)}


def _row(rounds):
    out = {name: rounds.summary(name).as_dict() for name in ("fused", "peft")}
    out["paired_ratio_fused_over_peft"] = rounds.paired("fused", "peft").as_dict(unit="x")
    return out


def _step_variants(args):
    from recipes import llm_finetune

    setup = argparse.Namespace(size=args.size, mode="lora", seed=0, rank=args.rank, base_dtype="bfloat16",
                               frozen_weights="lossless", lr=None, seq_len=args.seq_len, batch_size=1)
    model, optimizer, _ = llm_finetune._setup(setup, "ipex")
    routed = {m: vars(m)["forward"] for m in model.modules() if "forward" in vars(m) and hasattr(m, "lora_A")}
    if not routed:
        raise SystemExit("no LoRA layer is routed: the native compute policy is not active on this CPU")
    ids = torch.randint(0, 256, (1, args.seq_len), generator=torch.Generator().manual_seed(0))

    def step(fused):
        def call():
            for m, bound in routed.items():
                if fused:
                    m.forward = bound
                elif "forward" in vars(m):
                    del m.forward
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        return call

    return len(routed), {"fused": step(True), "peft": step(False)}


def main(argv=None) -> dict:
    """Run both comparisons; print and return (and with ``--json``, write) the times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="100m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds of the step (the layers get 3x)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    payload = {"size": args.size, "seq_len": args.seq_len, "rank": args.rank, "layers": {}}
    for name, (in_features, out_features) in LAYER_SHAPES.items():
        rounds = interleaved(_layer_variants(args.seq_len, in_features, out_features, args.rank), 3 * args.rounds,
                             warmup=2)
        payload["layers"][name] = row = _row(rounds)
        print(f"{name:>18} ({in_features}->{out_features}): fused {row['fused']['median_s'] * 1e3:.2f} ms, peft "
              f"{row['peft']['median_s'] * 1e3:.2f} ms (fw+bw median), paired ratio "
              f"{row['paired_ratio_fused_over_peft']['median_x']:.3f}")
    payload["routed_layers"], variants = _step_variants(args)
    payload["step"] = row = _row(interleaved(variants, args.rounds, warmup=1))
    print(f"{'step':>18}: fused best {row['fused']['best_s']:.3f} s median {row['fused']['median_s']:.3f} s, peft "
          f"best {row['peft']['best_s']:.3f} s median {row['peft']['median_s']:.3f} s, paired ratio "
          f"{row['paired_ratio_fused_over_peft']['median_x']:.3f}")
    report.write(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
