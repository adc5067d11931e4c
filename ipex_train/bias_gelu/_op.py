"""torch.library registrations of the bias + GELU ops (kernels_cpu/src/bias_gelu.cpp): fake (meta) kernels, so that
torch.compile traces them without a graph break, and the autograd formula of ``bias_gelu_forward``; and
``gelu_with_bias_grad``, torch's GELU forward with the kernel's backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.bias_gelu_*)

_FORWARD = "ipex_train::bias_gelu_forward"
_BACKWARD = "ipex_train::bias_gelu_backward"


@torch.library.register_fake(_FORWARD)
def _forward_fake(x, bias):
    return x.new_empty(x.shape)  # contiguous, x's dtype, as the kernel returns it


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad, x, bias):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _setup_context(ctx, inputs, output):
    # x and the bias, not x + bias: the backward recomputes the sum (one add per element) rather than the forward
    # writing a second activation-sized tensor; saved memory is the same, one tensor of x's size.
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad):
    if grad is None:
        return None, None
    x, bias = ctx.saved_tensors
    d_x, d_bias = torch.ops.ipex_train.bias_gelu_backward(grad, x, bias)
    need = ctx.needs_input_grad
    return (d_x if need[0] else None), (d_bias if need[1] else None)


torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)


def forward(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.ops.ipex_train.bias_gelu_forward`` (differentiable in x and bias)."""
    return torch.ops.ipex_train.bias_gelu_forward(x, bias)


# torch's own GELU forward (oneDNN's eltwise kernel on CPU) on a pre-activation that already holds the bias, and the
# kernel's backward, which also returns the bias's gradient: the bias is an input only for that gradient.
@torch.library.custom_op("ipex_train::gelu_with_bias_grad", mutates_args=())
def _gelu_with_bias_grad(pre: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(pre)


@_gelu_with_bias_grad.register_fake
def _gelu_with_bias_grad_fake(pre, bias):
    return torch.empty_like(pre)


def _after_setup_context(ctx, inputs, output):
    pre, bias = inputs
    ctx.save_for_backward(pre)
    ctx.bias_meta = (bias.shape, bias.dtype)
    ctx.set_materialize_grads(False)


def _after_backward(ctx, grad):
    if grad is None:
        return None, None
    (pre,) = ctx.saved_tensors
    shape, dtype = ctx.bias_meta
    # A zero bias: the kernel's x + bias is pre itself (x + 0 rounds to x).
    d_pre, d_bias = torch.ops.ipex_train.bias_gelu_backward(grad, pre, pre.new_zeros(shape, dtype=dtype))
    need = ctx.needs_input_grad
    return (d_pre if need[0] else None), (d_bias if need[1] else None)


_gelu_with_bias_grad.register_autograd(_after_backward, setup_context=_after_setup_context)


def gelu_with_bias_grad(pre: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.ops.ipex_train.gelu_with_bias_grad`` (differentiable in pre and bias)."""
    return torch.ops.ipex_train.gelu_with_bias_grad(pre, bias)
