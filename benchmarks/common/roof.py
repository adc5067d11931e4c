"""The bf16 matmul roof a train step is held to, and a step's matmul-class FLOPs (bench_train_step's roof share)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .timing import interleaved
from .train_models import ModelSpec, example_input


def matmul_roof_gflops(n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of an n^3 bf16 matmul here (best of ``repeats``, after a warm-up): the bf16 roof a step is held to."""
    a, b = torch.randn(n, n).to(torch.bfloat16), torch.randn(n, n).to(torch.bfloat16)
    best = interleaved({"mm": lambda: a @ b}, repeats, warmup=1).best()["mm"]
    return 2 * n**3 / best / 1e9


def attention_products(query: tuple, key: tuple, value: tuple, backward: bool) -> list[tuple[int, tuple, tuple]]:
    """The batched products an attention call is charged, as (batch, left shape, right shape), from the shapes of
    its query (b, hq, s, d), key (b, hkv, t, d) and value (b, hkv, t, dv): 2 forward (scores, probabilities x V);
    5 backward (the scores recomputed, and the grads of the probabilities, V, Q and K). Grouped key/value heads
    (hkv < hq, enable_gqa) do not change the work: every query head attends to its group's keys, so the batch is
    b * hq. Counted here from the shapes, not by torch's formula (whose signature and GQA support vary by version:
    torch 2.11's asserts equal head counts)."""
    b, h, s, d = query
    t, dv = key[-2], value[-1]
    if key[-1] != d or value[-2] != t or key[0] != b or h % key[1] or h % value[1]:
        raise ValueError(f"attention_products: shapes do not form an attention call: query {tuple(query)}, key "
                         f"{tuple(key)}, value {tuple(value)}")
    if not backward:
        pairs = [((s, d), (d, t)), ((s, t), (t, dv))]
    else:
        pairs = [((s, d), (d, t)), ((s, dv), (dv, t)), ((t, s), (s, dv)), ((s, t), (t, d)), ((t, s), (s, d))]
    return [(b * h, x, y) for x, y in pairs]


def attention_flops(query: tuple, key: tuple, value: tuple, backward: bool) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of :func:`attention_products`."""
    return sum(2 * n * x[0] * x[1] * y[1] for n, x, y in attention_products(query, key, value, backward))


def _sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return attention_flops(q, k, v, backward=False)


def _sdpa_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return attention_flops(q, k, v, backward=True)


def step_flops(spec: ModelSpec) -> float:
    """Matmul-class FLOPs of one forward + backward of the model (torch.utils.flop_counter, fp32 run: the count does
    not depend on the dtype), attention included: torch's counter has no formula for the CPU attention ops, so they
    are charged as :func:`attention_products` counts them (2 products forward, 5 backward, grouped heads too)."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    cpu_attention = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
                     aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops}
    torch.manual_seed(0)
    model = spec.build()
    x = example_input(spec)
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
    the batched products :func:`attention_products` charges it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in _PRODUCTS:
                products.append((func, [_Operand(tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                                        for a in args]))
            elif name in _SDPA:
                backward = name.endswith("backward")
                q, k, v = args[1:4] if backward else args[:3]  # the backward's first argument is grad_out
                for batch, x, y in attention_products(q.shape, k.shape, v.shape, backward):
                    products.append((torch.ops.aten.bmm.default, [_Operand((batch, *x)), _Operand((batch, *y))]))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = spec.build()
    x = example_input(spec)
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

    def sweep():
        for op, ops in calls:
            op(*ops)

    # The warm-up sweep fills oneDNN's primitive cache.
    return {"products": len(calls), "seconds": interleaved({"sweep": sweep}, repeats, warmup=1).best()["sweep"]}
