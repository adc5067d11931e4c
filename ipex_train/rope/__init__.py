"""Rotary position embeddings (RoPE) for training: Hugging Face's ``q * cos + rotate_half(q) * sin`` on the query
and key in one C++ pass each way, fp32 inside.

Why
---
A Llama-family attention layer views its query and key projections as (batch, seq, heads, head_dim), transposes
them to (batch, heads, seq, head_dim) and rotates them with four elementwise ops and a concatenation each (and their
backwards), on strided views; the attention kernel then copies the transposed results to contiguous memory. Here
the rotation reads the projections where they are and writes the contiguous (batch, heads, seq, head_dim) tensors
the attention kernels read, and its backward writes the gradients back in the projections' layout
(``kernels_cpu/src/rope.cpp``).

Numerics: each output element is ``x1 * cos - x2 * sin`` or ``x2 * cos + x1 * sin`` in fp32, rounded once to the
input's dtype: bit for bit torch's result for fp32 inputs; for bf16 inputs torch rounds after each op, here once.

The ``bf16`` native compute policy of ``ipex_train.optimize`` routes Hugging Face Llama attention layers here
(``ipex_train.compute_policy.routes_rope``; docs/compute_policy.md).
"""
from __future__ import annotations

import torch

from . import _op

__all__ = ["apply_rotary", "supports"]

_DTYPES = (torch.bfloat16, torch.float32)


def supports(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`apply_rotary` runs the fused kernel on these tensors (else torch's ops): 4-D CPU ``query``
    (batch, seq, heads, head_dim) and ``key`` (batch, seq, kv_heads, head_dim) of one dtype, bf16 or fp32, with an
    even head_dim; ``cos`` and ``sin`` of that dtype, (1 or batch, seq, head_dim), neither requiring grad."""
    tensors = (query, key, cos, sin)
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    if query.dtype not in _DTYPES or any(t.dtype != query.dtype or t.device.type != "cpu" for t in tensors):
        return False
    if query.dim() != 4 or key.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, s, _, d = query.shape
    if key.shape[0] != b or key.shape[1] != s or key.shape[3] != d or d % 2:
        return False
    return cos.shape[0] in (1, b) and tuple(cos.shape[1:]) == (s, d) and not (cos.requires_grad or sin.requires_grad)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``query`` (batch, seq, heads, head_dim) and ``key`` (batch, seq, kv_heads, head_dim) by the rotary
    embedding ``cos``, ``sin`` (1 or batch, seq, head_dim), as Hugging Face's ``apply_rotary_pos_emb`` does on
    ``query.transpose(1, 2)`` and ``key.transpose(1, 2)``; returns the rotated query and key as (batch, heads, seq,
    head_dim), contiguous where the kernel ran (:func:`supports`), else torch's ops' result. Differentiable in query
    and key (and, on torch's path, in cos and sin)."""
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"query and key must be 4-D (batch, seq, heads, head_dim), got shapes {tuple(query.shape)} "
                         f"and {tuple(key.shape)}")
    if supports(query, key, cos, sin):
        return _op.forward(query, key, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = query.transpose(1, 2), key.transpose(1, 2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
