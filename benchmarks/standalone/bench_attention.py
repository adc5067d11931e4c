"""Forward + backward time of one bf16 attention: ipex_train.attention (as routed, and each of its two kernels forced)
against torch's attention, with the bf16 matmul roof measured in the same run. The routing rule and the tables of
docs/attention.md come from this benchmark.

Run from the repository root (on a quiet machine)::

    python -m benchmarks.standalone.bench_attention [--threads 2] [--set issue|short|all] [--memory] [--json out.json]

"tiles_own" is the tiled kernel on its own dot-product loops where it otherwise runs oneDNN's micro-kernel.
Inputs are in Hugging Face's layout ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)); each time is the
best of ``--rounds`` rounds of ``--repeats`` calls, the variants interleaved round by round. FLOPs: 3.5x the forward's
two products (4 b h s^2 d), halved when causal; "roof" is a 2048^3 bf16 matmul timed in each row's rounds.
``--memory`` runs, in a fresh process, forward + backward of b1 h4 s16384 d64 causal attention and reports the growth
of the peak resident set over the inputs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ipex_train import attention
from ipex_train.attention import _op
from ipex_train.base import ops as _ops

from ..common import report as report_writer
from ..common.roof import matmul_roof_gflops
from ..common.timing import best_of_rounds

BF16 = torch.bfloat16
# (batch, heads, kv heads, seq, head dim, dropout, causal)
ISSUE = (
    (4, 12, 12, 512, 64, 0.0, False),
    (1, 16, 16, 1024, 64, 0.0, True),
    (1, 16, 16, 2048, 64, 0.0, True),
    (1, 32, 8, 2048, 128, 0.0, True),
    (1, 16, 16, 4096, 64, 0.0, True),
    (1, 32, 8, 4096, 128, 0.0, True),
)
SHORT = (
    (8, 12, 12, 128, 64, 0.0, False),
    (8, 12, 12, 128, 64, 0.1, False),
    (4, 12, 12, 256, 64, 0.0, True),
    (4, 12, 4, 256, 64, 0.0, True),  # bench_train_step's llama_s256 (grouped-query)
    (4, 12, 12, 197, 64, 0.0, False),  # ViT-B/16 at 224 px
    (8, 12, 12, 256, 64, 0.0, False),
    (2, 12, 12, 1024, 64, 0.0, False),
)
SETS = {"issue": ISSUE, "short": SHORT, "all": SHORT + ISSUE}


def _inputs(b, h, s, d):
    return torch.randn(b, s, h, d).to(BF16).transpose(1, 2).requires_grad_()


def _variants(b, h, hk, s, d, p, causal):
    q, k, v = _inputs(b, h, s, d), _inputs(b, hk, s, d), _inputs(b, hk, s, d)
    grad = torch.randn(b, h, s, d).to(BF16)
    scale = d ** -0.5

    def forced(op):
        def fn(q, k, v, dropout_p, is_causal, enable_gqa):
            seed = torch.zeros(1, dtype=torch.int64)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if op is _op.forward:
                return op(q, k, v, None, dropout_p, is_causal, scale, seed)
            return op(q, k, v, None, None, dropout_p, is_causal, scale, seed)
        return fn

    def run(fn):
        def call():
            fn(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=hk != h).backward(grad)
        return call

    variants = {"ipex_train": run(attention.scaled_dot_product_attention),
                "torch": run(F.scaled_dot_product_attention)}
    if attention._tiles_run(q, v):
        variants["tiles"] = run(forced(_op.flash_forward))
        if _op.tile_products() == "onednn":  # the tiles on their own products, for the comparison
            variants["tiles_own"] = _own_products(run(forced(_op.flash_forward)))
    if s <= attention.ROWS_MAX_KEYS:
        variants["rows"] = run(forced(_op.forward))
    return variants


def _own_products(call):
    def own():
        _op.tile_products("own")
        try:
            call()
        finally:
            _op.tile_products("onednn")
    return own


def _route(b, h, hk, s, d, causal) -> str:
    q, k = torch.empty(b, h, s, d, dtype=BF16), torch.empty(b, hk, s, d, dtype=BF16)
    if not attention.supports(q, k, k, is_causal=causal, enable_gqa=hk != h):
        return "torch"
    return "tiles" if attention._use_tiles(q, k, k, causal) else "rows"


ROOF_N = 2048


def _roof_call():
    a, b = torch.randn(ROOF_N, ROOF_N).to(BF16), torch.randn(ROOF_N, ROOF_N).to(BF16)
    return lambda: a @ b


def measure(shapes, rounds: int, repeats: int) -> dict:
    """Rows of the table: ms per variant, GFLOP/s and share of the roof. The roof (a 2048^3 bf16 matmul) is timed
    inside each row's interleaved rounds, beside the attention calls: this VM's matmul rate moved by up to 1.7x
    between minutes of one run, so a roof timed once before the shapes misstated the shares."""
    roof = matmul_roof_gflops()
    print(f"bf16 matmul roof {roof:.0f} GFLOP/s (before the rows)", flush=True)
    rows = []
    for shape in shapes:
        b, h, hk, s, d, p, causal = shape
        best = best_of_rounds({**_variants(*shape), "roof": _roof_call()}, rounds=rounds, repeats=repeats)
        row_roof = 2 * ROOF_N ** 3 / best.pop("roof") / 1e9
        flops = 4 * b * h * s * s * d * 3.5 * (0.5 if causal else 1.0)
        ms = {name: 1e3 * sec for name, sec in best.items()}
        share = {name: flops / (sec * 1e9) / row_roof for name, sec in best.items()}
        row = {"batch": b, "heads": h, "kv_heads": hk, "seq": s, "head_dim": d, "dropout": p, "causal": causal,
               "route": _route(b, h, hk, s, d, causal), "ms": ms, "roof_gflops": row_roof, "roof_share": share,
               "speedup_vs_torch": best["torch"] / best["ipex_train"]}
        rows.append(row)
        cells = "  ".join(f"{name} {ms[name]:8.2f} ms ({100 * share[name]:4.1f}%)" for name in ms)
        print(f"b{b} h{h} kv{hk} s{s} d{d} p{p} causal={causal} -> {row['route']} (roof {row_roof:.0f}): {cells}; "
              f"{row['speedup_vs_torch']:.2f}x torch", flush=True)
    return {"roof_gflops": roof, "rows": rows}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_child(seq: int, impl: str) -> None:
    fn = attention.scaled_dot_product_attention if impl == "ipex_train" else F.scaled_dot_product_attention
    q, k, v = (torch.randn(1, 4, seq, 64).to(BF16).requires_grad_() for _ in range(3))
    grad = torch.randn(1, 4, seq, 64).to(BF16)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set (VmHWM) to the current one
    before = _status_kib("VmRSS")
    fn(q, k, v, is_causal=True).backward(grad)
    print(json.dumps({"seq": seq, "impl": impl, "peak_rss_growth_mib": (_status_kib("VmHWM") - before) / 1024,
                      "inputs_mib": 4 * q.numel() * 2 / 2**20}))


def measure_memory(seq: int = 16384) -> dict:
    """Peak RSS growth of b1 h4 d64 causal forward + backward at ``seq`` (Linux), in a fresh process per
    implementation: ipex_train's and torch's."""
    results = {}
    for impl in ("ipex_train", "torch"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.standalone.bench_attention", "--memory-child", str(seq),
                              "--memory-impl", impl, "--threads", str(torch.get_num_threads())],
                             capture_output=True, text=True, check=True, timeout=600)
        results[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{impl}: b1 h4 s{seq} d64 causal forward + backward: peak RSS growth "
              f"{results[impl]['peak_rss_growth_mib']:.1f} MiB (inputs and grad {results[impl]['inputs_mib']:.0f} "
              "MiB)", flush=True)
    return results


def main(argv=None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int)
    parser.add_argument("--set", choices=sorted(SETS), default="issue")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--memory-impl", default="ipex_train", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args.memory_child, args.memory_impl)
        return
    report = measure(SETS[args.set], args.rounds, args.repeats)
    if args.memory:
        report["memory"] = measure_memory()
    report["meta"] = {"threads": torch.get_num_threads(), "kernel_variant": _ops.kernel_variant(),
                      "tile_products": _op.tile_products()}
    report_writer.write(args.json, report)


if __name__ == "__main__":
    main()
