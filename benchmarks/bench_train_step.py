"""End-to-end train step: time, loss and peak memory of plain fp32 torch, torch autocast bf16, the bf16 compute
policies, and ipex_train.optimize(dtype=bf16 / fp32), against fp32.

Run from the repository root::

    python -m benchmarks.bench_train_step --quick [--json out.json] [--threads N]

Two models (a small ResNet-style CNN, ~2.7M params, batch 16 at 64x64; a 4-layer
nn.TransformerEncoder, d_model 512, ~12.7M params, batch 8, seq 128), each trained with every
variant in VARIANTS on the same learnable data with SGD (bf16-weight variants keep fp32 master
weights). Each (model, variant) pair runs in its own subprocess so that its peak RSS
(resource.getrusage ru_maxrss) is its own; the driver interleaves their steps round-robin so that
load from other processes hits every variant alike. Step time is the median over the steps after
warm-up. Variants that run torch's bf16 kernels are slow on CPUs without bf16 units, so they get
few steps (one, in quick mode).

Memory is measured in a second, untimed phase (MEMORY_STEPS steps per variant, one process at a time)
with glibc's mmap threshold pinned (see _pin_mmap_threshold): peak RSS and its growth during the run
then follow the tensors a variant holds rather than the allocator's heap retention. The timed phase's
peak RSS under glibc's defaults is printed beside it ('RSS MB') for reference.

Adding a variant is one function decorated with ``@variant(name)``: it gets the freshly built
fp32 model and returns ``(step, dtype)`` where ``step(x, y) -> float`` does one train step and
``dtype`` is the dtype the inputs are fed in.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import ipex_train
from ipex_train import compute_policy

BF16 = torch.bfloat16
NUM_CLASSES = 10
NUM_BATCHES = 4  # a small fixed dataset, cycled, so the loss curve reflects fitting it
REPO_ROOT = Path(__file__).resolve().parent.parent

Step = Callable[[torch.Tensor, torch.Tensor], float]


# --------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and a projected shortcut when needed."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN for 64x64 inputs, ~2.7M parameters."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        widths = [(32, 64, 2), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.blocks = nn.Sequential(*(BasicBlock(i, o, s) for i, o, s in widths))
        self.head = nn.Linear(256, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Encoder(nn.Module):
    """nn.TransformerEncoder stack (4 layers, d_model 512) with a mean-pool classifier head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(512, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    lr: float  # SGD with momentum: updates linear in the gradient, unlike Adam's early sign-like steps
    signal: float  # class template scale against unit noise: sets how fast the task is learnt


MODELS = {
    "resnet_cnn": ModelSpec(SmallResNet, (16, 3, 64, 64), 0.003, 0.05),
    # lr 0.002: at 0.01 the fp32 run itself diverges after ~20 steps (its loss rises), and two diverging runs
    # cannot show whether two numerics agree.
    "transformer": ModelSpec(Encoder, (8, 128, 512), 0.002, 0.05),
}


# --------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    build: Callable[[nn.Module, float], tuple[Step, torch.dtype]]
    slow: bool  # runs torch's bf16 kernels: few steps


VARIANTS: dict[str, Variant] = {}


def variant(name: str, slow: bool = False):
    """Register ``fn(model, lr) -> (step, input_dtype)`` as benchmark variant ``name``."""

    def register(fn):
        VARIANTS[name] = Variant(fn, slow)
        return fn

    return register


def _train_step(model: nn.Module, optimizer, autocast: bool = False, after_backward=None) -> Step:
    def step(x, y):
        with torch.autocast("cpu", BF16, enabled=autocast):
            loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        return loss.item()

    return step


def _optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class MasterWeights:
    """fp32 master copies of a bf16 model's parameters, so that small updates are not rounded away.

    The optimizer steps the masters; ``sync_grads`` feeds them the bf16 grads and
    ``sync_params`` (an optimizer step post-hook) writes the updated values back in bf16.
    """

    def __init__(self, model: nn.Module):
        self.pairs = [(p, p.detach().float().requires_grad_()) for p in model.parameters()]
        self.masters = [m for _, m in self.pairs]

    def sync_grads(self):
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # the optimizer zeroes only the masters' grads: the bf16 ones would accumulate

    def sync_params(self, *_):
        with torch.no_grad():
            torch._foreach_copy_([p for p, _ in self.pairs], self.masters)


def _bf16_model(model: nn.Module) -> nn.Module:
    """bf16 weights, norm layers kept in fp32 (torch runs bf16 activations through them)."""
    model.to(BF16)
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
            module.float()
    return model


def _bf16_with_policy(model: nn.Module, lr: float, policy: str) -> tuple[Step, torch.dtype]:
    model = _bf16_model(model)
    compute_policy.attach(model, policy)
    master = MasterWeights(model)
    optimizer = _optimizer(master.masters, lr)
    optimizer.register_step_post_hook(master.sync_params)
    return _train_step(model, optimizer, after_backward=master.sync_grads), BF16


@variant("fp32")
def _fp32(model, lr):
    return _train_step(model, _optimizer(model.parameters(), lr)), torch.float32


@variant("autocast_bf16", slow=True)
def _autocast(model, lr):
    return _train_step(model, _optimizer(model.parameters(), lr), autocast=True), torch.float32


@variant("autocast_emulated")
def _autocast_emulated(model, lr):
    compute_policy.attach(model, "emulated")
    return _train_step(model, _optimizer(model.parameters(), lr), autocast=True), torch.float32


@variant("bf16_emulated")
def _bf16_emulated(model, lr):
    return _bf16_with_policy(model, lr, "emulated")


@variant("optimize_bf16")
def _optimize_bf16(model, lr):
    # The one-line use: optimize(), then the user's unchanged loop (no autocast): weights bf16 (split), the
    # activations of converted layers bf16, matmul-class ops computed in fp32 by the compute policy on this CPU.
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), lr), dtype=BF16)
    return _train_step(model, optimizer), torch.float32


@variant("optimize_bf16_autocast")
def _optimize_bf16_autocast(model, lr):
    # The loop IPEX documents: autocast around the forward, so activations outside matmul-class ops stay fp32
    # (autocast's bf16 copies of them are saved for backward beside the fp32 ones: more memory).
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), lr), dtype=BF16)
    return _train_step(model, optimizer, autocast=True), torch.float32


@variant("optimize_fp32")
def _optimize_fp32(model, lr):
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), lr))
    return _train_step(model, optimizer), torch.float32


@variant("bf16_native", slow=True)
def _bf16_native(model, lr):
    return _bf16_with_policy(model, lr, "native")


# --------------------------------------------------------------------------- worker


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _batches(spec: ModelSpec, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task: each class has a random template, inputs are template + noise.

    Random labels would make the loss curve chaotic (memorisation), and a chaotic curve cannot
    show whether two numerics agree.
    """
    data = torch.Generator().manual_seed(1)
    templates = torch.randn((NUM_CLASSES,) + spec.input_shape[1:], generator=data)
    batches = []
    for _ in range(NUM_BATCHES):
        y = torch.randint(0, NUM_CLASSES, (spec.input_shape[0],), generator=data)
        x = templates[y] * spec.signal + torch.randn(spec.input_shape, generator=data)
        batches.append((x.to(dtype), y))
    return batches


def _pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at its 128 KiB default, so that freed large tensors go back to the OS.

    By default glibc raises the threshold to the size of each large block freed (up to 32 MiB), after which such
    blocks come from the heap and stay in the RSS when freed: peak RSS then measures heap retention (the order and
    sizes of frees) as much as the memory a variant holds. With the threshold pinned, peak RSS follows the live
    tensors, at the price of page faults on every large allocation (slower steps), which is why the memory phase
    is separate from the timed one. Returns False where this is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def worker(model_name: str, variant_name: str, pin_malloc: bool = False) -> None:
    """Serve train steps of one (model, variant) over stdin/stdout, one JSON line per reply.

    Replies: a "ready" line after setup; per "step" request ``{"loss", "time_s"}``; on EOF the
    process's peak RSS. The driver interleaves steps of several workers so that load changes on
    the machine hit all variants alike, while each keeps its own address space for ru_maxrss.
    """
    pinned = _pin_mmap_threshold() if pin_malloc else False
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build()
    params = sum(p.numel() for p in model.parameters())
    step, dtype = VARIANTS[variant_name].build(model, spec.lr)
    del model  # the step holds what it trains; optimize() returned a copy, and the original must not stay alive
    batches = _batches(spec, dtype)
    print(json.dumps({"params": params, "threads": torch.get_num_threads(), "setup_rss_mb": _rss_mb(),
                      "mmap_threshold_pinned": pinned}), flush=True)
    for i, _ in enumerate(sys.stdin):
        x, y = batches[i % NUM_BATCHES]
        start = time.perf_counter()
        loss = step(x, y)
        print(json.dumps({"loss": loss, "time_s": time.perf_counter() - start}), flush=True)
    print(json.dumps({"peak_rss_mb": _rss_mb()}), flush=True)


# --------------------------------------------------------------------------- driver


class _Worker:
    def __init__(self, model_name: str, variant_name: str, steps: int, warmup: int, threads: int | None,
                 pin_malloc: bool = False):
        cmd = [sys.executable, "-m", "benchmarks.bench_train_step", "--worker", model_name, variant_name]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        if pin_malloc:
            cmd += ["--pin-malloc"]
        self.name = f"{model_name}/{variant_name}"
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.result = {"model": model_name, "variant": variant_name, "warmup": warmup, **self._read()}
        self.remaining, self.warmup, self.losses, self.times = warmup + steps, warmup, [], []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker {self.name} exited with code {self.proc.wait()}")
        return json.loads(line)

    def step(self) -> None:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        reply = self._read()
        self.losses.append(reply["loss"])
        self.times.append(reply["time_s"])
        self.remaining -= 1

    def finish(self) -> dict:
        self.proc.stdin.close()
        self.result.update(self._read())
        self.proc.wait()
        timed = self.times[self.warmup:]
        self.result.update(losses=self.losses, step_times_s=timed, median_step_s=statistics.median(timed))
        return self.result


def run_model(model_name: str, variants: list[str], quick: bool, threads: int | None) -> list[dict]:
    """All variants of one model, their steps interleaved round-robin (one process each)."""
    workers = []
    for name in variants:
        steps, warmup = _plan(quick, name)
        print(f"{model_name}/{name}: {warmup} warm-up + {steps} timed steps", file=sys.stderr, flush=True)
        workers.append(_Worker(model_name, name, steps, warmup, threads))
    while any(w.remaining for w in workers):
        for w in workers:
            if w.remaining:
                w.step()
    return [w.finish() for w in workers]


MEMORY_STEPS = 3


def memory_run(model_name: str, variants: list[str], threads: int | None) -> dict[str, dict]:
    """Peak RSS of each variant over MEMORY_STEPS untimed steps, glibc's mmap threshold pinned (_pin_mmap_threshold),
    one worker at a time. Slow variants are left out (minutes per step; no memory target depends on them)."""
    out = {}
    for name in variants:
        if VARIANTS[name].slow:
            continue
        w = _Worker(model_name, name, MEMORY_STEPS, 0, threads, pin_malloc=True)
        while w.remaining:
            w.step()
        r = w.finish()
        out[name] = {"peak_mb": r["peak_rss_mb"], "run_mb": r["peak_rss_mb"] - r["setup_rss_mb"],
                     "pinned": r["mmap_threshold_pinned"]}
    return out


def _plan(quick: bool, variant_name: str) -> tuple[int, int]:
    """(timed steps, warm-up steps) for a variant."""
    if VARIANTS[variant_name].slow:
        return (1, 0) if quick else (2, 1)
    return (10, 1) if quick else (50, 1)


def _loss_gap(losses: list[float], reference: list[float]) -> dict:
    n = min(len(losses), len(reference))
    per_step = [abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n])]
    mean, ref_mean = statistics.fmean(losses[:n]), statistics.fmean(reference[:n])
    return {"steps": n, "mean_rel_diff": abs(mean - ref_mean) / ref_mean,
            "final_rel_diff": per_step[-1], "max_rel_diff": max(per_step)}


def _table(results: list[dict]) -> str:
    """One row per run. 'peak MB' and '+MB run' are the memory phase's (glibc mmap threshold pinned, see
    _pin_mmap_threshold); 'RSS MB' is the timed phase's peak RSS with glibc's default, for reference."""
    head = f"{'model':<12} {'variant':<23} {'params':>7} {'steps':>5} {'step s':>8} {'x fp32':>7} " \
           f"{'peak MB':>8} {'+MB run':>8} {'RSS MB':>7} {'loss[-1]':>9} {'final loss vs fp32':>19}"
    lines = [head, "-" * len(head)]
    for r in results:
        gap = r.get("loss_vs_fp32")
        gap_text = f"{100 * gap['final_rel_diff']:.3f}% @{gap['steps']}" if gap else "-"
        mem = r.get("memory")
        peak, run = (f"{mem['peak_mb']:.0f}", f"{mem['run_mb']:.0f}") if mem else ("-", "-")
        lines.append(
            f"{r['model']:<12} {r['variant']:<23} {r['params'] / 1e6:>6.2f}M {len(r['step_times_s']):>5} "
            f"{r['median_step_s']:>8.3f} {r['ratio_vs_fp32']:>7.2f} {peak:>8} {run:>8} {r['peak_rss_mb']:>7.0f} "
            f"{r['losses'][-1]:>9.4f} {gap_text:>19}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 steps, one step for slow variants")
    parser.add_argument("--json", type=Path, help="write all results to this file")
    parser.add_argument("--threads", type=int, help="torch threads per run (default: torch's default)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--pin-malloc", action="store_true", help=argparse.SUPPRESS)  # workers of the memory phase
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(*args.worker, pin_malloc=args.pin_malloc)
        return
    if "fp32" not in args.variants:
        parser.error("--variants must include fp32, the reference for ratios and losses")

    started = time.perf_counter()
    results = []
    by_model_fp32 = {}
    for model_name in args.models:
        by_variant = {r["variant"]: r for r in run_model(model_name, args.variants, args.quick, args.threads)}
        for name, mem in memory_run(model_name, args.variants, args.threads).items():
            by_variant[name]["memory"] = mem
        fp32 = by_model_fp32[model_name] = by_variant["fp32"]
        for name, r in by_variant.items():
            r["ratio_vs_fp32"] = r["median_step_s"] / fp32["median_step_s"]
            if name != "fp32":
                r["loss_vs_fp32"] = _loss_gap(r["losses"], fp32["losses"])
            results.append(r)

    print(_table(results))
    targets = []
    for r in results:
        if r["variant"] != "fp32" and not VARIANTS[r["variant"]].slow:
            gap = r["loss_vs_fp32"]
            print(f"{r['model']}/{r['variant']}: step time {r['ratio_vs_fp32']:.3f}x fp32 (target <= 1.15x); "
                  f"loss vs fp32 over {gap['steps']} steps: mean {100 * gap['mean_rel_diff']:.3f}%, "
                  f"final {100 * gap['final_rel_diff']:.3f}%, max {100 * gap['max_rel_diff']:.3f}% (target < 1% at 50 steps)")
        if r["variant"] in ("optimize_bf16", "optimize_bf16_autocast"):
            label = f"{r['model']} {r['variant']}"
            targets.append({"target": f"{label} step time <= 1.15x fp32", "value": r["ratio_vs_fp32"],
                            "pass": r["ratio_vs_fp32"] <= 1.15})
            mem, mem32 = r["memory"], by_model_fp32[r["model"]]["memory"]
            targets.append({"target": f"{label} peak RSS <= fp32 (MB, mmap threshold pinned)",
                            "value": mem["peak_mb"] / mem32["peak_mb"], "pass": mem["peak_mb"] <= mem32["peak_mb"]})
            targets.append({"target": f"{label} RSS growth during the run <= fp32 (MB, mmap threshold pinned)",
                            "value": mem["run_mb"] / max(1.0, mem32["run_mb"]), "pass": mem["run_mb"] <= mem32["run_mb"]})
            gap = r["loss_vs_fp32"]
            targets.append({"target": f"{label} final loss within 1% of fp32 after {gap['steps']} steps "
                                      "(the target is stated at 50: full mode)",
                            "value": gap["final_rel_diff"], "pass": gap["final_rel_diff"] < 0.01})
    print("\ntargets:")
    for t in targets:
        print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}  (measured {t['value']:.3f})")
    load = os.getloadavg()
    print(f"total {time.perf_counter() - started:.0f} s; load average at end {load[0]:.1f} "
          f"(other processes on this machine skew step times)")
    if args.json:
        meta = {
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpu_features": compute_policy._features(), "policy_here": compute_policy.info(),
            "quick": args.quick, "load_average_at_end": load,
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results, "targets": targets}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
