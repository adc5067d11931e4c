"""The storage layouts of a parameter as the fused kernels see it, numbered as kernels_cpu's ``Layout`` enum
(include/ipex_train/elementwise.h): the dtypes of param, aux (residual or master), grad and optimizer state.

The kernels detect a parameter's layout from its param and aux dtypes; the SYCL step, the tests and the
benchmarks read this table instead of spelling the layouts out again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """One storage layout: ``code`` (the C++ enum value), ``name`` (as tests and benchmarks call it), ``description``
    (as error messages call it), and the dtypes of param, aux (None: no aux), grad and state."""

    code: int
    name: str
    description: str
    param: torch.dtype
    aux: torch.dtype | None
    grad: torch.dtype
    state: torch.dtype


LAYOUTS: tuple[Layout, ...] = (
    Layout(0, "fp32", "float32", torch.float32, None, torch.float32, torch.float32),
    Layout(1, "fp64", "float64", torch.float64, None, torch.float64, torch.float64),
    Layout(2, "split_bf16", "split bfloat16", torch.bfloat16, torch.int16, torch.bfloat16, torch.float32),
    Layout(3, "bf16_master", "bfloat16 with float32 master", torch.bfloat16, torch.float32, torch.bfloat16,
           torch.float32),
    Layout(4, "fp16_master", "float16 with float32 master", torch.float16, torch.float32, torch.float16,
           torch.float32),
)
BY_NAME: dict[str, Layout] = {lay.name: lay for lay in LAYOUTS}
_BY_DTYPES = {(lay.param, lay.aux): lay for lay in LAYOUTS}


def find(param: torch.dtype, aux: torch.dtype | None) -> Layout | None:
    """The layout of a parameter of dtype ``param`` with an aux of dtype ``aux`` (None: no aux), or None."""
    return _BY_DTYPES.get((param, aux))
