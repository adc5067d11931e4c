"""SwiGLU's gating, ``silu(gate) * up``, for training on bf16 or fp32 activations: one pass forward and one backward,
fp32 inside.

Why
---
A Llama-family MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: between the projections torch runs
silu and a multiply forward, and silu's backward and two multiplies backward, each a pass over the [tokens,
intermediate] activations (about 2-3% of a bf16 training step of a small Llama here). Here each direction is one
C++ pass (``kernels_cpu/src/swiglu_rows.h``, compiled per ISA); the op saves gate and up, as torch's autograd does,
and the backward recomputes the sigmoid.

Numerics: ``silu(gate) * up`` in fp32, rounded once to the inputs' dtype (torch rounds silu's result to bf16 before
the multiply for bf16 inputs, so the two differ by about one bf16 rounding); the gradients ``d_gate = g * up *
silu'(gate)`` and ``d_up = g * silu(gate)`` in fp32, rounded once. Elementwise in fixed blocks: the results do not
depend on the thread count.

The ``bf16`` native compute policy of ``ipex_train.optimize`` routes Hugging Face Llama-family MLPs here
(``ipex_train.compute_policy.routes_swiglu``; docs/compute_policy.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _op

__all__ = ["silu_mul", "supports"]

_DTYPES = (torch.bfloat16, torch.float32)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` runs the fused kernel on these tensors (else torch's ops): CPU tensors of one shape
    and one dtype, bf16 or fp32."""
    return (gate.dtype in _DTYPES and up.dtype == gate.dtype and gate.device.type == "cpu"
            and up.device.type == "cpu" and gate.shape == up.shape)


def _check(gate, up) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if gate.shape != up.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if not (gate.is_floating_point() and up.is_floating_point()):
        raise TypeError(f"gate and up must be floating-point tensors, got {gate.dtype} and {up.dtype}")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` as one autograd op.

    ``gate`` and ``up``: floating-point tensors of one shape (any strides). Where :func:`supports` holds (CPU, one
    dtype, bf16 or fp32) this runs the fused kernel and returns a contiguous tensor of that dtype, computed in fp32
    and rounded once; otherwise the torch expression above runs (with torch's dtype promotion).
    """
    _check(gate, up)
    if not supports(gate, up):
        return F.silu(gate) * up
    return _op.forward(gate, up)
