"""The train-step harness of bench_train_step (and train_step_before_after): one worker process per (model, variant),
their steps interleaved round by round by the driver, and a plain in-process loop over the same builders to check
the harness against.

Workers are started as ``python -m benchmarks.common.train_harness worker MODEL VARIANT`` and serve steps over
stdin/stdout; the plain loop is ``python -m benchmarks.common.train_harness plain MODEL VARIANT...`` (one process,
each variant built, warmed up and timed in turn: best and median of its steps, as a hand-written loop would).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ipex_train import compute_policy

from .memory import pin_mmap_threshold
from .timing import Rounds, interleaved, summarize
from .train_models import MODELS, NUM_CLASSES, ModelSpec
from .train_variants import VARIANTS

NUM_BATCHES = 4  # a small fixed dataset, cycled, so the loss curve reflects fitting it
REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.common.train_harness"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def batches(spec: ModelSpec, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task: each class has a random template, inputs are template + noise.

    Random labels would make the loss curve chaotic (memorisation), and a chaotic curve cannot
    show whether two numerics agree.
    """
    data = torch.Generator().manual_seed(1)
    if spec.vocab:
        return _token_batches(spec, data)
    templates = torch.randn((NUM_CLASSES,) + spec.input_shape[1:], generator=data)
    out = []
    for _ in range(NUM_BATCHES):
        y = torch.randint(0, NUM_CLASSES, (spec.input_shape[0],), generator=data)
        x = templates[y] * spec.signal + torch.randn(spec.input_shape, generator=data)
        out.append((x.to(dtype), y))
    return out


def _token_batches(spec: ModelSpec, data: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids: each class has a template sequence; each position keeps its template token with probability
    ``spec.signal`` and is a random token otherwise (ids are never cast: the variant's dtype applies to floats)."""
    templates = torch.randint(0, spec.vocab, (NUM_CLASSES,) + spec.input_shape[1:], generator=data)
    out = []
    for _ in range(NUM_BATCHES):
        y = torch.randint(0, NUM_CLASSES, (spec.input_shape[0],), generator=data)
        noise = torch.randint(0, spec.vocab, spec.input_shape, generator=data)
        keep = torch.rand(spec.input_shape, generator=data) < spec.signal
        out.append((torch.where(keep, templates[y], noise), y))
    return out


def _build(model_name: str, variant_name: str):
    """(step, dtype, parameter count) of a freshly built, seeded model trained by ``variant_name``."""
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build()
    params = sum(p.numel() for p in model.parameters())
    step, dtype = VARIANTS[variant_name].build(model, spec)
    del model  # the step holds what it trains; optimize() returned a copy, and the original must not stay alive
    return step, dtype, params


class _CopyCounter(TorchDispatchMode):
    """Counts the copies of one step at the top of ATen's dispatch (autograd's backward included; not the copies an
    op makes inside its own kernel): ``copy_`` (in-place copies and casts), ``_to_copy`` (casts) and ``clone``
    (``.contiguous()`` of permuted heads and the like), with the bytes each writes."""

    def __init__(self):
        super().__init__()
        self.calls = {"copy_": 0, "_to_copy": 0, "clone": 0}
        self.bytes = {"copy_": 0, "_to_copy": 0, "clone": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.calls:
            self.calls[name] += 1
            target = out if isinstance(out, torch.Tensor) else args[0]
            self.bytes[name] += target.numel() * target.element_size()
        return out


def count_copies(step, x, y) -> dict | None:
    """Copies and casts of one (untimed) step: calls and MiB per kind; None where the step cannot run under a
    dispatch mode (compiled steps)."""
    counter = _CopyCounter()
    try:
        with counter:
            step(x, y)
    except Exception:  # noqa: BLE001 -- a compiled graph may refuse the mode; the count is then unknown, not wrong
        return None
    return {name: {"calls": counter.calls[name], "mib": counter.bytes[name] / 2**20} for name in counter.calls}


def worker(model_name: str, variant_name: str, pin_malloc: bool = False) -> None:
    """Serve train steps of one (model, variant) over stdin/stdout, one JSON line per reply.

    Replies: a "ready" line after setup; per "step" request ``{"loss", "time_s", "cpu_s"}`` (wall and process CPU
    seconds); on EOF the process's peak RSS, then the copies and casts of one more (untimed) step.
    """
    pinned = pin_mmap_threshold() if pin_malloc else False
    step, dtype, params = _build(model_name, variant_name)
    data = batches(MODELS[model_name], dtype)
    print(json.dumps({"params": params, "threads": torch.get_num_threads(), "setup_rss_mb": _rss_mb(),
                      "mmap_threshold_pinned": pinned, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "bf16_compute": compute_policy.info()["bf16_compute"]}), flush=True)
    for i, _ in enumerate(sys.stdin):
        x, y = data[i % NUM_BATCHES]
        start, cpu = time.perf_counter(), time.process_time()
        loss = step(x, y)
        print(json.dumps({"loss": loss, "time_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}),
              flush=True)
    peak = _rss_mb()
    x, y = data[0]
    print(json.dumps({"peak_rss_mb": peak, "copies_per_step": count_copies(step, x, y)}), flush=True)


def _command(threads: int | None, *args: str) -> list[str]:
    return [sys.executable, "-m", MODULE, *args] + (["--threads", str(threads)] if threads is not None else [])


class Worker:
    """The driver's end of one worker process: ``step()`` runs one step there and returns its seconds."""

    def __init__(self, model_name: str, variant_name: str, threads: int | None, pin_malloc: bool = False,
                 root: Path = REPO_ROOT):
        cmd = _command(threads, "worker", model_name, variant_name) + (["--pin-malloc"] if pin_malloc else [])
        self.name = f"{model_name}/{variant_name}"
        # The worker imports ipex_train from ``root`` (python -m puts the working directory first on sys.path).
        self.proc = subprocess.Popen(cmd, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.result = {"model": model_name, "variant": variant_name, **self._read()}
        self.losses, self.times, self.cpu = [], [], []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker {self.name} exited with code {self.proc.wait()}")
        return json.loads(line)

    def step(self) -> float:
        """One train step in the worker; its wall seconds as the worker measured them."""
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        reply = self._read()
        self.losses.append(reply["loss"])
        self.times.append(reply["time_s"])
        self.cpu.append(reply["cpu_s"])
        return reply["time_s"]

    def finish(self, warmup: int) -> dict:
        """Close the worker; the result with the steps after the first ``warmup`` as the timed ones."""
        self.proc.stdin.close()
        self.result.update(self._read())
        self.proc.wait()
        self.result.update(warmup=warmup, losses=self.losses, warmup_times_s=self.times[:warmup])
        if len(self.times) > warmup:
            timed = summarize(self.times[warmup:])
            cpu = summarize(self.cpu[warmup:])
            self.result.update(step_times_s=list(timed.samples), median_step_s=timed.median,
                               min_step_s=timed.best, spread=timed.spread, step_cpu_s=list(cpu.samples),
                               median_cpu_s=cpu.median)
        return self.result


def run_workers(workers: dict[str, Worker], steps: dict[str, int], warmup: dict[str, int],
                steady_within: float | None, max_warmup: dict[str, int]) -> tuple[dict[str, dict], Rounds]:
    """Interleave the workers' steps (timing.interleaved, self-timed): each warms up until steady, then runs its
    timed steps round-robin with the others. Returns each worker's result and the rounds (for paired ratios)."""
    rounds = interleaved({k: w.step for k, w in workers.items()}, steps, warmup=warmup,
                         steady_within=steady_within, max_warmup=max_warmup, self_timed=True)
    return {k: w.finish(rounds.warmup_calls[k]) for k, w in workers.items()}, rounds


def plain_loop(model_name: str, variants: list[str], steps: int, warmup: int) -> dict[str, dict]:
    """Each variant built, warmed up (``warmup`` steps) and timed (``steps`` steps) in turn in this process, with
    nothing between its steps: the check of the interleaved multi-process harness."""
    out = {}
    for name in variants:
        step, dtype, _ = _build(model_name, name)
        data = batches(MODELS[model_name], dtype)
        times = []
        for i in range(warmup + steps):
            x, y = data[i % NUM_BATCHES]
            start = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - start)
        timed = summarize(times[warmup:])
        out[name] = {"best_s": timed.best, "median_s": timed.median, "spread": timed.spread,
                     "step_times_s": list(timed.samples)}
        del step, data
    return out


def run_plain_loop(model_name: str, variants: list[str], steps: int, warmup: int, threads: int | None) -> dict:
    """:func:`plain_loop` in a fresh process (so that it shares nothing with the harness's workers)."""
    cmd = _command(threads, "plain", model_name, *variants, "--steps", str(steps), "--warmup", str(warmup))
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"plain loop {' '.join(cmd[1:])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """The worker and plain-loop processes' entry point (started by the driver, not by hand)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("worker", "plain"))
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    parser.add_argument("--threads", type=int)
    parser.add_argument("--pin-malloc", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.mode == "worker":
        if len(args.variants) != 1:
            parser.error("worker: exactly one variant")
        worker(args.model, args.variants[0], pin_malloc=args.pin_malloc)
    else:
        print(json.dumps(plain_loop(args.model, args.variants, args.steps, args.warmup)))


if __name__ == "__main__":
    main()
