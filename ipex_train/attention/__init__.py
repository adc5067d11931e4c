"""bf16 attention for training on CPUs with bf16 units: bf16 matmuls (oneDNN) around one fused pass per score row.

Why
---
At training shapes (sequence 128-512, head dim 64) torch's CPU attention in bf16 runs far below the bf16 matmul
roof: at batch 8, 12 heads, sequence 128, forward + backward of torch's flash kernel took 17-20 ms while its six
matmuls need ~2 ms at the speed oneDNN's bf16 batched matmul reaches on them; torch's math backend spends its time
in the pointwise ops on the S x T tiles. Here the four backward and two forward products are bf16 ``matmul`` calls,
and scale + mask + softmax (+ dropout) and the softmax (+ dropout) backward each run as one pass per row in C++
(``kernels_cpu/src/attention_rows.h``), fp32 inside, bf16 in and out. See docs/attention.md for the measurements.

:func:`scaled_dot_product_attention` has the signature of ``torch.nn.functional.scaled_dot_product_attention`` and
falls back to it for what it does not cover (:func:`supports`). The ``bf16`` native compute policy of
``ipex_train.optimize`` routes the model's attention calls here (``ipex_train.compute_policy``).

Dropout masks are drawn from a seed taken from torch's default CPU generator, so ``torch.manual_seed`` makes them
reproducible (and activation checkpointing, which restores the generator, recomputes the same ones); they differ
from the masks torch's own attention would draw.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _op

__all__ = ["scaled_dot_product_attention", "supports", "MAX_KEYS"]

# Longest key sequence routed here: the op keeps the S x T probabilities (bf16, twice with dropout) for backward,
# where torch's flash kernel keeps O(S) per row; at 512 it was still 1.7x faster than torch's bf16 flash attention.
MAX_KEYS = 1024


def _mask_ok(mask, query, key) -> bool:
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.requires_grad or mask.device.type != "cpu":
        return False
    if mask.dtype not in (torch.bool, torch.float32, torch.bfloat16) or mask.dim() > 4:
        return False
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    padded = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return all(m in (1, n) for m, n in zip(padded, shape))


def supports(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False) -> bool:
    """Whether :func:`scaled_dot_product_attention` computes this call itself (else it calls torch's).

    Covered: 4-D bf16 CPU query/key/value, key sequences up to :data:`MAX_KEYS`, boolean or additive (fp32/bf16)
    masks broadcastable to (batch, heads, query, key) that do not require grad, ``is_causal`` (without a mask, as
    torch), dropout, and grouped-query attention (``enable_gqa=True``, query heads a multiple of key/value heads).
    """
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.dim() == 4
               and t.device.type == "cpu" for t in tensors):
        return False
    b, hq, s, d = query.shape
    if (key.shape[0] != b or value.shape[0] != b or key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]
            or key.shape[3] != d or key.shape[2] > MAX_KEYS or min(s, key.shape[2], d) == 0):
        return False
    if key.shape[1] != hq and not (enable_gqa and key.shape[1] > 0 and hq % key.shape[1] == 0):
        return False
    if is_causal and attn_mask is not None:
        return False  # torch raises for this; let it
    return 0.0 <= dropout_p < 1.0 and _mask_ok(attn_mask, query, key)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """The mask as the fp32 additive form the op reads, on the mask's own (broadcast) shape."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(mask.logical_not(), -math.inf)
    return mask.float()


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by ipex_train's bf16 attention where
    :func:`supports` says so (bf16 result; gradients for query, key and value), else by torch.

    Rows whose every key is masked give zeros (torch's math backend gives zeros too since torch 2.5).
    """
    if not supports(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    else:
        seed = torch.zeros(1, dtype=torch.int64)
    mask = None if attn_mask is None else _additive(attn_mask)
    # Contiguous before the op, not inside it: the op saves its inputs, and the kernel copied Hugging Face's
    # transposed (batch, seq, heads, dim) views once in forward and again in backward. The copies replace the
    # views' base (the projections' output) in what autograd keeps, so memory stays the same.
    return _op.forward(query.contiguous(), key.contiguous(), value.contiguous(), mask, float(dropout_p),
                       bool(is_causal), float(scale), seed)
