"""What optimize(dtype=bf16) converts on real architectures: the share of parameters and of matmul FLOPs in bf16.

Run from the repository root::

    python -m benchmarks.standalone.coverage [--quick] [--out out/coverage]

Each model is built from its library's constructor or config (no download): torchvision ResNet-50 / ConvNeXt-T /
ViT-B/16 / Swin-T, timm ViT-Tiny / ConvNeXt-Atto, HuggingFace BERT-base / GPT-2 / a Llama-style decoder, and an
nn.TransformerEncoder. ``--quick`` shrinks the transformer configs (same layer types) and skips the largest models.

Per model, after ``optimize(model, AdamW, dtype=torch.bfloat16)``:

* parameters: the share (by element count) that is bf16, and every parameter left fp32, grouped by the class of
  the module that owns it and the parameter's name, with the reason;
* matmul FLOPs: one forward on a small batch with the "native" bf16 compute policy (so matmuls run on the dtypes
  they are given), counted per aten op with torch.utils.flop_counter's formulas; an op is bf16 when all its
  floating-point operands are;
* one training step with the default policy, to show the model trains (loss finite).

Writes ``coverage.json`` and ``coverage.md`` (the table) under ``--out`` and prints the table.
"""
from __future__ import annotations

import argparse
import math
import os
import warnings
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

import ipex_train
from benchmarks.common import report
from ipex_train.precision.selection import is_matmul_module

BF16 = torch.bfloat16
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)


# --------------------------------------------------------------------------- models


def _vision(name, build, size=64):
    return name, build, lambda: (torch.randn(2, 3, size, size),), lambda out: out


def _text(name, build):
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    return name, build, lambda: (ids,), lambda out: out.logits


def models(quick: bool) -> list[tuple]:
    """(name, build, inputs, logits) per audited model."""
    import timm
    import torchvision
    import transformers

    tv = torchvision.models
    hf = transformers
    if quick:
        bert = hf.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128, num_labels=10)
        gpt2 = hf.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=2, n_positions=64, num_labels=10,
                             pad_token_id=0, bos_token_id=0, eos_token_id=0)
        llama = hf.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_labels=10, pad_token_id=0)
    else:  # the real base sizes (BERT-base, GPT-2 124M) and a small Llama-style decoder
        bert = hf.BertConfig(num_labels=10)
        gpt2 = hf.GPT2Config(num_labels=10, pad_token_id=0)
        llama = hf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4, num_labels=10, pad_token_id=0)
    width, depth = (32, 2) if quick else (768, 12)
    found = [
        _vision("torchvision resnet50", lambda: tv.resnet50(num_classes=10)),
        _vision("torchvision convnext_tiny", lambda: tv.convnext_tiny(num_classes=10)),
        _vision("torchvision swin_t", lambda: tv.swin_t(num_classes=10)),
        _vision("timm vit_tiny_patch16_224", lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10,
                                                                        img_size=64)),
        _vision("timm convnext_atto", lambda: timm.create_model("convnext_atto", num_classes=10)),
        _text("HF BERT", lambda: hf.BertForSequenceClassification(bert)),
        _text("HF GPT-2", lambda: hf.GPT2ForSequenceClassification(gpt2)),
        _text("HF Llama-style", lambda: hf.LlamaForSequenceClassification(llama)),
        ("nn.TransformerEncoder", lambda: _Encoder(width, depth), lambda: (torch.randn(2, 16, width),),
         lambda out: out),
    ]
    if not quick:
        found.insert(2, _vision("torchvision vit_b_16", lambda: tv.vit_b_16(image_size=64, num_classes=10)))
    return found


class _Encoder(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, max(2, width // 64), 4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


# --------------------------------------------------------------------------- measurements


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the aten ops torch.utils.flop_counter has formulas for (mm, addmm, bmm, convolution, attention
    ...), split by whether all floating-point operands are bf16."""

    def __init__(self):
        super().__init__()
        self.flops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            floats = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                      and t.is_floating_point()}
            self.flops["bf16" if floats == {BF16} else "other"] += formula(*args, **kwargs, out_val=out)
        return out


def _reason(module: nn.Module, name: str, param: torch.Tensor) -> str:
    if isinstance(module, NORMS) or "norm" in type(module).__name__.lower():
        return "normalisation layer (elementwise; torch takes bf16 inputs with fp32 weights)"
    if is_matmul_module(module):
        return "matmul module kept fp32 (tied to a parameter that stays fp32)"
    if param.numel() == max(param.shape, default=1) and "token" not in name:
        return "per-channel scale or shift of a non-matmul module (elementwise: layer scale)"
    return ("bare parameter of a module not known to feed only matmuls (position embedding, class token, a custom "
            "layer's weight: its module runs in fp32)")


def audit(name: str, build, inputs, logits) -> dict:
    """One model's row: parameter and FLOP shares, the fp32 leftovers with reasons, and a training step."""
    torch.manual_seed(0)
    model = build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = ipex_train.optimize(model, opt, dtype=BF16)
    count = Counter()
    kept: dict[str, dict] = defaultdict(lambda: {"count": 0, "numel": 0})
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is None:
                continue
            count[str(p.dtype).removeprefix("torch.")] += p.numel()
            if p.dtype != BF16:
                entry = kept[f"{type(module).__name__}.{pname}"]
                entry["count"] += 1
                entry["numel"] += p.numel()
                entry["reason"] = _reason(module, pname, p)
    total = sum(count.values())

    x = inputs()
    out = logits(model(*x))
    loss = F.cross_entropy(out.float(), torch.arange(out.shape[0]) % out.shape[-1])
    loss.backward()
    opt.step()

    # Counted on the inference conversion under the native policy: matmuls then run on the dtypes they get, so the
    # counter sees them (the emulated policy computes bf16 weights against fp32 activations).
    torch.manual_seed(0)
    counted = ipex_train.optimize(build().eval(), dtype=BF16, bf16_compute="native")
    flops = MatmulFlops()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with flops:
            counted(*x)
    flops = flops.flops
    matmul = flops["bf16"] + flops["other"]
    return {"model": name, "parameters": total, "parameters_bf16_share": count["bfloat16"] / total,
            "matmul_flops_forward": matmul, "matmul_flops_bf16_share": flops["bf16"] / matmul if matmul else None,
            "train_step_loss": loss.item(), "trains": math.isfinite(loss.item()),
            "left_fp32": dict(sorted(kept.items(), key=lambda kv: -kv[1]["numel"]))}


def table(rows: list[dict]) -> str:
    """The markdown report: one line per model, then the fp32 leftovers of each."""
    lines = ["| model | parameters | bf16 params | bf16 matmul FLOPs (forward) | trains | left fp32 |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | | FAILED: {r['error']} | |")
            continue
        left = ", ".join(f"{k} x{v['count']}" for k, v in r["left_fp32"].items()) or "none"
        share = r["matmul_flops_bf16_share"]
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.2f}M | {100 * r['parameters_bf16_share']:.2f}% | "
                     f"{'n/a' if share is None else f'{100 * share:.2f}%'} | {'yes' if r['trains'] else 'NO'} | "
                     f"{left} |")
    reasons = sorted({v["reason"] for r in rows for v in r.get("left_fp32", {}).values()})
    lines += ["", "Why each kind stays fp32:", ""]
    for reason in reasons:
        kinds = sorted({k for r in rows for k, v in r.get("left_fp32", {}).items() if v["reason"] == reason})
        lines.append(f"* {reason}: {', '.join(kinds)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Audit every model, write the JSON and markdown table, print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.standalone.coverage",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny transformer configs, no ViT-B/16 (about a minute)")
    parser.add_argument("--out", default=os.path.join("out", "coverage"), help="output folder")
    parser.add_argument("--only", default=None, help="comma-separated substrings of the model names to audit")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    rows = []
    for name, build, inputs, logits in models(args.quick):
        if args.only and not any(s.lower() in name.lower() for s in args.only.split(",")):
            continue
        print(f"auditing {name} ...", flush=True)
        try:
            rows.append(audit(name, build, inputs, logits))
        except Exception as e:  # one broken model must not hide the others' rows
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    os.makedirs(args.out, exist_ok=True)
    report.write(os.path.join(args.out, "coverage.json"), {"quick": args.quick, "models": rows}, indent=1)
    text = table(rows)
    with open(os.path.join(args.out, "coverage.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    return 0 if all(r.get("trains") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
