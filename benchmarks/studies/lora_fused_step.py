"""The LoRA fine-tune step of ``recipes.llm_finetune`` (ipex variant) with the native policy's fused LoRA linear and
without it, alternated step by step in one process.

``python -m benchmarks.studies.lora_fused_step [--size 100m] [--seq-len 2048] [--rounds 4] [--json PATH]``

Why: under ``optimize(dtype=torch.bfloat16)``'s native policy peft's ``lora.Linear`` layers run ``ipex_train.lora``
(the adapter's product summed into the base output by the matmul; ``compute_policy.routes_lora``). This times one
training step (forward, backward, AdamW step) of the recipe's model with those routes on, then with only them
removed (peft's own forward), ``--rounds`` times after one warm-up step each. It backs docs/compute_policy.md,
"peft LoRA layers".
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import report


def _model(args):
    from recipes import llm_finetune

    setup = argparse.Namespace(size=args.size, mode="lora", seed=0, rank=args.rank, base_dtype="bfloat16",
                               frozen_weights="lossless", lr=None, seq_len=args.seq_len, batch_size=1)
    model, optimizer, _ = llm_finetune._setup(setup, "ipex")
    return model, optimizer


def main(argv=None) -> dict:
    """Run the comparison; print and return (and with ``--json``, write) the step times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="100m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model, optimizer = _model(args)
    routed = {m: vars(m)["forward"] for m in model.modules() if type(m).__name__ == "Linear" and "forward" in vars(m)
              and hasattr(m, "lora_A")}
    if not routed:
        raise SystemExit("no LoRA layer is routed: the native compute policy is not active on this CPU")
    ids = torch.randint(0, 256, (1, args.seq_len), generator=torch.Generator().manual_seed(0))

    def step():
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        return time.perf_counter() - t0

    def set_routed(on):
        for m, bound in routed.items():
            if on:
                m.forward = bound
            elif "forward" in vars(m):
                del m.forward

    times = {"fused": [], "peft": []}
    for name in times:  # one warm-up step each
        set_routed(name == "fused")
        step()
    for _ in range(args.rounds):
        for name in times:
            set_routed(name == "fused")
            times[name].append(step())
    rows = {name: {"best_s": min(t), "median_s": statistics.median(t), "steps_s": t} for name, t in times.items()}
    rows["median_ratio_fused_over_peft"] = rows["fused"]["median_s"] / rows["peft"]["median_s"]
    payload = {"size": args.size, "seq_len": args.seq_len, "rank": args.rank, "routed_layers": len(routed), **rows}
    for name in ("fused", "peft"):
        print(f"{name:>6}: best {rows[name]['best_s']:.3f} s, median {rows[name]['median_s']:.3f} s "
              f"({', '.join(f'{t:.3f}' for t in times[name])})")
    print(f"median fused / peft: {rows['median_ratio_fused_over_peft']:.3f}")
    report.write(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
