"""Spawn a test's distributed ranks: fresh processes (gloo on 127.0.0.1, a free port), bounded in time, killed when
they outlive it, each writing its results to ``out/rank<r>.pkl``."""
from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(rank_main: Callable, args: tuple, world: int, out: Path, timeout: float, what: str) -> list:
    """Run ``rank_main(rank, world, port, *args, str(out))`` in ``world`` spawned ranks and return each rank's
    pickled results. Ranks still running after ``timeout`` seconds are killed (TimeoutError naming ``what``)."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(rank_main, args=(world, free_port(), *args, str(out)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} ranks still running after {timeout} s")
    except mp.ProcessExitedException:
        # A rank that dies after every rank has written its results died in gloo's teardown (seen under load:
        # "terminate called without an active exception" after destroy_process_group); the results stand.
        if not all((out / f"rank{rank}.pkl").exists() for rank in range(world)):
            raise
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world):
        with open(out / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
