"""The bf16 matmul roof a train step is held to, and a step's matmul-class FLOPs (bench_train_step's roof share)."""
from __future__ import annotations

import time

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
    not depend on the dtype)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = spec.build()
    x = torch.randn(spec.input_shape)
    with FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    return float(counter.get_total_flops())
