"""The bf16 matmul roof a train step is held to, and a step's matmul-class FLOPs (bench_train_step's roof share)."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from .train_models import ModelSpec


def matmul_roof_gflops(n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of an n^3 bf16 matmul here (best of ``repeats``, after a warm-up): the bf16 roof a step is held to."""
    a, b = torch.randn(n, n).to(torch.bfloat16), torch.randn(n, n).to(torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def step_flops(spec: ModelSpec) -> float:
    """Matmul-class FLOPs of one forward + backward of the model (torch.utils.flop_counter, fp32 run: the count does
    not depend on the dtype), attention included: torch's counter has no formula for the CPU attention ops, so they
    are charged as it charges the other attention kernels (2 products forward, 5 backward)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v)}
    torch.manual_seed(0)
    model = spec.build()
    x = torch.randn(spec.input_shape)
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        model(x).float().sum().backward()
    return float(counter.get_total_flops())


class _Operand(NamedTuple):
    """A recorded tensor argument: what the replay allocates in its place."""

    shape: tuple
    stride: tuple | None = None  # None: contiguous


_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")
_SDPA = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _step_products(spec: ModelSpec) -> list[tuple]:
    """The products of one forward + backward of the model (fp32 run), as (op, arguments with each tensor replaced by
    its shape and strides): every mm/addmm/bmm/baddbmm/convolution(_backward) as called, and each attention call as
    the batched products torch's flop counter charges it (2 forward; 5 backward: the score recompute and four
    gradient products)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _PRODUCTS:
                products.append((func, [_Operand(tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                                        for a in args]))
            elif name in _SDPA:
                q = args[1] if name.endswith("backward") else args[0]  # the backward's first argument is grad_out
                b, h, s, d = q.shape
                t = (args[2] if name.endswith("backward") else args[1]).shape[2]
                pairs = [((s, d), (d, t)), ((s, t), (t, d))]  # scores; probabilities x V
                if name.endswith("backward"):
                    pairs = [((s, d), (d, t)), ((s, d), (d, t)), ((t, s), (s, d)), ((s, t), (t, d)), ((t, s), (s, d))]
                for x, y in pairs:
                    products.append((torch.ops.aten.bmm.default, [_Operand((b * h, *x)), _Operand((b * h, *y))]))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = spec.build()
    x = torch.randn(spec.input_shape)
    with Recorder():
        model(x).float().sum().backward()
    return products


def _operand(operand, dtype):
    shape, stride = operand
    if stride is None:
        return torch.randn(shape, dtype=dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride))  # broadcast (stride 0) operands share elements
    return torch.randn(extent, dtype=dtype).as_strided(shape, stride)


def replay_calls(spec: ModelSpec) -> list[tuple]:
    """The step's products (see _step_products) as (op, arguments) on random bf16 operands, ready to call."""
    return [(op, [_operand(a, torch.bfloat16) if isinstance(a, _Operand) else a for a in args])
            for op, args in _step_products(spec)]


def gemm_only_bound(spec: ModelSpec, repeats: int = 3) -> dict:
    """How fast the step's matrix products alone run in bf16: each product of one forward + backward replayed on
    random bf16 operands of the same shapes and strides (oneDNN, as under optimize(bf16)), best of ``repeats``
    sweeps. A step that did nothing but its products would take ``seconds``; no step can reach a larger share of
    the roof than ``step_flops / seconds`` (reported by bench_train_step as the GEMM-only bound)."""
    calls = replay_calls(spec)
    best = float("inf")
    for _ in range(repeats + 1):  # the first sweep warms oneDNN's primitive cache
        start = time.perf_counter()
        for op, ops in calls:
            op(*ops)
        best = min(best, time.perf_counter() - start)
    return {"products": len(calls), "seconds": best}
