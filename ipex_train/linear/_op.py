"""torch.library registration of ``ipex_train::linear_bias``: oneDNN's matmul with the bias in its epilogue
(``torch.ops.mkldnn._linear_pointwise``, torch's own op, which Inductor uses for CPU inference), its fake kernel,
and the autograd formula torch's ``addmm`` backward computes, product for product."""
from __future__ import annotations

import torch


@torch.library.custom_op("ipex_train::linear_bias", mutates_args=())
def _linear_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_linear_bias.register_fake
def _linear_bias_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)  # what addmm saves: its two matrices, not the bias
    ctx.set_materialize_grads(False)


def _backward(ctx, grad):
    if grad is None:
        return None, None, None
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    g = grad.reshape(-1, grad.shape[-1])
    # The products and the sum addmm's backward runs for F.linear (mm_mat1_backward, mm_mat2_backward on the
    # transposed weight, then the bias's sum_to), so the gradients are torch's bit for bit.
    d_x = g.mm(weight).view(x.shape) if need[0] else None
    d_weight = g.t().mm(x.reshape(-1, x.shape[-1])) if need[1] else None
    d_bias = g.sum(0) if need[2] else None
    return d_x, d_weight, d_bias


_linear_bias.register_autograd(_backward, setup_context=_setup_context)


def linear_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``torch.ops.ipex_train.linear_bias`` (differentiable in x, weight and bias)."""
    return torch.ops.ipex_train.linear_bias(x, weight, bias)
