"""torch.library registrations of the rotary-embedding ops (kernels_cpu/src/rope.cpp): fake (meta) kernels, so that
torch.compile traces them without a graph break, and the autograd formula of ``rope_forward``."""
from __future__ import annotations

import torch

from ..base import ops as _ops  # noqa: F401  (loads the extension that defines torch.ops.ipex_train.rope_*)

_FORWARD = "ipex_train::rope_forward"
_BACKWARD = "ipex_train::rope_backward"


@torch.library.register_fake(_FORWARD)
def _forward_fake(query, key, cos, sin):
    # [B, S, H, D] in, contiguous [B, H, S, D] out.
    return (query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3]),
            key.new_empty(key.shape[0], key.shape[2], key.shape[1], key.shape[3]))


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad_query, grad_key, cos, sin):
    # [B, H, S, D] in, contiguous [B, S, H, D] out.
    return (grad_query.new_empty(grad_query.shape[0], grad_query.shape[2], grad_query.shape[1], grad_query.shape[3]),
            grad_key.new_empty(grad_key.shape[0], grad_key.shape[2], grad_key.shape[1], grad_key.shape[3]))


def _setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.set_materialize_grads(True)


def _backward(ctx, grad_query, grad_key):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.ipex_train.rope_backward(grad_query, grad_key, cos, sin)
    need = ctx.needs_input_grad
    return grad_q if need[0] else None, grad_k if need[1] else None, None, None


torch.library.register_autograd(_FORWARD, _backward, setup_context=_setup_context)


def forward(query, key, cos, sin):
    """The rotated query and key of ``torch.ops.ipex_train.rope_forward`` (differentiable in query and key)."""
    return torch.ops.ipex_train.rope_forward(query, key, cos, sin)
