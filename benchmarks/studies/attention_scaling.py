"""Thread scaling of the tiled attention kernel: forward and backward of one bf16 causal call at several thread
counts, with both products of the AVX-512 BF16 tiles (oneDNN's micro-kernel and the tiles' own loops), and whether
the results keep the same bits at every thread count.

``python -m benchmarks.studies.attention_scaling [--threads 4 16] [--shape 1 32 8 4096 128] [--json PATH]``

Why: the backward splits its work over (batch, key/value head, chunk of key tiles), so a batch-1 fine-tune with 8
key/value heads still has 32 tasks; this checks that more cores shorten it (the target: backward at 16 threads >= 3x
its 4-thread time for b1 h32 kv8 s4096 d128) and that the split never changes the result. Per thread count and
products, the median of ``--repeats`` calls (one warm-up), forward and backward timed apart. Speedups are against
the first thread count in the list. Runs on CPUs with AVX-512 BF16 (the tiles' fast path); elsewhere it says so and
stops. Backs docs/attention.md, "Thread scaling"; `benchmarks/device/amx.sh` runs it with ATTENTION=1.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import report
from ipex_train.attention import _op
from ipex_train.base import ops as _ops


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _measure(shape, threads: int, products: str, repeats: int) -> tuple[dict, tuple]:
    b, h, hk, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(torch.bfloat16) for n in (h, hk, hk))
    grad = torch.randn(b, h, s, d, generator=g).to(torch.bfloat16)
    seed = torch.zeros(1, dtype=torch.int64)
    scale = d ** -0.5
    torch.set_num_threads(threads)
    _op.tile_products(products)
    ops = torch.ops.ipex_train
    out, lse = ops.attention_flash_forward(q, k, v, None, None, 0.0, True, scale, seed)
    fwd = _median_ms(lambda: ops.attention_flash_forward(q, k, v, None, None, 0.0, True, scale, seed), repeats)
    bwd = _median_ms(lambda: ops.attention_flash_backward(grad, q, k, v, out, lse, None, None, 0.0, True, scale,
                                                          seed), repeats)
    grads = ops.attention_flash_backward(grad, q, k, v, out, lse, None, None, 0.0, True, scale, seed)
    return {"threads": threads, "products": products, "forward_ms": fwd, "backward_ms": bwd}, (out, *grads)


def main(argv: list[str] | None = None) -> dict | None:
    """Time the shape at every thread count with each products choice; print a table, return (and write) the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[4, 16])
    p.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 4096, 128], metavar=("B", "H", "KV", "S", "D"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not (_ops.cpu_features().get("avx512_bf16") and _ops.kernel_variant() == "avx512"):
        print("attention_scaling: the tiles' AVX-512 BF16 path does not run here; nothing measured")
        return None
    default = _op.tile_products()
    choices = ["onednn", "own"] if default == "onednn" else ["own"]
    before = torch.get_num_threads()
    rows, bits = [], {}
    try:
        for products in choices:
            for n in args.threads:
                row, result = _measure(args.shape, n, products, args.repeats)
                rows.append(row)
                first = bits.setdefault(products, result)
                row["same_bits_as_first"] = all(torch.equal(a, b) for a, b in zip(first, result))
    finally:
        torch.set_num_threads(before)
        _op.tile_products(default)
    base = {r["products"]: r for r in rows if r["threads"] == args.threads[0]}
    print(f"b{args.shape[0]} h{args.shape[1]} kv{args.shape[2]} s{args.shape[3]} d{args.shape[4]} causal, ms (median "
          f"of {args.repeats}); speedup against {args.threads[0]} threads")
    for r in rows:
        first = base[r["products"]]
        r["forward_speedup"] = first["forward_ms"] / r["forward_ms"]
        r["backward_speedup"] = first["backward_ms"] / r["backward_ms"]
        print(f"{r['products']:>7} {r['threads']:3d} threads: forward {r['forward_ms']:9.1f} "
              f"({r['forward_speedup']:.2f}x)  backward {r['backward_ms']:9.1f} ({r['backward_speedup']:.2f}x)  "
              f"same bits: {r['same_bits_as_first']}", flush=True)
    return report.write(args.json, {"meta": {"shape": args.shape, "causal": True}, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
