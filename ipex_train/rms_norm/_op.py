"""torch.library registrations of the RMSNorm and residual add + RMSNorm ops (kernels_cpu/src/rms_norm.cpp): fake
(meta) kernels, so that torch.compile traces them without a graph break, and the autograd formulas of
``rms_norm_forward`` and ``add_rms_norm_forward``."""
from __future__ import annotations

import torch

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.rms_norm_*)

_FORWARD = "ipex_train::rms_norm_forward"
_BACKWARD = "ipex_train::rms_norm_backward"
_ADD_FORWARD = "ipex_train::add_rms_norm_forward"
_ADD_BACKWARD = "ipex_train::add_rms_norm_backward"


@torch.library.register_fake(_FORWARD)
def _forward_fake(x, weight, eps):
    y_dtype = torch.promote_types(x.dtype, weight.dtype)  # as the kernel: fp32 unless both are bf16
    return x.new_empty(x.shape, dtype=y_dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad_y, x, weight, rstd):
    # Contiguous, as the kernel returns them whatever the inputs' strides.
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        return None, None, None
    grad_x, grad_weight = torch.ops.ipex_train.rms_norm_backward(grad_y, x, weight, rstd)
    return (grad_x if ctx.needs_input_grad[0] else None), (grad_weight if ctx.needs_input_grad[1] else None), None


torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)


def forward(x, weight, eps: float):
    """y of ``torch.ops.ipex_train.rms_norm_forward`` (differentiable in x and weight)."""
    return torch.ops.ipex_train.rms_norm_forward(x, weight, eps)[0]


@torch.library.register_fake(_ADD_FORWARD)
def _add_forward_fake(x, residual, weight, eps):
    # y as rms_norm's of the sum; the sum in the residual's dtype (x's, or fp32 for bf16 x); both contiguous.
    y_dtype = torch.promote_types(residual.dtype, weight.dtype)
    return (x.new_empty(x.shape, dtype=y_dtype), residual.new_empty(x.shape),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.register_fake(_ADD_BACKWARD)
def _add_backward_fake(grad_y, grad_sum, sum_, weight, rstd, x_dtype):
    # grad_x is empty when x has the sum's dtype (its gradient is then the sum's).
    grad_x = sum_.new_empty(sum_.shape if x_dtype != sum_.dtype else (0,), dtype=x_dtype)
    return sum_.new_empty(sum_.shape), grad_x, weight.new_empty(weight.shape)


def _add_setup_context(ctx, inputs, output):
    x, _, weight, _ = inputs
    _, sum_, rstd = output
    ctx.save_for_backward(sum_, weight, rstd)
    ctx.x_dtype = x.dtype
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)


def _add_backward(ctx, grad_y, grad_sum, grad_rstd):
    sum_, weight, rstd = ctx.saved_tensors
    grad_x = grad_w = None
    if grad_y is None and grad_sum is None:
        return None, None, None, None
    if grad_y is None:  # only the sum was used: its gradient passes through the add
        grad_s = grad_sum.to(sum_.dtype)
    elif grad_sum is None:  # only y: RMSNorm's backward on the sum
        grad_s, grad_w = torch.ops.ipex_train.rms_norm_backward(grad_y, sum_, weight, rstd)
    else:
        grad_s, grad_x, grad_w = torch.ops.ipex_train.add_rms_norm_backward(grad_y, grad_sum, sum_, weight, rstd,
                                                                            ctx.x_dtype)
    # One tensor for x and the residual when their dtypes agree, as autograd's add hands out.
    if ctx.x_dtype == sum_.dtype:
        grad_x = grad_s
    elif grad_x is None:
        grad_x = grad_s.to(ctx.x_dtype)
    need = ctx.needs_input_grad
    return (grad_x if need[0] else None, grad_s if need[1] else None, grad_w if need[2] else None, None)


torch.library.register_autograd(_ADD_FORWARD, _add_backward, setup_context=_add_setup_context)


def add_forward(x, residual, weight, eps: float):
    """(y, sum) of ``torch.ops.ipex_train.add_rms_norm_forward`` (both differentiable in x, residual and weight)."""
    y, sum_, _ = torch.ops.ipex_train.add_rms_norm_forward(x, residual, weight, eps)
    return y, sum_
