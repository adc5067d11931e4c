"""bf16 attention for training on CPUs with bf16 units, at any sequence length.

Two kernels, picked per call by :func:`scaled_dot_product_attention`:

- the *tiled* kernel (``kernels_cpu/src/attention_flash*.cpp``): tiles of 64 queries against tiles of 64 keys with
  an online softmax (running max and sum in fp32, the log-sum-exp saved for backward); the products are bf16 dot
  products with fp32 accumulation (AVX-512 BF16), tiles above a causal diagonal are skipped, and backward recomputes
  the probabilities tile by tile, in parallel over (batch, key/value head, key tile) for dK/dV and (batch, head,
  query tile) for dQ, with the same bits at any thread count. Memory per call grows with the sequence length; the
  backward's scratch memory stays allocated between calls (:func:`workspace_bytes`).
- the *row* kernel (``kernels_cpu/src/attention.cpp``): bf16 matmuls (oneDNN) around one fused pass per score row;
  it keeps the S x T probabilities, so it only takes short key sequences (:data:`ROWS_MAX_KEYS`), and it is used
  below :data:`TILES_FROM_KEYS` keys (causal: :data:`CAUSAL_TILES_FROM_KEYS`), where it measured faster.

:func:`scaled_dot_product_attention` has the signature of ``torch.nn.functional.scaled_dot_product_attention`` and
falls back to it for what it does not cover (:func:`supports`). :func:`packed_attention` computes causal attention
within each of several documents packed into one row (cumulative lengths or position ids restarting at 0, as
transformers' ``DataCollatorWithFlattening`` makes them). The ``bf16`` native compute policy of
``ipex_train.optimize`` routes the model's attention calls here (``ipex_train.compute_policy``);
``ipex_train.integrations.hf_attention`` registers it with transformers as ``attn_implementation="ipex_train"``.

Dropout masks are drawn from a seed taken from torch's default CPU generator, so ``torch.manual_seed`` makes them
reproducible (and activation checkpointing, which restores the generator, recomputes the same ones); both kernels
draw the same mask for the same seed; it differs from the masks torch's own attention would draw.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..base import ops as _ops
from . import _op
from ._packed import attend_causal, document_starts, packed_attention

__all__ = ["scaled_dot_product_attention", "packed_attention", "attend_causal", "document_starts", "supports",
           "workspace_bytes", "ROWS_MAX_KEYS", "TILES_FROM_KEYS", "CAUSAL_TILES_FROM_KEYS"]

# Longest key sequence the row kernel takes: it keeps the S x T probabilities (bf16, twice with dropout).
ROWS_MAX_KEYS = 1024
# Calls with fewer keys than this (causal: CAUSAL_TILES_FROM_KEYS) go to the row kernel, which measured faster there
# (docs/attention.md); longer ones go to the tiled kernel.
TILES_FROM_KEYS = 1024
CAUSAL_TILES_FROM_KEYS = 512


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

    Covered: 4-D bf16 CPU query/key/value, boolean or additive (fp32/bf16) masks broadcastable to (batch, heads,
    query, key) that do not require grad, ``is_causal`` (without a mask, as torch), dropout, and grouped-query
    attention (``enable_gqa=True``, query heads a multiple of key/value heads). Key sequences of any length where the
    tiled kernel runs (head dims multiples of 16 up to 256, a CPU with AVX-512 BF16), else up to
    :data:`ROWS_MAX_KEYS`.
    """
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.dim() == 4
               and t.device.type == "cpu" for t in tensors):
        return False
    b, hq, s, d = query.shape
    if (key.shape[0] != b or value.shape[0] != b or key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]
            or key.shape[3] != d or min(s, key.shape[2], d, value.shape[3]) == 0):
        return False
    if key.shape[2] > ROWS_MAX_KEYS and not _tiles_run(query, value):
        return False
    if key.shape[1] != hq and not (enable_gqa and key.shape[1] > 0 and hq % key.shape[1] == 0):
        return False
    if is_causal and attn_mask is not None:
        return False  # torch raises for this; let it
    return 0.0 <= dropout_p < 1.0 and _mask_ok(attn_mask, query, key)


def workspace_bytes(release: bool = False) -> int:
    """Bytes the tiled kernel's backward keeps allocated between calls: its scratch memory (fp32 shares of dQ, up to
    four times dQ's size, and packed copies of Q, K and the output gradient), kept up to 256 MiB (a call needing more
    allocates its own). Allocating it per call cost ~12% of a 2048-token backward in page faults. ``release=True``
    frees it first (the next backward allocates again)."""
    if not isinstance(release, bool):
        raise TypeError(f"release must be a bool, got {type(release).__name__}")
    return int(torch.ops.ipex_train.attention_workspace(release))


def _tiles_fit(query, value) -> bool:
    d, dv = query.shape[-1], value.shape[-1]
    return d % 16 == 0 and dv % 16 == 0 and 0 < d <= 256 and 0 < dv <= 256


@functools.cache
def _has_bf16_dot() -> bool:
    return _ops.cpu_features().get("avx512_bf16", False)


@torch.compiler.assume_constant_result
def _bf16_dot_in_use() -> bool:
    # A constant to torch.compile (the kernel variant is a process-wide setting, read outside the graph).
    return _has_bf16_dot() and _ops.kernel_variant() == "avx512"


def _tiles_run(query, value) -> bool:
    """Whether the tiled kernel runs this call at speed (its portable build is for tests and CPUs without bf16)."""
    return _tiles_fit(query, value) and _bf16_dot_in_use()


def _use_tiles(query, key, value, is_causal: bool) -> bool:
    return key.shape[2] >= (CAUSAL_TILES_FROM_KEYS if is_causal else TILES_FROM_KEYS) and _tiles_run(query, value)



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
    seed = _ops.dropout_seed(dropout_p)
    mask = None if attn_mask is None else _additive(attn_mask)
    # Contiguous before the op, not inside it: the op saves its inputs, and the kernel copied Hugging Face's
    # transposed (batch, seq, heads, dim) views once in forward and again in backward. The copies replace the
    # views' base (the projections' output) in what autograd keeps, so memory stays the same.
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    if _use_tiles(query, key, value, is_causal):
        return _op.flash_forward(q, k, v, mask, None, float(dropout_p), bool(is_causal), float(scale), seed)
    return _op.forward(q, k, v, mask, float(dropout_p), bool(is_causal), float(scale), seed)
