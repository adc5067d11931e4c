"""Where the AOTInductor fp32 package of the BERT-style encoder loses to the TorchScript export: the same four layers
timed whole, without attention (the context is the value projection) and as attention alone, each as the TorchScript
fp32 export and as AOTInductor fp32 packages (default, static shapes, Inductor's flash attention kernel instead of
the written-out softmax). One process, every package built first, then interleaved calls.

    python -m benchmarks.studies.aoti_fp32_split [--repeats N] [--json PATH]

It backs docs/inference.md, "Measured", 2026-11-26 (graph passes): where the fp32 gap is.
"""
import argparse
import math
import os
import tempfile

import torch
from torch import nn

from benchmarks.common import report
from benchmarks.common.inference_models import BertStyleEncoderLayer
from benchmarks.common.inference_variants import ipex_train_export, time_on
from ipex_train import inference

PACKAGES = {"aoti": {}, "aoti_static": {"dynamic_dims": ()}, "aoti_flash": {"write_out_softmax": False}}


class _Layer(BertStyleEncoderLayer):
    """BertStyleEncoderLayer whole ("full"), without attention ("no_attention": the context is the value projection,
    every linear kept), or attention alone ("attention_only": Q, K, V are scaled copies of the input)."""

    def __init__(self, part):
        super().__init__()
        self.part = part

    def forward(self, x):
        if self.part == "full":
            return super().forward(x)
        b, s, d = x.shape

        def split(t):
            return t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)

        if self.part == "attention_only":
            q, k, v = split(x), split(x * 0.5), split(x * 0.25)
            attn = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads), dim=-1)
            return torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d) + x
        x = self.norm1(x + self.out(self.value(x)))
        return self.norm2(x + self.ffn_out(self.act(self.ffn_in(x))))


def _model(part, layers=4):
    torch.manual_seed(0)
    return nn.Sequential(*(_Layer(part) for _ in range(layers))).eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    x = torch.randn(8, 128, 768)
    fns, results = {}, {"torch": torch.__version__, "threads": torch.get_num_threads(), "batch": 8, "seq": 128,
                        "parts": {}}
    with tempfile.TemporaryDirectory(prefix="ipex_aoti_split_") as folder:
        for part in ("full", "no_attention", "attention_only"):
            model = _model(part)
            fns[f"{part}/torchscript"] = ipex_train_export(model, x)
            for name, options in PACKAGES.items():
                path = os.path.join(folder, f"{part}_{name}.pt2")
                inference.export(model, x, backend="aoti", path=path, config=inference.AOTIConfig(**options))
                fns[f"{part}/{name}"] = torch._inductor.aoti_load_package(path)
        rounds = time_on(fns, x, args.repeats, warmup=2)
    timing = {name: {"median_s": rounds.summary(name).median, "spread": rounds.summary(name).spread} for name in fns}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, b8 s128, 4 layers, median of "
          f"{args.repeats} interleaved calls")
    for part in ("full", "no_attention", "attention_only"):
        base = timing[f"{part}/torchscript"]["median_s"]
        rows = results["parts"][part] = {}
        for variant in ("torchscript", *PACKAGES):
            t = timing[f"{part}/{variant}"]
            rows[variant] = {**t, "vs_torchscript": base / t["median_s"]}
            print(f"{part:15s} {variant:12s} {t['median_s'] * 1e3:8.2f} ms  spread {t['spread']:5.1%}  "
                  f"{base / t['median_s']:.2f}x TorchScript")
    report.write(args.json, results, indent=1)


if __name__ == "__main__":
    main()
