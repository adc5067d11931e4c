"""The LLM fine-tune recipe's tokens/s ratio, optimize(bf16) over torch autocast, with both variants' steps
interleaved in one process.

``python -m benchmarks.studies.llm_lora_ratio [--seq-len 2048 4096] [--rounds 5] [--size 100m] [--threads N]
[--json PATH]``

Why: ``recipes.llm_finetune --variants autocast,ipex`` trains the variants one after the other, each in its own
process, so a machine whose speed drifts over minutes (this VM's bf16 matmul roof moved between 348 and 424
GFLOP/s within one day) moves the ratio with it. Here the recipe's own setup (``llm_finetune._setup``: the same
model, peft LoRA adapters, AdamW and optimize() call) builds both variants, and their steps alternate on the same
batch (``benchmarks.common.timing.interleaved``), so each round's ratio is taken within seconds; the median of those
ratios is the figure. The roof is measured before and after.

Backs docs/attention.md, "End to end: the LoRA fine-tune".
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import report
from benchmarks.common.roof import matmul_roof_gflops
from benchmarks.common.timing import interleaved


def _variant(size: str, seq_len: int, name: str):
    from recipes import llm_finetune

    args = argparse.Namespace(size=size, mode="lora", base_dtype="bfloat16", seq_len=seq_len, rank=8, lr=None,
                              seed=0, frozen_weights="lossless")
    model, opt, context = llm_finetune._setup(args, name)
    ids = torch.randint(0, llm_finetune.VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad(set_to_none=True)
        with context():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()

    return step


def row(size: str, seq_len: int, rounds: int) -> dict:
    """Interleaved steps of autocast and ipex at one sequence length: median step times and the paired ratio."""
    from recipes import llm_finetune

    llm_finetune._import_libraries("lora")
    steps = {name: _variant(size, seq_len, name) for name in ("autocast", "ipex")}
    rs = interleaved(steps, rounds, warmup=2)
    med, ratio = rs.median(), rs.paired("autocast", "ipex")
    return {"size": size, "seq_len": seq_len, "autocast_ms": med["autocast"] * 1e3, "ipex_ms": med["ipex"] * 1e3,
            "speedup": ratio.median, "speedup_spread": ratio.spread,
            "tokens_per_s": {k: seq_len / v for k, v in med.items()},
            "samples_ms": {k: [t * 1e3 for t in times] for k, times in rs.per_round.items()}}


def main(argv: list[str] | None = None) -> dict:
    """Time each sequence length, print a table and return (and optionally write) the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", default="100m")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    roof_before = matmul_roof_gflops()
    rows = []
    print(f"{'seq':>6}{'autocast ms':>13}{'ipex ms':>10}{'autocast / ipex':>17}{'spread':>8}")
    for seq_len in args.seq_len:
        r = row(args.size, seq_len, args.rounds)
        rows.append(r)
        print(f"{seq_len:>6}{r['autocast_ms']:13.0f}{r['ipex_ms']:10.0f}{r['speedup']:17.3f}{r['speedup_spread']:8.3f}",
              flush=True)
    roof_after = matmul_roof_gflops()
    print(f"bf16 matmul roof: {roof_before:.0f} GFLOP/s before, {roof_after:.0f} after")
    return report.write(args.json, {"meta": {"threads": torch.get_num_threads(), "roof_gflops_before": roof_before,
                                             "roof_gflops_after": roof_after}, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
