"""bench_train_step's variants: how each trains a freshly built fp32 model.

Adding a variant is one function decorated with ``@variant(name)``: it gets the model and its ModelSpec and returns
``(step, dtype)`` where ``step(x, y) -> float`` does one train step and ``dtype`` is the dtype the inputs are fed in.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import ipex_train
from ipex_train import compute_policy

from .train_models import ModelSpec

BF16 = torch.bfloat16

# ``bench_train_step --cpu-isa avx2``: every kernel library limited to AVX2 and ipex_train's emulated bf16 policy, so
# that a CPU with AVX-512 and bf16 units runs what an AVX2-only CPU without them runs (fp32 kernels of AVX2 width,
# torch's bf16 kernels without bf16 units: reference ones). Set in the driver's environment, which workers inherit.
CPU_ISA_ENV = "IPEX_TRAIN_BENCH_CPU_ISA"
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
            "IPEX_TRAIN_KERNEL": "avx2", "IPEX_TRAIN_BF16_COMPUTE": "emulated", CPU_ISA_ENV: "avx2"}


def native_bf16() -> bool:
    """Whether torch's bf16 kernels run on bf16 units here: the CPU has them and the run is not limited to AVX2.
    Where they do, autocast is a normal timed variant; elsewhere they run reference kernels (minutes per step)."""
    return compute_policy.cpu_has_native_bf16() and os.environ.get(CPU_ISA_ENV) != "avx2"

Step = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class Variant:
    build: Callable[[nn.Module, ModelSpec], tuple[Step, torch.dtype]]
    bf16_kernels: bool  # runs torch's bf16 kernels
    compiled: bool  # torch.compile: its first step compiles

    @property
    def slow(self) -> bool:
        """Runs torch's bf16 kernels without bf16 units: few steps."""
        return self.bf16_kernels and not native_bf16()


VARIANTS: dict[str, Variant] = {}


def variant(name: str, bf16_kernels: bool = False, compiled: bool = False):
    """Register ``fn(model, spec) -> (step, input_dtype)`` as benchmark variant ``name`` (``bf16_kernels``: it runs
    torch's bf16 kernels, slow where the CPU has no bf16 units)."""

    def register(fn):
        VARIANTS[name] = Variant(fn, bf16_kernels, compiled)
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


def _optimizer(params, spec: ModelSpec) -> torch.optim.Optimizer:
    return spec.optimizer(params, spec.lr)


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


def _bf16_with_policy(model: nn.Module, spec: ModelSpec, policy: str) -> tuple[Step, torch.dtype]:
    model = _bf16_model(model)
    compute_policy.attach(model, policy)
    master = MasterWeights(model)
    optimizer = _optimizer(master.masters, spec)
    optimizer.register_step_post_hook(master.sync_params)
    return _train_step(model, optimizer, after_backward=master.sync_grads), BF16


@variant("fp32")
def _fp32(model, spec):
    return _train_step(model, _optimizer(model.parameters(), spec)), torch.float32


@variant("autocast_bf16", bf16_kernels=True)
def _autocast(model, spec):
    return _train_step(model, _optimizer(model.parameters(), spec), autocast=True), torch.float32


@variant("autocast_emulated")
def _autocast_emulated(model, spec):
    compute_policy.attach(model, "emulated")
    return _train_step(model, _optimizer(model.parameters(), spec), autocast=True), torch.float32


@variant("bf16_emulated")
def _bf16_emulated(model, spec):
    return _bf16_with_policy(model, spec, "emulated")


@variant("optimize_bf16")
def _optimize_bf16(model, spec):
    # The one-line use: optimize(), then the user's unchanged loop (no autocast): weights bf16 (split), the
    # activations of converted layers bf16, matmul-class ops computed in fp32 by the compute policy on this CPU.
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), spec), dtype=BF16)
    return _train_step(model, optimizer), torch.float32


@variant("optimize_bf16_emulated")
def _optimize_bf16_emulated(model, spec):
    # What a CPU without bf16 units gets from optimize(bf16), forced here so that a bf16 machine measures it too.
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), spec), dtype=BF16,
                                           bf16_compute="emulated")
    return _train_step(model, optimizer), torch.float32


@variant("optimize_bf16_contiguous")
def _optimize_bf16_contiguous(model, spec):
    # optimize(bf16) without its default channels-last conv layout: at the benchmark's 64 px the last ResNet stage
    # runs at 2x2, where oneDNN's channels-last kernels (and the weight-grad layout copies around them) are slower.
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), spec), dtype=BF16,
                                           auto_channels_last=False)
    return _train_step(model, optimizer), torch.float32


@variant("fp32_compile", compiled=True)
def _fp32_compile(model, spec):
    return _train_step(torch.compile(model), _optimizer(model.parameters(), spec)), torch.float32


@variant("autocast_compile", bf16_kernels=True, compiled=True)
def _autocast_compile(model, spec):
    return _train_step(torch.compile(model), _optimizer(model.parameters(), spec), autocast=True), torch.float32


@variant("optimize_bf16_compile", compiled=True)
def _optimize_bf16_compile(model, spec):
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), spec), dtype=BF16)
    return _train_step(torch.compile(model), optimizer), torch.float32


@variant("optimize_bf16_autocast")
def _optimize_bf16_autocast(model, spec):
    # The loop IPEX documents: autocast around the forward, so activations outside matmul-class ops stay fp32
    # (autocast's bf16 copies of them are saved for backward beside the fp32 ones: more memory).
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), spec), dtype=BF16)
    return _train_step(model, optimizer, autocast=True), torch.float32


@variant("optimize_fp32")
def _optimize_fp32(model, spec):
    model, optimizer = ipex_train.optimize(model, _optimizer(model.parameters(), spec))
    return _train_step(model, optimizer), torch.float32


@variant("bf16_native", bf16_kernels=True)
def _bf16_native(model, spec):
    return _bf16_with_policy(model, spec, "native")


# What quick mode runs unless --variants says otherwise: the peers of the step-time targets.
QUICK_VARIANTS = ("fp32", "autocast_bf16", "optimize_bf16", "optimize_bf16_emulated", "fp32_compile",
                  "autocast_compile", "optimize_bf16_compile")
