"""The tiled attention backward's kept dQ shares: backward calls that reuse the kept buffer against calls that free it
first (a fresh buffer each call, as before it was kept), in interleaved rounds.

``python -m benchmarks.studies.attention_workspace [--json PATH] [--threads N] [--rounds 7] [--calls 4]``

Per call: wall ms (median over rounds), and the process's minor page faults and system CPU ms (getrusage), for
b1 h16 s2048 d64 and b1 h32 kv8 s2048 d128, causal, bf16.

Backs docs/attention.md, "Long sequences: the tiled kernel" (the paragraph on the kept dQ shares).
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

from benchmarks.common import report

SHAPES = ((1, 16, 16, 2048, 64), (1, 32, 8, 2048, 128))


def _usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_minflt, r.ru_stime


def _row(shape, rounds: int, calls: int) -> dict:
    from ipex_train import attention

    b, h, kv, s, d = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, d, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(b, kv, s, d, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    out = attention.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
    grad = torch.randn_like(out)
    samples = {"kept": [], "fresh": []}
    for r in range(rounds + 1):
        for mode in ("kept", "fresh"):
            t0, f0, s0 = _usage()
            for _ in range(calls):
                if mode == "fresh":
                    attention.workspace_bytes(release=True)
                torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
            t1, f1, s1 = _usage()
            if r:  # round 0 warms up
                samples[mode].append(((t1 - t0) / calls * 1e3, (f1 - f0) / calls, (s1 - s0) / calls * 1e3))
    row = {"shape": {"batch": b, "heads": h, "kv_heads": kv, "seq": s, "head_dim": d}, "causal": True}
    for mode, rows in samples.items():
        med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
        row[mode] = {"ms": med[0], "page_faults": med[1], "system_ms": med[2]}
    row["ratio_ms"] = sorted(k[0] / f[0] for k, f in zip(samples["kept"], samples["fresh"]))[rounds // 2]
    attention.workspace_bytes(release=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    """Time the rows, print them and return (and optionally write) the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=4, help="backward calls per round and mode")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'b h kv s d, causal':>22}{'kept ms':>9}{'fresh ms':>10}{'ratio':>7}{'faults kept/fresh':>19}"
          f"{'sys ms kept/fresh':>19}")
    for shape in SHAPES:
        row = _row(shape, args.rounds, args.calls)
        rows.append(row)
        kept, fresh = row["kept"], row["fresh"]
        print(f"{' '.join(map(str, shape)):>22}{kept['ms']:9.1f}{fresh['ms']:10.1f}{row['ratio_ms']:7.3f}"
              f"{kept['page_faults']:>10.0f} /{fresh['page_faults']:>7.0f}"
              f"{kept['system_ms']:>10.1f} /{fresh['system_ms']:>7.1f}", flush=True)
    return report.write(args.json, {"meta": {"threads": torch.get_num_threads()}, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
