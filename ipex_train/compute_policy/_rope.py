"""The native policy's routing of Hugging Face Llama-family attention layers' rotary embedding to
``ipex_train.rope``.

The swapped forward (:mod:`._swap`, on the instance; the class is untouched) computes what the class's forward
computes, in the same order and through the same submodules and attention function (``self.q_proj`` ...,
``ALL_ATTENTION_FUNCTIONS`` of the class's own module), except that the query and key are rotated by the fused
kernel, which reads the projections' (batch, seq, heads, head_dim) rows and writes the contiguous (batch, heads,
seq, head_dim) tensors the attention kernels read. Calls with extra positional arguments, the cache under its
former name (``past_key_values``), under autocast, or on tensors the kernel does not take run the class's own
forward.

Which classes: those of :data:`LLAMA_ATTENTION` whose forward, and whose module's ``apply_rotary_pos_emb`` and
``rotate_half``, are at run time the very code checked here (their syntax trees, docstrings dropped, hashed in
:data:`_CHECKED`: transformers 5.24's LlamaAttention). Another transformers release with other code there leaves the
layers unrouted (the class's forward runs), never computed by a formula the kernel does not match.
"""
from __future__ import annotations

import functools
import sys

import torch

from .. import rope as _fused
from ._source import digest
from ._swap import Swap, shared_input_cast

# Classes whose forward was LlamaAttention's, token for token, in transformers 5.24 (and whose modules define the
# same apply_rotary_pos_emb and rotate_half); the run-time check below still compares each against _CHECKED.
LLAMA_ATTENTION = frozenset({
    "LlamaAttention", "GemmaAttention", "GraniteAttention", "GraniteMoeAttention", "Qwen2MoeAttention",
    "PhimoeAttention", "ArceeAttention",
})

# The digests (_source.digest) of the forward, apply_rotary_pos_emb and rotate_half this route reproduces.
_CHECKED = ("146717e3c3cba137", "f0e978aab1df6bb0", "7b6c9b425ca04287")


@functools.cache
def _checked(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    if module is None:
        return False
    functions = (cls.forward, getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None))
    return all(f is not None for f in functions) and tuple(digest(f) for f in functions) == _CHECKED


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face attention layer of :data:`LLAMA_ATTENTION` with its class's own forward,
    that forward and its rotary helpers being the code this route reproduces."""
    cls = type(module)
    return (cls.__name__ in LLAMA_ATTENTION and cls.__module__.startswith("transformers.models.")
            and "forward" not in vars(module) and isinstance(getattr(module, "head_dim", None), int)
            and _checked(cls))


def _fusable(hidden_states, args, kwargs) -> bool:
    """What can be checked before the projections run: the call form the decoder layers use (the cache by its
    current name), no autocast (under which the projections' and the rotary tables' dtypes differ)."""
    if args or "past_key_values" in kwargs:
        return False
    pe = kwargs.get("position_embeddings")
    return (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3 and isinstance(pe, (tuple, list))
            and len(pe) == 2 and not torch.is_autocast_enabled("cpu"))


def forward(self, hidden_states, *args, **kwargs):
    """The routed forward: the class's computation with the query and key rotated by ``ipex_train.rope`` where it
    takes them; every other call as the class computes it."""
    if not _fusable(hidden_states, args, kwargs):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    module = sys.modules[type(self).__module__]
    kwargs = dict(kwargs)
    cos, sin = kwargs.pop("position_embeddings")
    attention_mask = kwargs.pop("attention_mask", None)
    cache = kwargs.pop("cache", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # An fp32 input (the output of an RMSNorm whose weight optimize() keeps fp32) cast once, not once per projection.
    hidden_states = shared_input_cast((self.q_proj, self.k_proj, self.v_proj), hidden_states)
    query = self.q_proj(hidden_states).view(hidden_shape)
    key = self.k_proj(hidden_states).view(hidden_shape)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if _fused.supports(query, key, cos, sin):
        query, key = _fused.apply_rotary(query, key, cos, sin)
    else:
        query, key = module.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    if cache is not None:  # as the class: the cache takes the rotated keys (here contiguous, the same values)
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention_interface = module.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                       module.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query, key, value, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
