"""Bias + exact GELU, ``gelu(x + bias)`` on a bias-free GEMM output, for training on bf16 or fp32 activations: one
pass forward and one backward that also reduces the bias gradient, fp32 inside.

Why
---
A BERT-style intermediate block computes ``gelu(dense(x))``: torch runs addmm (the bias in the GEMM), a GELU pass
and, backward, gelu_backward and a separate sum over the [tokens, intermediate] gradient for the bias. Here the
GEMM runs without its bias and the rest is one C++ pass each way (``kernels_cpu/src/bias_gelu_rows.h``, compiled
per ISA); the op saves x and the bias, and the backward recomputes ``x + bias``.

Numerics: ``x + bias`` in fp32, rounded to x's dtype (as the GEMM with its bias would have written it; that GEMM
rounds its fp32 accumulation once, this path rounds the product and then the sum, so the pre-activations differ by
at most about one rounding), then exact (erf) GELU in fp32, rounded once. GELU's CDF is ``erfc(|x| / sqrt 2) / 2``
(or 1 minus it) from one exp shared with the backward's density, so there is no ``1 + erf`` cancellation for
negative inputs: within ~5e-7 relative of the true CDF for x > -1, growing as x^2 below (1.7e-5 at x = -12); erf
within ~4.4e-7 absolute (tests/test_bias_gelu.py; torch's own fp32 gelu: 6.2e-7, and no relative accuracy below
x = -4). The vector kernels use FMAs here, the scalar one does not: they agree within that bound, not bit for bit.
Backward: ``dx = dy * gelu'(pre)`` with torch's gelu_backward formula (``cdf + x * pdf``) in fp32, rounded once;
the bias gradient is the fp32 sum of the unrounded values over fixed 64-row blocks, the blocks added in order: the
results do not depend on the thread count.

The ``bf16`` native compute policy of ``ipex_train.optimize`` routes Hugging Face BERT-style intermediate blocks to
:func:`gelu_with_bias_grad`: the linear with its bias and torch's GELU forward (oneDNN's eltwise kernel, faster on
Intel CPUs than the one-pass forward), this package's backward with the bias gradient
(``ipex_train.compute_policy.routes_bias_gelu``; docs/compute_policy.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _op

__all__ = ["bias_gelu", "gelu_with_bias_grad", "supports"]

_DTYPES = (torch.bfloat16, torch.float32)


def supports(x: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether :func:`bias_gelu` runs the fused kernel on these tensors (else torch's ops): CPU tensors, x bf16 or
    fp32 with a non-empty last dimension, bias 1-D of that size, fp32 or x's dtype."""
    return (x.dtype in _DTYPES and bias.dtype in (torch.float32, x.dtype) and x.device.type == "cpu"
            and bias.device.type == "cpu" and x.dim() >= 1 and x.shape[-1] > 0 and bias.dim() == 1
            and bias.shape[0] == x.shape[-1])


def _check(x, bias, x_name="x") -> None:
    for name, t in ((x_name, x), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least one dimension, got a 0-d tensor")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias must be 1-D of {x_name}'s last dimension ({x.shape[-1]}), got shape "
                         f"{tuple(bias.shape)}")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.gelu((x + bias).to(x.dtype))`` (exact, erf GELU) as one autograd op.

    ``x``: a floating-point tensor ``[..., n]`` (any strides), typically a GEMM's output computed without its bias;
    ``bias``: a 1-D floating-point tensor of size n. Where :func:`supports` holds (CPU; x bf16 or fp32; bias fp32 or
    x's dtype) this runs the fused kernel and returns a contiguous tensor of x's dtype; otherwise the torch
    expression above runs. Differentiable in both.
    """
    _check(x, bias)
    if not supports(x, bias):
        return F.gelu((x + bias).to(x.dtype))
    return _op.forward(x, bias)


class _TorchGeluWithBiasGrad(torch.autograd.Function):
    """gelu_with_bias_grad's semantics in torch ops, for tensors the kernel does not take."""

    @staticmethod
    def forward(ctx, pre, bias):
        ctx.save_for_backward(pre)
        ctx.bias_dtype = bias.dtype
        return F.gelu(pre)

    @staticmethod
    def backward(ctx, grad):
        (pre,) = ctx.saved_tensors
        d_pre = torch.ops.aten.gelu_backward(grad, pre)
        d_bias = d_pre.float().sum(dim=tuple(range(d_pre.dim() - 1))).to(ctx.bias_dtype)
        return d_pre, d_bias


def gelu_with_bias_grad(pre: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.gelu(pre)`` (exact, erf GELU) where ``pre`` is a GEMM's output with ``bias`` already in it, the GEMM given
    ``bias.detach()``: ``F.gelu(F.linear(x, w, b.detach()))`` computes as torch's ``F.gelu(F.linear(x, w, b))``
    forward, bit for bit, and its backward is this package's one pass, which also returns the bias's gradient
    (``pre``'s gradient summed over all but its last dimension).

    ``pre``: a floating-point tensor ``[..., n]``; ``bias``: a 1-D floating-point tensor of size n (only its gradient
    is computed here). Where :func:`supports` holds the backward is the fused kernel's (its numerics above), otherwise
    torch's gelu_backward and a sum. Differentiable in both.
    """
    _check(pre, bias, "pre")
    if not (torch.is_grad_enabled() and (pre.requires_grad or bias.requires_grad)):
        return F.gelu(pre)  # no backward to fuse: torch's forward, which the op computes anyway (and export sees)
    if not supports(pre, bias):
        return _TorchGeluWithBiasGrad.apply(pre, bias)
    return _op.gelu_with_bias_grad(pre, bias)
