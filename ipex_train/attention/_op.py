"""torch.library registrations of the attention ops (kernels_cpu/src/attention.cpp): fake (meta) kernels, so that
torch.compile traces them without a graph break, and the autograd formula of ``attention_forward``."""
from __future__ import annotations

import torch

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.attention_*)

_FORWARD = "ipex_train::attention_forward"
_BACKWARD = "ipex_train::attention_backward"


@torch.library.register_fake(_FORWARD)
def _forward_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, seed):
    b, hq, s, _ = query.shape
    t, dv = value.shape[-2], value.shape[-1]
    probs = query.new_empty((b, key.shape[1], (hq // key.shape[1]) * s, t))
    dropped = query.new_empty((b, key.shape[1], (hq // key.shape[1]) * s, t) if dropout_p > 0 else (0,))
    return query.new_empty((b, hq, s, dv)), probs, dropped


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad_out, query, key, value, probs, dropped_probs, dropout_p, scale, seed):
    # Contiguous, as the kernel returns them whatever the inputs' strides (compiled graphs rely on the strides).
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale, seed = inputs
    _, probs, dropped = output
    ctx.save_for_backward(query, key, value, probs, dropped, seed)
    ctx.dropout_p = dropout_p
    ctx.scale = scale
    ctx.mark_non_differentiable(probs, dropped)
    # The backward ignores the grads of probs and dropped: autograd would otherwise fill S x T zeros for them.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_probs, grad_dropped):
    query, key, value, probs, dropped, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.ipex_train.attention_backward(grad_out, query, key, value, probs, dropped,
                                                         ctx.dropout_p, ctx.scale, seed)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)


def forward(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale: float, seed):
    """The attention output of ``torch.ops.ipex_train.attention_forward`` (differentiable in query, key, value)."""
    return torch.ops.ipex_train.attention_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, seed)[0]


# The tiled kernel (kernels_cpu/src/attention_flash.cpp): saves the output and one log-sum-exp per row, not the
# probabilities.
_FLASH_FORWARD = "ipex_train::attention_flash_forward"
_FLASH_BACKWARD = "ipex_train::attention_flash_backward"


@torch.library.register_fake(_FLASH_FORWARD)
def _flash_forward_fake(query, key, value, attn_mask, doc_start, dropout_p, is_causal, scale, seed):
    b, hq, s, _ = query.shape
    return query.new_empty((b, hq, s, value.shape[-1])), query.new_empty((b, hq, s), dtype=torch.float32)


@torch.library.register_fake(_FLASH_BACKWARD)
def _flash_backward_fake(grad_out, query, key, value, out, lse, attn_mask, doc_start, dropout_p, is_causal, scale,
                         seed):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _flash_setup_context(ctx, inputs, output):
    query, key, value, attn_mask, doc_start, dropout_p, is_causal, scale, seed = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, doc_start, seed)
    ctx.dropout_p = dropout_p
    ctx.is_causal = is_causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _flash_backward(ctx, grad_out, grad_lse):
    if grad_out is None:
        return (None,) * 9
    query, key, value, out, lse, attn_mask, doc_start, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.ipex_train.attention_flash_backward(grad_out, query, key, value, out, lse, attn_mask,
                                                               doc_start, ctx.dropout_p, ctx.is_causal, ctx.scale,
                                                               seed)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd(_FLASH_FORWARD, _flash_backward, setup_context=_flash_setup_context)


def flash_forward(query, key, value, attn_mask, doc_start, dropout_p: float, is_causal: bool, scale: float, seed):
    """The attention output of ``torch.ops.ipex_train.attention_flash_forward`` (differentiable in query, key,
    value): additive fp32 mask or None, document starts (int32 (batch, seq)) or None."""
    return torch.ops.ipex_train.attention_flash_forward(query, key, value, attn_mask, doc_start, dropout_p, is_causal,
                                                        scale, seed)[0]


def tile_products(choice: str | None = None) -> str:
    """The products the tiled kernel's AVX-512 BF16 tiles run: ``"onednn"`` (oneDNN's batch-reduce GEMM micro-kernel
    through torch's cpublas, the default wherever a one-time exactness check passes; AMX on CPUs that have it) or
    ``"own"`` (the tiles' AVX-512 BF16 dot-product loops). ``choice`` sets it for the process (ValueError for another
    string, or for ``"onednn"`` where it does not run); returns the one in effect. The portable tiles (no AVX-512 BF16,
    or ``IPEX_TRAIN_KERNEL=avx2``) always run their own."""
    return torch.ops.ipex_train.attention_products(choice)
