"""The native policy's route for ``nn.MultiheadAttention`` self-attention (torchvision's ViT, ``nn.Transformer*``
layers): the packed input projection viewed straight into the attention's (batch, heads, seq, dim) layout and
``ipex_train.attention`` called on it, with the output projection after.

torch's ``F.multi_head_attention_forward`` works sequence-first: a batch-first input is transposed and copied before
the input projection, the projection's output is unflattened, transposed and copied again, then split with three
selects whose backward fills and adds a zero tensor of the projection's size each; the output goes through two more
transposes. In a ViT-B/16 training step those copies, fills and adds were ~6% of the step (docs/compute_policy.md).
The routed forward computes the same products in the same order on the batch-first layout: its output equals the
class's bit for bit, and the gradients differ only by the order their parts are summed in.

Only self-attention calls the route computes as the class does take it (query, key and value one tensor, batched,
``need_weights=False``, no autocast, no attention mask but the causal one, at most a key padding mask, one floating
dtype on the CPU) and only with grad enabled; every other call (inference included, where the class may take
torch's fused fast path) runs the class's forward.
"""
from __future__ import annotations

import torch

from .. import attention
from .. import linear as _linear
from ._swap import Swap


def _packed(module: torch.nn.Module) -> bool:
    """The configuration the route computes: one packed input projection, no extra key/value biases, no zero
    attention, an ``nn.Linear`` output projection."""
    return (bool(getattr(module, "_qkv_same_embed_dim", False)) and module.bias_k is None and module.bias_v is None
            and not module.add_zero_attn and isinstance(module.out_proj, torch.nn.Linear)
            and isinstance(module.in_proj_weight, torch.Tensor))


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.MultiheadAttention`` with its class's forward (not already swapped) whose
    configuration the route computes: packed input projection, no ``bias_k``/``bias_v``, no ``add_zero_attn``."""
    return (isinstance(module, torch.nn.MultiheadAttention)
            and type(module).forward is torch.nn.MultiheadAttention.forward
            and "forward" not in vars(module) and _packed(module))


def _same(x: torch.Tensor, *tensors) -> bool:
    return all(t is None or (t.dtype == x.dtype and t.device.type == "cpu") for t in tensors)


def _masks_ok(batch_seq, key_padding_mask, attn_mask, is_causal) -> bool:
    """Masks the route computes as the class: a (batch, seq) key padding mask, boolean (True: ignore the key) or
    additive (as ``nn.TransformerEncoder`` passes it), without a causal hint; or the causal hint (whose mask torch then
    ignores) without a padding mask; or neither mask."""
    if key_padding_mask is not None:
        return (not is_causal and attn_mask is None and isinstance(key_padding_mask, torch.Tensor)
                and (key_padding_mask.dtype == torch.bool or key_padding_mask.is_floating_point())
                and key_padding_mask.device.type == "cpu" and tuple(key_padding_mask.shape) == batch_seq)
    return (attn_mask is not None) if is_causal else attn_mask is None


def _fusable(module, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal) -> bool:
    if not (isinstance(query, torch.Tensor) and query is key and key is value and not need_weights
            and query.dim() == 3 and query.is_floating_point() and query.device.type == "cpu"
            and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu") and _packed(module)):
        return False
    out = module.out_proj
    if not _same(query, module.in_proj_weight, module.in_proj_bias, out.weight, out.bias):
        return False
    batch_seq = (query.shape[0], query.shape[1]) if module.batch_first else (query.shape[1], query.shape[0])
    return query.shape[-1] == module.embed_dim and _masks_ok(batch_seq, key_padding_mask, attn_mask, is_causal)


def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
            average_attn_weights=True, is_causal=False):
    """The routed forward: self-attention on the batch-first layout through ``ipex_train.attention`` (returns
    ``(output, None)`` as the class does without weights); every other call as the class computes it."""
    if not _fusable(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        return type(self).forward(self, query, key, value, key_padding_mask=key_padding_mask,
                                  need_weights=need_weights, attn_mask=attn_mask,
                                  average_attn_weights=average_attn_weights, is_causal=is_causal)
    x = query if self.batch_first else query.transpose(0, 1)
    b, s, e = x.shape
    heads = self.num_heads
    proj = _linear.linear(x, self.in_proj_weight, self.in_proj_bias)
    q, k, v = proj.view(b, s, 3, heads, e // heads).permute(2, 0, 3, 1, 4).unbind(0)
    mask = key_padding_mask
    if mask is not None:  # torch's SDPA masks keep True and add floats: a padding mask ignores True
        mask = (mask.logical_not() if mask.dtype == torch.bool else mask).view(b, 1, 1, s)
    o = attention.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=bool(is_causal))
    o = _linear.linear(o.transpose(1, 2).reshape(b, s, e), self.out_proj.weight, self.out_proj.bias)
    return (o if self.batch_first else o.transpose(0, 1)), None


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
