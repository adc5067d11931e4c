"""What every recipe shares: flags, the timed training loop with a progress bar, per-run processes (so peak
memory is per variant), the report table, JSON and the PNG plot."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_common_flags(parser: argparse.ArgumentParser, *, dtype: str, optimizer: str, optimizers: list[str],
                     steps: int, batch_size: int, channels_last: bool) -> None:
    """The flags every recipe takes: dtype, optimizer, steps, batch size, channels-last, fp32
    comparison, JSON and plot outputs."""
    parser.add_argument("--dtype", choices=list(DTYPES), default=dtype, help="dtype passed to ipex_train.optimize")
    parser.add_argument("--optimizer", choices=optimizers, default=optimizer)
    parser.add_argument("--steps", type=int, default=steps, help="training steps")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=None, help="learning rate (recipe default if omitted)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=channels_last,
                        help="channels-last memory format for conv weights and inputs")
    parser.add_argument("--compare-fp32", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the same recipe in plain fp32 PyTorch")
    parser.add_argument("--json", metavar="PATH", help="write the metrics as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write loss curves and step times as PNG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


STATE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "int8": "int8"}


def add_state_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """--state-dtype: optimize()'s optimizer_state_dtype (reduced-byte optimizer state)."""
    parser.add_argument("--state-dtype", choices=list(STATE_DTYPES), default="float32",
                        help="optimizer state dtype of the ipex_train run (bfloat16: stochastic rounding, int8: "
                             "block-wise 8-bit)")


@dataclass
class RunResult:
    """Metrics of one training run."""

    name: str
    dtype: str
    steps: int
    batch_size: int
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    accuracy: float | None = None

    @property
    def median_step_s(self) -> float:
        """Median step time, skipping the first steps (warm-up: allocations, kernel selection)."""
        if not self.step_times_s:  # a run resumed from its final checkpoint trains no step
            return float("nan")
        times = self.step_times_s[min(3, len(self.step_times_s) - 1):]
        return statistics.median(times)

    def summary(self) -> dict:
        """The scalar metrics of the run."""
        tail = self.losses[-10:]
        return {
            "name": self.name,
            "dtype": self.dtype,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "median_step_ms": 1e3 * self.median_step_s,
            "samples_per_s": self.batch_size / self.median_step_s,
            "peak_rss_mib": self.peak_rss_mib,
            "final_loss": sum(tail) / len(tail) if tail else float("nan"),
            "accuracy": self.accuracy,
        }


def train_loop(name: str, dtype: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batches: Iterator[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable, steps: int,
               batch_size: int, progress: bool, scheduler=None) -> RunResult:
    """The user's plain training loop: zero_grad, forward, loss, backward, step, scheduler step; timed."""
    from tqdm import tqdm

    result = RunResult(name=name, dtype=dtype, steps=steps, batch_size=batch_size)
    model.train()
    # The bar only on a terminal: piped or logged output stays one line per run.
    bar = tqdm(range(steps), desc=f"{name:>24}", disable=not progress or not sys.stderr.isatty(), leave=True,
               dynamic_ncols=True)
    for _ in bar:
        x, y = next(batches)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        result.step_times_s.append(time.perf_counter() - t0)
        result.losses.append(loss.detach().item())
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}", ms=f"{1e3 * result.step_times_s[-1]:.1f}")
    return result


def prepare(args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """The variant one run trains: ``ipex_train.optimize(dtype=args.dtype)``, or plain fp32 PyTorch when
    ``args.vanilla``. Returns (run name, dtype name, model, optimizer, memory format for the inputs)."""
    import ipex_train

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.vanilla:
        return "torch fp32", "float32", model.to(memory_format=memory_format), optimizer, memory_format
    state = getattr(args, "state_dtype", "float32")  # recipes with add_state_dtype_flag
    model, optimizer = ipex_train.optimize(model, optimizer, dtype=DTYPES[args.dtype],
                                           auto_channels_last=args.channels_last,
                                           optimizer_state_dtype=STATE_DTYPES[state])
    name = f"ipex_train {args.dtype}" + ("" if state == "float32" else f", {state} state")
    return name, args.dtype, model, optimizer, memory_format


def compare(recipe: str, one_run: Callable[[argparse.Namespace], RunResult], args: argparse.Namespace,
            title: str) -> list[RunResult]:
    """Run ``one_run`` with ipex_train and, with --compare-fp32, in plain fp32 PyTorch, each in its own process;
    print the report; write the JSON and the plot when asked. ``one_run`` must be a module-level function (it is
    pickled into the subprocess) that reads ``args.vanilla``."""
    results = [run_isolated(one_run, argparse.Namespace(**vars(args), vanilla=False))]
    if args.compare_fp32:
        results.append(run_isolated(one_run, argparse.Namespace(**vars(args), vanilla=True)))
    print()
    print(report(results))
    if len(results) == 2:
        a, b = results[0].accuracy, results[1].accuracy
        diff = "" if a is None or b is None else f"accuracy {args.dtype} - fp32: {100 * (a - b):+.2f} points; "
        print(f"\n{diff}step time ratio {results[0].median_step_s / results[1].median_step_s:.2f}x")
    if args.json:
        write_json(args.json, results, {"recipe": recipe, "args": vars(args)})
        print(f"metrics: {os.path.abspath(args.json)}")
    if args.plot:
        plot(args.plot, results, title)
        print(f"plot:    {os.path.abspath(args.plot)}")
    return results


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _die_with_parent(parent: int) -> None:
    """End this process when its parent ends, even by SIGKILL (Linux): a run killed with kill -9 must not leave
    its training process running on (writing checkpoints beside the run that resumes)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # not Linux: the child outlives a killed parent, as before
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child(fn, args, queue, parent: int):
    _die_with_parent(parent)
    try:
        result = fn(args)
        result.peak_rss_mib = peak_rss_mib()
        queue.put(("ok", result))
    except BaseException as e:  # report the failure to the parent instead of hanging it
        import traceback

        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_isolated(fn: Callable[[argparse.Namespace], RunResult], args: argparse.Namespace) -> RunResult:
    """Run ``fn(args)`` in a fresh process so its peak memory is its own; re-raises its error here. ``fn`` returns a
    RunResult (or a subclass defined at module level: the object comes back pickled)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue, os.getpid()))
    proc.start()
    status, payload = queue.get()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"recipe run failed in its subprocess:\n{payload}")
    return payload


def machine() -> dict:
    """A short description of the machine for reports."""
    import ipex_train

    info = ipex_train.info()
    return {k: info[k] for k in ("cpu", "torch", "kernel_variant", "threads", "bf16_compute_policy")} | {
        "isa": [k for k, v in info["isa"].items() if v],
        "python": platform.python_version(),
    }


def report(results: list[RunResult]) -> str:
    """A plain-text table of the runs, with ratios to the first run."""
    rows = [r.summary() for r in results]
    base = rows[0]
    head = (f"{'run':<26}{'step ms':>9}{'samples/s':>11}{'vs first':>9}{'peak MiB':>10}{'final loss':>12}"
            f"{'accuracy':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}%"
        lines.append(f"{r['name']:<26}{r['median_step_ms']:>9.2f}{r['samples_per_s']:>11.1f}"
                     f"{r['median_step_ms'] / base['median_step_ms']:>8.2f}x{r['peak_rss_mib']:>10.0f}"
                     f"{r['final_loss']:>12.4f}{acc:>10}")
    return "\n".join(lines)


def write_json(path: str, results: list[RunResult], extra: dict | None = None) -> None:
    """Metrics (summary and per-step series) of every run, plus the machine description."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = {"machine": machine(), "runs": [r.summary() | {"losses": r.losses, "step_times_s": r.step_times_s}
                                           for r in results]}
    data.update(extra or {})
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def plot(path: str, results: list[RunResult], title: str) -> None:
    """Loss curves (left) and per-step times (right) of every run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ax_loss.plot(r.losses, label=r.name, linewidth=1)
        ax_time.plot([1e3 * t for t in r.step_times_s], label=r.name, linewidth=1)
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss", yscale="log")
    ax_time.set(xlabel="step", ylabel="ms", title="step time")
    for ax in (ax_loss, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int):
    """Warm-up then anneal from the optimizer's lr, so that even a short run ends at a small LR."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"],
                                               total_steps=total_steps)


def cycle(loader_fn: Callable[[], Iterator]) -> Iterator:
    """Endless iterator over epochs of ``loader_fn()``."""
    while True:
        yield from loader_fn()
