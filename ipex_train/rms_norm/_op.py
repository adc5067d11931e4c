"""torch.library registrations of the RMSNorm ops (kernels_cpu/src/rms_norm.cpp): fake (meta) kernels, so that
torch.compile traces them without a graph break, and the autograd formula of ``rms_norm_forward``."""
from __future__ import annotations

import torch

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.rms_norm_*)

_FORWARD = "ipex_train::rms_norm_forward"
_BACKWARD = "ipex_train::rms_norm_backward"


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
