"""The native policy's routing of Hugging Face Llama-family decoder layers' residual add + post-attention RMSNorm to
``ipex_train.rms_norm.add_rms_norm``.

The swapped forward (:mod:`._swap`, on the instance; the class is untouched) computes what the class's forward
computes, in the same order and calling ``input_layernorm``, ``self_attn`` and ``mlp`` as modules with the class's
arguments, except that ``residual + attn_out`` and ``post_attention_layernorm`` of that sum are one fused op (which
returns the sum too, the next residual). Its bits are the class's: the sum rounds as torch's add, the norm is
``ipex_train.rms_norm``'s (LlamaRMSNorm's bits); only the backward differs (the sum's two gradients are added in
fp32 and rounded once, where autograd rounds each and then their sum).

Which classes: those of :data:`LLAMA_DECODER` whose forward is at run time the very code checked here (its syntax
tree, docstrings dropped, hashed in :data:`_CHECKED`: transformers 5.24's LlamaDecoderLayer). Calls with extra
positional arguments, the cache under its former name (``past_key_values``), under autocast, with hooks on the
post-attention norm or global module hooks, with a post-attention norm that is not a LlamaRMSNorm-formula module
(``_rms_norm.LLAMA_FORMULA``, its class's forward or the RMSNorm route's), or checkpointed with a cache argument the
class's checkpointing wrapper would drop (``_swap.drops_cache``) run the class's own forward.
"""
from __future__ import annotations

import functools

import torch

from .. import rms_norm as _fused
from . import _rms_norm
from ._source import digest
from ._swap import Swap, checkpointing, drops_cache, global_hooks

# Classes whose forward was LlamaDecoderLayer's, token for token, in transformers 5.24 and whose post-attention norm
# is of _rms_norm.LLAMA_FORMULA (many more decoder layers share the forward, over norms of other formulas: those
# calls would all fall back). The run-time check below still compares each against _CHECKED.
LLAMA_DECODER = frozenset({
    "LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3DecoderLayer",
    "Qwen3MoeDecoderLayer",
})

# The docstring-free syntax tree's hash (._source.digest) of the forward this route reproduces, decorator included.
_CHECKED = "b555e7652f3e4349"

# The arguments the class's forward passes self_attn, with its defaults.
_ATTENTION_DEFAULTS = (("attention_mask", None), ("position_ids", None), ("cache", None), ("use_cache", False),
                       ("position_embeddings", None))

_SUBMODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@functools.cache
def _checked(cls: type) -> bool:
    return digest(cls.forward) == _CHECKED


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face decoder layer of :data:`LLAMA_DECODER` with its class's own forward, that
    forward being the code this route reproduces."""
    cls = type(module)
    return (cls.__name__ in LLAMA_DECODER and cls.__module__.startswith("transformers.models.")
            and "forward" not in vars(module)
            and all(isinstance(getattr(module, n, None), torch.nn.Module) for n in _SUBMODULES) and _checked(cls))


def _norm_fusable(norm) -> bool:
    """Calling ``norm`` computes exactly LlamaRMSNorm's formula: a class of that formula, no hooks, its class's
    forward or the RMSNorm route's (which computes the same bits)."""
    cls = type(norm)
    own = vars(norm).get("forward")
    return (cls.__name__ in _rms_norm.LLAMA_FORMULA and cls.__module__.startswith("transformers.models.")
            and (own is None or getattr(own, "__func__", None) is _rms_norm.forward)
            and not (norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks
                     or norm._backward_pre_hooks)
            and isinstance(getattr(norm, "weight", None), torch.Tensor)
            and isinstance(getattr(norm, "variance_epsilon", None), float))


def _fusable(self, hidden_states, args, kwargs) -> bool:
    """What can be checked before the layer runs: the call form the models use (the cache by its current name), no
    autocast, no global hooks, a post-attention norm the fused op computes exactly."""
    return (not args and "past_key_values" not in kwargs and isinstance(hidden_states, torch.Tensor)
            and not torch.is_autocast_enabled("cpu") and not global_hooks()
            and _norm_fusable(self.post_attention_layernorm))


def forward(self, hidden_states, *args, **kwargs):
    """The routed forward: the class's computation with the residual add and ``post_attention_layernorm`` fused
    where the kernel takes the tensors; every other call as the class computes it. Under gradient checkpointing,
    checkpointed as the class's forward is."""
    if not _fusable(self, hidden_states, args, kwargs) or (checkpointing(self) and drops_cache(self, kwargs)):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if checkpointing(self):  # as the class's wrapper: the hidden states positional, the keywords bound
        return self._gradient_checkpointing_func(functools.partial(_compute, self, **kwargs), hidden_states)
    return _compute(self, hidden_states, **kwargs)


def _compute(self, hidden_states, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **{**dict(_ATTENTION_DEFAULTS), **kwargs})
    norm = self.post_attention_layernorm
    if isinstance(hidden_states, torch.Tensor) and _fused.supports_add(hidden_states, residual, norm.weight):
        hidden_states, residual = _fused.add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon)
    else:  # the class's ops
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
