"""Fused RMSNorm for training on bf16 or fp32 activations: one pass per row forward and backward, fp32 inside.

Why
---
Hugging Face's ``LlamaRMSNorm`` (``h = x.float(); h = h * rsqrt(h.pow(2).mean(-1) + eps); weight * h.to(x.dtype)``)
runs about ten elementwise passes forward + backward under autograd: 2.6 ms on a (4, 256, 768) bf16 or fp32 input at
2 threads, 17 calls per step of an 8-layer decoder. torch's ``F.rms_norm`` fuses the forward only (its backward is
decomposed). Here forward and backward are one C++ pass per row each (``kernels_cpu/src/rms_norm_rows.h``, compiled
per ISA). See docs/compute_policy.md for the measurements.

:func:`rms_norm` computes exactly Llama's formula: on bf16 and fp32 input its output is bit-identical to that
module's. The
``bf16`` native compute policy of ``ipex_train.optimize`` routes Hugging Face's Llama-family RMSNorm modules here
(``ipex_train.compute_policy``).

:func:`add_rms_norm` fuses the residual add before the norm (a Llama decoder layer's ``residual + attn_out`` then
``post_attention_layernorm``) and returns the rounded sum as well (the next residual); its backward adds the sum's
own gradient to the norm's in the same pass. The policy routes Llama-family decoder layers to it
(``ipex_train.compute_policy.routes_add_rms_norm``).
"""
from __future__ import annotations

import torch

from . import _op

__all__ = ["add_rms_norm", "rms_norm", "supports", "supports_add"]


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` runs the fused kernel on these tensors (else the plain torch formula): a bf16 CPU
    ``x`` or an fp32 one, with a non-empty last dimension, and a bf16 or fp32 CPU ``weight``."""
    return (x.dtype in (torch.bfloat16, torch.float32) and weight.dtype in (torch.bfloat16, torch.float32)
            and x.device.type == "cpu" and weight.device.type == "cpu" and x.shape[-1] > 0)


def _reference(x, weight, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def supports_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` runs the fused kernel on these tensors (else torch's ops): CPU ``x`` and
    ``residual`` of one shape, both bf16, both fp32, or a bf16 ``x`` and an fp32 ``residual``, and a ``weight``
    :func:`supports` takes."""
    return (residual.dtype in (x.dtype, torch.float32) and residual.device.type == "cpu"
            and residual.shape == x.shape and supports(x, weight))


def _check(x, weight, eps) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be 1-D of size x.shape[-1]; got x of shape {tuple(x.shape)} and weight of "
                         f"shape {tuple(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` and :func:`rms_norm` of ``s``, as one autograd op: returns ``(y, s)``.

    ``x`` and ``residual``: tensors of one shape (at least 1-D); ``weight``: 1-D of their last dimension; ``eps`` >=
    0. ``s`` has torch's dtype of ``residual + x`` and its bits; ``y`` has :func:`rms_norm`'s bits on ``s``. Where
    :func:`supports_add` holds this runs the fused kernel; the backward is one pass per row (the sum's gradient is
    the norm's plus ``s``'s own, rounded once; ``x`` and ``residual`` of one dtype get that one tensor; the weight's
    gradient is summed over fixed blocks of rows, the same bits at any thread count). Otherwise the torch expression
    runs.
    """
    _check(x, weight, eps)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not supports_add(x, residual, weight):
        s = residual + x
        return rms_norm(s, weight, eps), s
    return _op.add_forward(x, residual, weight, float(eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension, as Hugging Face's ``LlamaRMSNorm``:
    ``weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)``.

    ``x``: a tensor of at least one dimension; ``weight``: 1-D, of ``x``'s last dimension; ``eps`` >= 0. The result
    has the dtype ``weight * x`` promotes to (bf16 for bf16 ``x`` and ``weight``, else fp32).
    Where :func:`supports` holds this runs the fused kernel (bit-identical forward, gradients for ``x`` and
    ``weight`` computed in fp32 and returned in their dtypes); otherwise the formula above in torch ops.
    """
    _check(x, weight, eps)
    if not supports(x, weight):
        return _reference(x, weight, eps)
    return _op.forward(x, weight, float(eps))
