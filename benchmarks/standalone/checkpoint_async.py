"""What checkpointing costs a training loop: one save every 10 steps, synchronous or asynchronous
(:class:`ipex_train.checkpoint.Checkpointer`), on the full fine-tune of the 100m Llama of recipes.llm_finetune.

    python -m benchmarks.standalone.checkpoint_async --json benchmarks/reports/checkpoint_async.json
    python -m benchmarks.standalone.checkpoint_async --parts 3      # the pieces of one save, timed

In one process, after warm-up steps, rounds of three phases of ``--every`` steps each, interleaved:
``none`` (the steps alone), ``sync`` (a synchronous save, then the steps) and ``async`` (an asynchronous save, the
steps while it is written, then waiting for it to be published). A phase's wall time counts everything, so
``phase / none - 1`` is the overhead of one save per ``--every`` steps; the synchronous save's own time is
reported too. Variant: optimize(bf16, int8 state, step_in_backward), AdamW with warm-up (the recipe's).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from ..common import report as report_writer


def _phase(kind: str, ckpts: dict, train, step: int, every: int) -> tuple[float, float]:
    """One phase; (its wall time, the time the save call itself took)."""
    t0 = time.perf_counter()
    save_s = 0.0
    if kind != "none":
        ckpts[kind].save(step)
        save_s = time.perf_counter() - t0
    train(every)
    if kind == "async":
        ckpts[kind].wait()
    return time.perf_counter() - t0, save_s


def _time_background_writes() -> list:
    """Record (wall s, CPU s of the writing thread) of every ``dcp.save`` run off the main thread: the
    asynchronous writer's own cost, which on a machine whose cores all train is taken from the training."""
    import threading

    import torch.distributed.checkpoint as dcp

    save, records = dcp.save, []

    def timed(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            return save(*args, **kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return save(*args, **kwargs)
        finally:
            records.append((time.perf_counter() - t0, time.thread_time() - c0))

    dcp.save = timed
    return records


def parts(model, opt, root: str, repeats: int) -> dict:
    """The pieces of one save, each timed alone ``repeats`` times (medians): what a save puts on the training
    thread (the state dicts: the optimizer's decodes reduced state to fp32; the private copy an asynchronous save
    hands its writer) and what the write takes (synchronous ``dcp.save``; the background writer runs the same)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ipex_train.checkpoint import _staging, _state

    times: dict[str, list] = {k: [] for k in ("model_state_dict", "optimizer_state_dict", "state_dict",
                                              "private_copy", "dcp_save")}
    for i in range(repeats):
        t0 = time.perf_counter()
        get_model_state_dict(model)
        t1 = time.perf_counter()
        _state.optimizer_state(model, opt)
        t2 = time.perf_counter()
        sd = _state.state_dict(model, opt, None, 1, 0, 1, None)
        t3 = time.perf_counter()
        _staging.private_copy(sd, model, opt)
        t4 = time.perf_counter()
        dcp.save(sd, checkpoint_id=os.path.join(root, f"sync{i}"), no_dist=True)
        t5 = time.perf_counter()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[key].append(round(value, 3))
    return {"parts_s": times, "parts_median_s": {k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> int:
    import torch

    import ipex_train
    from ipex_train.checkpoint import Checkpointer
    from recipes import llm_finetune as L

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100m", choices=list(L.SIZES))
    parser.add_argument("--batch-size", type=int, default=4, help="the recipe's default")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--every", type=int, default=10, help="steps per save")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--parts", type=int, default=0, metavar="N",
                        help="instead of the phases: time the pieces of a save N times after one step")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = L.build(args.size, torch.float32, args.seq_len).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, inplace=True, optimizer_state_dtype="int8",
                                     step_in_backward=True)
    sched = L.warmup(opt, 10)
    data = L.batches(L.corpus(2 ** 20), args.batch_size, args.seq_len, 0)
    step_count = [0]

    def train(n: int) -> None:
        for _ in range(n):
            ids = next(data)
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            step_count[0] += 1

    root = args.dir or tempfile.mkdtemp(prefix="checkpoint_async_")
    if args.parts:
        train(1)
        report = {"size": args.size, "parameters": sum(p.numel() for p in model.parameters()),
                  **parts(model, opt, root, args.parts), "machine": ipex_train.info()["cpu"],
                  "threads": torch.get_num_threads()}
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(report, indent=1))
        report_writer.write(args.json, report, indent=1)
        return 0
    writes = _time_background_writes()
    ckpts = {kind: Checkpointer(os.path.join(root, kind), model, opt, sched, keep=1, async_save=kind == "async")
             for kind in ("sync", "async")}
    train(args.warmup)
    phases: dict[str, list] = {"none": [], "sync": [], "async": []}
    for _ in range(args.rounds):
        for kind in phases:
            phases[kind].append(_phase(kind, ckpts, train, step_count[0], args.every))
    size = sum(f.stat().st_size for f in os.scandir(ckpts["sync"].latest()))
    none = statistics.median(t for t, _ in phases["none"])
    report = {
        "size": args.size, "parameters": sum(p.numel() for p in model.parameters()),
        "batch": f"{args.batch_size} x {args.seq_len}", "every": args.every, "rounds": args.rounds,
        "checkpoint_mib": size / 2 ** 20, "step_s": none / args.every,
        "phases_s": {k: [round(t, 3) for t, _ in v] for k, v in phases.items()},
        "sync_save_s": statistics.median(s for _, s in phases["sync"]),
        "async_save_call_s": statistics.median(s for _, s in phases["async"]),
        "overhead_sync": statistics.median(t for t, _ in phases["sync"]) / none - 1,
        "overhead_async": statistics.median(t for t, _ in phases["async"]) / none - 1,
        "background_write_wall_s": [round(w, 3) for w, _ in writes],
        "background_write_cpu_s": [round(c, 3) for _, c in writes],
        "machine": ipex_train.info()["cpu"], "threads": torch.get_num_threads(),
    }
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=1))
    report_writer.write(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
