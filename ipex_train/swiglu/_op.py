"""torch.library registrations of the SwiGLU ops (kernels_cpu/src/swiglu.cpp): fake (meta) kernels, so that
torch.compile traces them without a graph break, and the autograd formula of ``silu_mul_forward``."""
from __future__ import annotations

import torch

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.silu_mul_*)

_FORWARD = "ipex_train::silu_mul_forward"
_BACKWARD = "ipex_train::silu_mul_backward"


@torch.library.register_fake(_FORWARD)
def _forward_fake(gate, up):
    return gate.new_empty(gate.shape)  # contiguous, gate's dtype, as the kernel returns it


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # gate and up: the backward recomputes the sigmoid rather than saving it
    ctx.set_materialize_grads(False)


def _backward(ctx, grad):
    if grad is None:
        return None, None
    gate, up = ctx.saved_tensors
    d_gate, d_up = torch.ops.ipex_train.silu_mul_backward(grad, gate, up)
    need = ctx.needs_input_grad
    return (d_gate if need[0] else None), (d_up if need[1] else None)


torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``torch.ops.ipex_train.silu_mul_forward`` (differentiable in gate and up)."""
    return torch.ops.ipex_train.silu_mul_forward(gate, up)
