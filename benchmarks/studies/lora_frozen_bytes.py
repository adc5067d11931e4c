"""What LoRA on a bf16-loaded Llama costs per frozen parameter: plain torch against ipex_train.optimize(bf16).

    python -m benchmarks.studies.lora_frozen_bytes [--json out.json]

An 8-layer Llama (hidden 512, GQA 8/4 heads, vocabulary 1000) created in bf16 (as ``from_pretrained(dtype=
torch.bfloat16)`` gives), peft LoRA r=8 on q/k/v/o, AdamW over the adapters, 3 steps on a 4 x 128 batch. Each
variant runs in its own process, which imports every library first; figures are the process's RSS growth from
there (after building, and after the steps) divided by the frozen parameters, beside memory_report's bytes per
frozen parameter (tensors only: plain torch holds 2.0, the bf16 weights). It backs docs/llm_finetune.md, "LoRA on a
bf16-loaded base".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import report

VARIANTS = ("torch", "ipex")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(variant: str) -> dict:
    """One variant's figures, in this process."""
    import warnings

    warnings.filterwarnings("ignore")
    import peft
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401

    import ipex_train
    import ipex_train.compute_policy  # noqa: F401
    import ipex_train.integrations.peft  # noqa: F401

    before = _rss()
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        base = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if variant == "ipex":
        model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, inplace=True)
    built = _rss()
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    accounted = ipex_train.memory_report(model, opt)
    return {"variant": variant, "frozen_params": frozen, "built_bytes_per_frozen": (built - before) / frozen,
            "after_3_steps_bytes_per_frozen": (_rss() - before) / frozen,
            "memory_report_frozen": accounted.per_frozen()["total"], "memory_report": str(accounted)}


def main(argv: list[str] | None = None) -> int:
    """Run each variant in its own process; print and (with --json) write the figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.lora_frozen_bytes",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args.variant)))
        return 0
    rows = []
    for v in VARIANTS:
        out = subprocess.run([sys.executable, "-m", "benchmarks.studies.lora_frozen_bytes", "--variant", v], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    for r in rows:
        print(f"{r['variant']:>6}: built +{r['built_bytes_per_frozen']:.2f} B/frozen param, after 3 steps "
              f"+{r['after_3_steps_bytes_per_frozen']:.2f}; memory_report {r['memory_report_frozen']:.2f}")
    report.write(args.json, {"benchmark": "lora_frozen_bytes", "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
