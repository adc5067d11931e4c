"""torch.library registrations of the dropout + residual add + LayerNorm ops (kernels_cpu/src/add_norm.cpp): fake
(meta) kernels, so that torch.compile traces them without a graph break, and the autograd formula of
``add_layer_norm_forward`` (y and the sum differentiable; the backward adds the sum's gradient, when there is one,
in its one pass per row)."""
from __future__ import annotations

import torch

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.add_layer_norm_*)

_FORWARD = "ipex_train::add_layer_norm_forward"
_BACKWARD = "ipex_train::add_layer_norm_backward"


@torch.library.register_fake(_FORWARD)
def _forward_fake(x, residual, weight, bias, eps, p, seed):
    # y and the sum in the residual's dtype (x's, or fp32 for bf16 x), contiguous; mean and rstd fp32 per row.
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return (residual.new_empty(x.shape), residual.new_empty(x.shape), stats,
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad_y, sum_, weight, mean, rstd, p, seed, x_dtype, grad_sum=None):
    # Contiguous, as the kernel returns them; grad_x is empty when it equals grad_residual (no dropout, same dtype).
    own = p > 0.0 or x_dtype != sum_.dtype
    grad_x = sum_.new_empty(sum_.shape if own else (0,), dtype=x_dtype)
    return sum_.new_empty(sum_.shape), grad_x, weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, _, weight, _, _, p, seed = inputs
    _, sum_, mean, rstd = output
    ctx.save_for_backward(sum_, weight, mean, rstd, seed)
    ctx.p = p
    ctx.x_dtype = x.dtype
    # The sum is differentiable: a pre-norm block passes it on as the residual stream. Where it is not used (the
    # post-norm blocks), its gradient is None and the backward runs as without it.
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_sum, grad_mean, grad_rstd):
    if grad_y is None and grad_sum is None:
        return None, None, None, None, None, None, None
    sum_, weight, mean, rstd, seed = ctx.saved_tensors
    y_unused = grad_y is None
    if y_unused:  # only the sum was used: LayerNorm contributes nothing (the kernel adds grad_sum to zeros)
        grad_y = torch.zeros_like(sum_)
    grad_res, grad_x, grad_w, grad_b = torch.ops.ipex_train.add_layer_norm_backward(
        grad_y, sum_, weight, mean, rstd, ctx.p, seed, ctx.x_dtype, grad_sum)
    if not (ctx.p > 0.0 or ctx.x_dtype != sum_.dtype):
        grad_x = grad_res  # dropout(x) == x, one dtype: one gradient for both, as autograd's add hands out
    need = ctx.needs_input_grad
    if y_unused:  # as torch, whose LayerNorm node would not run: no gradient for its weight and bias
        grad_w = grad_b = None
    return (grad_x if need[0] else None, grad_res if need[1] else None, grad_w if need[2] else None,
            grad_b if need[3] else None, None, None, None)


torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)


def forward(x, residual, weight, bias, eps: float, p: float, seed: torch.Tensor):
    """y of ``torch.ops.ipex_train.add_layer_norm_forward`` (differentiable in x, residual, weight and bias)."""
    return torch.ops.ipex_train.add_layer_norm_forward(x, residual, weight, bias, eps, p, seed)[0]


def forward_with_sum(x, residual, weight, bias, eps: float, p: float, seed: torch.Tensor):
    """y and the rounded sum of ``torch.ops.ipex_train.add_layer_norm_forward``, both differentiable."""
    y, sum_, _, _ = torch.ops.ipex_train.add_layer_norm_forward(x, residual, weight, bias, eps, p, seed)
    return y, sum_


def forward_with_stats(x, residual, weight, bias, eps: float, p: float, seed: torch.Tensor):
    """All four outputs (y, the rounded sum, mean, rstd): the tests recover the dropout mask from them."""
    return torch.ops.ipex_train.add_layer_norm_forward(x, residual, weight, bias, eps, p, seed)
