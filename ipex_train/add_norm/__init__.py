"""Dropout + residual add + LayerNorm for training on bf16 or fp32 activations: one pass per row forward and
backward, fp32 inside.

Why
---
A post-norm transformer block (Hugging Face's ``BertSelfOutput`` / ``BertOutput``) computes
``LayerNorm(dropout(dense(h)) + input_tensor)``: torch runs dropout (a Bernoulli draw, a mask and a multiply), the
add and LayerNorm as separate passes over the activations forward, and their backwards as more. Here forward and
backward are one C++ pass per row each (``kernels_cpu/src/add_norm_rows.h``, compiled per ISA). The dropout mask
is a hash of a seed drawn from torch's default generator, the row and the column (as ``ipex_train.attention``'s),
so the backward regenerates it instead of saving it: the op saves only the sum (in x's dtype) and two fp32 values
per row, as torch's LayerNorm saves its input. The masks differ from the ones torch's dropout would draw.

Numerics: ``dropout(x) + residual`` is computed in fp32 and rounded to the residual's dtype (as the module's ``h +
input_tensor`` is: bf16 for a bf16 residual, fp32 for an fp32 one, which models with fp32 embeddings feed a bf16
dense output), LayerNorm's mean, variance and normalization in fp32 on that sum, y rounded to the sum's dtype once.
Gradients are computed in fp32 and rounded once to each input's dtype; the weight and bias gradients are summed
over fixed blocks of rows in a fixed order, so they do not depend on the thread count.

Pre-norm blocks (ViT's layers: ``s = dropout(attention) + residual``, then ``LayerNorm(s)`` feeds the MLP and ``s``
the next residual add) use :func:`add_layer_norm_with_sum`: the same forward, the sum a differentiable output, its
gradient added to the LayerNorm's in the backward's one pass per row.

The ``bf16`` native compute policy of ``ipex_train.optimize`` routes Hugging Face's post-norm output blocks here
(``ipex_train.compute_policy.routes_add_norm``) and ViT-family pre-norm layers
(``ipex_train.compute_policy.routes_prenorm_add_norm``; docs/compute_policy.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import ops as _ops
from . import _op

__all__ = ["add_layer_norm", "add_layer_norm_with_sum", "supports"]

_DTYPES = (torch.bfloat16, torch.float32)


def supports(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`add_layer_norm` runs the fused kernel on these tensors (else torch's ops): CPU ``x`` and
    ``residual`` with a non-empty last dimension, both bf16, both fp32, or a bf16 ``x`` and an fp32 ``residual``; CPU
    ``weight`` / ``bias`` (each may be None) of one dtype, fp32 or the residual's."""
    if x.dtype not in _DTYPES or residual.dtype not in (x.dtype, torch.float32):
        return False
    if x.device.type != "cpu" or residual.device.type != "cpu":
        return False
    if x.dim() < 1 or x.shape[-1] == 0:
        return False
    params = [t for t in (weight, bias) if t is not None]
    if any(t.device.type != "cpu" for t in params) or len({t.dtype for t in params}) > 1:
        return False
    return all(t.dtype in (torch.float32, residual.dtype) for t in params)


def _check(x, residual, weight, bias, eps, p, training) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(residual, torch.Tensor):
        raise TypeError(f"x and residual must be tensors, got {type(x).__name__} and {type(residual).__name__}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
        if t is not None and (t.dim() != 1 or x.dim() < 1 or t.shape[0] != x.shape[-1]):
            raise ValueError(f"{name} must be 1-D of size x.shape[-1]; got x of shape {tuple(x.shape)} and {name} of "
                             f"shape {tuple(t.shape)}")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    for name, v in (("eps", eps), ("p", p)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    if not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if not 0 <= p < 1:
        raise ValueError(f"p must be in [0, 1), got {p}")
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")



def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, p: float = 0.0, training: bool = False) -> torch.Tensor:
    """``F.layer_norm(F.dropout(x, p, training) + residual, (x.shape[-1],), weight, bias, eps)`` as one autograd op.

    ``x`` and ``residual``: tensors of one shape (at least 1-D); ``weight`` and ``bias``: 1-D of ``x``'s last
    dimension, or None (no scale / no shift); ``eps`` >= 0; ``p`` in [0, 1), the probability of zeroing an element of
    ``x`` (only while ``training``; kept elements are scaled by 1 / (1 - p)). Where :func:`supports` holds this runs
    the fused kernel: the result has the residual's dtype (torch's promotion of ``x + residual``); dropout masks
    come from a seed drawn from torch's default CPU generator (``torch.manual_seed`` makes them reproducible; they
    are not the masks torch's dropout draws). Otherwise the torch expression above runs.
    """
    _check(x, residual, weight, bias, eps, p, training)
    p = float(p) if training else 0.0
    if not supports(x, residual, weight, bias):
        return F.layer_norm(F.dropout(x, p, True) + residual, (x.shape[-1],), weight, bias, float(eps))
    return _op.forward(*_kernel_args(x, residual, weight, bias, eps, p))


def add_layer_norm_with_sum(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                            bias: torch.Tensor | None, eps: float, p: float = 0.0,
                            training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.layer_norm(s, (x.shape[-1],), weight, bias, eps), s)`` with ``s = F.dropout(x, p, training) + residual``,
    as one autograd op: a pre-norm block's residual add and the LayerNorm that follows it (the sum goes on as the
    residual stream, so both outputs are differentiable).

    Arguments, dtypes and dropout as :func:`add_layer_norm`; both outputs have the residual's dtype where
    :func:`supports` holds (the sum rounded once to it, y computed from the rounded sum). The backward adds the sum's
    own gradient to the LayerNorm's in the same pass per row. Otherwise the torch expression above runs.
    """
    _check(x, residual, weight, bias, eps, p, training)
    p = float(p) if training else 0.0
    if not supports(x, residual, weight, bias):
        s = F.dropout(x, p, True) + residual
        return F.layer_norm(s, (x.shape[-1],), weight, bias, float(eps)), s
    return _op.forward_with_sum(*_kernel_args(x, residual, weight, bias, eps, p))


def _kernel_args(x, residual, weight, bias, eps, p):
    """The op's arguments: None weight / bias as ones / zeros of the other's dtype (fp32 if both are None), a seed."""
    param_dtype = (weight if weight is not None else bias).dtype if (weight is not None or bias is not None) \
        else torch.float32
    n = x.shape[-1]
    if weight is None:
        weight = torch.ones(n, dtype=param_dtype)
    if bias is None:
        bias = torch.zeros(n, dtype=param_dtype)
    return x, residual, weight, bias, float(eps), p, _ops.dropout_seed(p)
