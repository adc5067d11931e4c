"""FSDP2 on 2 CPU processes (gloo): bytes per parameter per rank and step time of ipex_train.optimize(bf16) on a
fully_shard model against torch's own recipe (FSDP2 + bf16 MixedPrecisionPolicy + torch's fused AdamW).

Run from the repository root::

    python -m benchmarks.standalone.bench_fsdp [--quick] [--json out.json] [--threads N] [--steps N]

The model is a Llama-style decoder built from a transformers config (hidden 512, 10 layers, vocabulary 8192:
~50M parameters), every decoder layer and the root sharded with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; each rank trains on its own batch of
``--batch`` sequences of ``--seq`` tokens. Variants (VARIANTS):

* ``torch``: ``torch.optim.AdamW(fused=True)`` on the DTensor parameters (torch's fused op has a DTensor rule);
* ``ipex_bf16``: ``ipex_train.optimize(model, AdamW, dtype=bfloat16, inplace=True)`` (fused step on the shards);
* ``ipex_bf16_int8_sib``: the same with ``optimizer_state_dtype="int8", step_in_backward=True``;
* ``ipex_bf16_int8`` and ``ipex_bf16_sib``: each of the two options alone, to tell their costs apart.

Memory: each variant in fresh ranks with glibc's mmap threshold pinned (freed tensors leave the RSS); per rank,
the RSS after the model is sharded and the optimizer built is the baseline, then the peak RSS over the steps
(VmHWM reset at the baseline); bytes/param/rank = (peak - baseline) / whole-model parameters, which holds grads,
optimizer state, the gathered bf16 copies of the units in flight and activations. Beside it,
``ipex_train.memory_report`` (per rank: shards, grads and state, tensors only), and the persistent part predicted.

Time: all variants in the same ranks, steps interleaved round-robin (torch, ipex, ipex, torch, ...), median of the
steps after the first two per variant (forward + backward + step, wall time on rank 0), and of each phase on rank 0:
forward (with the loss), backward and optimizer.step() (inside backward with step_in_backward, whose step() then
steps nothing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.common import report
from benchmarks.common.memory import pin_mmap_threshold, reset_peak, status_kb

VARIANTS = {
    "torch": None,
    "ipex_bf16": {},
    "ipex_bf16_int8_sib": {"optimizer_state_dtype": "int8", "step_in_backward": True},
    "ipex_bf16_int8": {"optimizer_state_dtype": "int8"},
    "ipex_bf16_sib": {"step_in_backward": True},
}
SIZES = {"full": {"hidden": 512, "layers": 10, "vocab": 8192}, "quick": {"hidden": 64, "layers": 2, "vocab": 256}}


def build(size: dict, variant: str):
    """The sharded model and the variant's optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import ipex_train

    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    options = VARIANTS[variant]
    if options is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return ipex_train.optimize(model, optimizer, dtype=torch.bfloat16, inplace=True, **options)


def step(model, optimizer, tokens: torch.Tensor) -> tuple[float, float, float]:
    """One training step (next-token loss); returns the seconds of the forward (with the loss), the backward and
    optimizer.step()."""
    optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _tokens(args, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(dist.get_rank())
    return torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)


def memory_rank(args, size: dict, variant: str) -> dict:
    import ipex_train

    pinned = pin_mmap_threshold()
    model, optimizer = build(size, variant)
    tokens = _tokens(args, size["vocab"])
    params = sum(p.numel() for p in model.parameters())
    base_kb = status_kb("VmRSS")
    reset = reset_peak()
    for _ in range(3):  # the first step creates the optimizer state
        step(model, optimizer, tokens)
    peak_kb = status_kb("VmHWM")
    accounted = ipex_train.memory_report(model, optimizer)
    return {"variant": variant, "rank": dist.get_rank(), "params": params, "base_rss_mb": base_kb / 1024,
            "peak_rss_mb": peak_kb / 1024, "bytes_per_param_rank": (peak_kb - base_kb) * 1024 / params,
            "accounted_bytes_per_param_rank": accounted.per_parameter(), "mmap_threshold_pinned": pinned,
            "peak_reset": reset}


def time_rank(args, size: dict, variants: list[str]) -> dict:
    runs = {v: build(size, v) for v in variants}
    tokens = _tokens(args, size["vocab"])
    times: dict[str, list[float]] = {v: [] for v in variants}
    phases: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    for i in range(args.steps):
        order = variants if i % 2 == 0 else variants[::-1]
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            phases[v].append(step(*runs[v], tokens))
            dist.barrier()
            times[v].append(time.perf_counter() - t0)

    def median_ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values[2:] or values)

    return {v: {"median_ms": median_ms(t), "steps_ms": [1e3 * x for x in t],
                **{f"{name}_median_ms": median_ms([p[k] for p in phases[v]])
                   for k, name in enumerate(("forward", "backward", "optimizer_step"))}}
            for v, t in times.items()}


def _rank(rank: int, world: int, port: int, job: tuple, out: str) -> None:
    torch.set_num_threads(job[0].threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    try:
        kind, args, size, what = job[1], job[0], job[2], job[3]
        result = memory_rank(args, size, what) if kind == "memory" else time_rank(args, size, what)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _spawn(args, kind: str, size: dict, what, tmp: Path) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(2, port, (args, kind, size, what), str(tmp)), nprocs=2, join=True,
                       start_method="spawn")
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark; print the table, write the JSON."""
    import tempfile


    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and 3 steps (smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per variant")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    if args.quick:
        args.steps, args.seq = 3, 16
    memory, timing = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            memory[v] = _spawn(args, "memory", size, v, Path(tmp, f"m_{v}"))
        timing = _spawn(args, "time", size, list(VARIANTS), Path(tmp, "t"))[0]
    base = memory["torch"]
    print(f"FSDP2, 2 ranks x {args.threads} thread(s), {base[0]['params'] / 1e6:.1f}M params, batch {args.batch} x "
          f"{args.seq} tokens per rank")
    print(f"{'variant':<22}{'B/param/rank':>13}{'vs torch':>9}{'accounted':>10}{'step ms':>9}{'vs torch':>9}"
          f"{'fwd ms':>8}{'bwd ms':>8}{'opt.step ms':>12}")
    rows = {}
    for v, ranks in memory.items():
        worst = max(r["bytes_per_param_rank"] for r in ranks)
        accounted = max(r["accounted_bytes_per_param_rank"]["total"] for r in ranks)
        rows[v] = {"bytes_per_param_rank": worst, "accounted_bytes_per_param_rank": accounted,
                   "memory_vs_torch": worst / max(r["bytes_per_param_rank"] for r in base),
                   "step_ms": timing[v]["median_ms"], "time_vs_torch": timing[v]["median_ms"] /
                   timing["torch"]["median_ms"], "optimizer_step_ms": timing[v]["optimizer_step_median_ms"],
                   "forward_ms": timing[v]["forward_median_ms"], "backward_ms": timing[v]["backward_median_ms"]}
        r = rows[v]
        print(f"{v:<22}{worst:>13.2f}{r['memory_vs_torch']:>8.2f}x{accounted:>10.2f}{r['step_ms']:>9.0f}"
              f"{r['time_vs_torch']:>8.2f}x{r['forward_ms']:>8.0f}{r['backward_ms']:>8.0f}{r['optimizer_step_ms']:>12.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    report.write(args.json, {"meta": {"args": vars(args) | {"json": None}}, "summary": rows, "memory": memory,
                             "time": timing})


if __name__ == "__main__":
    main()
