"""The native policy's routing of Hugging Face pre-norm encoder layers (ViT's ``ViTLayer`` and the classes with the
very same forward: DeiT, ViT-MAE, ViT-MSN, I-JEPA, AST, ViViT) to ``ipex_train.add_norm``'s
:func:`~ipex_train.add_norm.add_layer_norm_with_sum`.

Such a layer computes::

    residual = hidden_states
    hidden_states, _ = self.attention(self.layernorm_before(hidden_states), attention_mask, **kwargs)
    hidden_states = self.dropout(hidden_states) + residual
    residual = hidden_states
    hidden_states = self.dropout(self.mlp(self.layernorm_after(hidden_states))) + residual

The swapped forward (:mod:`._swap`, on the instance; the class is untouched) makes the same module calls in the same
order, except that ``self.dropout(...) + residual`` and ``self.layernorm_after`` after the attention are one fused op
whose sum is the residual stream the MLP's add takes. Any call it would not compute as the class does (hooks on the
norm or the dropout, autocast, dtypes the kernel does not take) runs the class's own forward, or, once the attention
has run, the class's remaining ops.

Which classes: any of transformers' whose forward is, at run time, the code checked here (its docstring-free syntax
tree hashed in :data:`_CHECKED`: transformers 5.24's ``ViTLayer.forward``), with a plain ``nn.LayerNorm`` and
``nn.Dropout``. Another release with other code there leaves the layers unrouted.
"""
from __future__ import annotations

import functools

import torch

from .. import add_norm as _fused
from ._source import digest
from ._swap import Swap, checkpointing, drops_cache, global_hooks, plain

# The hash (._source.digest) of transformers 5.24's ViTLayer.forward, which DeiTLayer, ViTMAELayer, ViTMSNLayer,
# IJepaLayer, ASTLayer and VivitLayer share token for token (Dinov2Layer, with layer scale, does not).
_CHECKED = "0e2c618c9279fb62"
_SUBMODULES = ("attention", "layernorm_before", "layernorm_after", "mlp", "dropout")


@functools.cache
def _checked(cls: type) -> bool:
    return digest(cls.forward) == _CHECKED


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers layer whose class's forward is the pre-norm code checked here, with that
    forward (not one replaced on the instance), a plain ``nn.LayerNorm`` over the last dimension as
    ``layernorm_after`` and a plain ``nn.Dropout``."""
    cls = type(module)
    if not (cls.__module__.startswith("transformers.models.") and "forward" not in vars(module)
            and all(isinstance(getattr(module, name, None), torch.nn.Module) for name in _SUBMODULES)):
        return False
    norm = module.layernorm_after
    return (type(norm) is torch.nn.LayerNorm and type(module.dropout) is torch.nn.Dropout
            and len(norm.normalized_shape) == 1 and _checked(cls))


def _fusable(self, hidden_states) -> bool:
    """What can be checked before the attention runs: the norm and dropout as at routing, without hooks (the fused op
    replaces the first dropout call and the norm's), no autocast (under which torch's LayerNorm computes and returns
    fp32), a CPU tensor in."""
    norm, drop = self.layernorm_after, self.dropout
    return (type(norm) is torch.nn.LayerNorm and type(drop) is torch.nn.Dropout and plain(norm) and plain(drop)
            and len(norm.normalized_shape) == 1 and 0.0 <= drop.p < 1.0 and not global_hooks()
            and not torch.is_autocast_enabled("cpu")
            and isinstance(hidden_states, torch.Tensor) and hidden_states.device.type == "cpu")


def forward(self, hidden_states, attention_mask=None, **kwargs):
    """The routed forward: the class's module calls, with the residual add after the attention and
    ``layernorm_after`` fused where the operands are bf16 or fp32 CPU tensors the kernel takes; every other call as
    the class computes it. Under gradient checkpointing, checkpointed as the class's forward is."""
    if not _fusable(self, hidden_states) or (checkpointing(self) and drops_cache(self, kwargs)):
        return type(self).forward(self, hidden_states, attention_mask, **kwargs)
    if checkpointing(self):
        # As GradientCheckpointingLayer's wrapper: the tensors positional, the keywords bound (calls whose cache
        # arguments the wrapper would drop run the class's forward, above).
        return self._gradient_checkpointing_func(functools.partial(_compute, self, **kwargs), hidden_states,
                                                 attention_mask)
    return _compute(self, hidden_states, attention_mask, **kwargs)


def _compute(self, hidden_states, attention_mask=None, **kwargs):
    residual = hidden_states
    hidden_states = self.layernorm_before(hidden_states)
    hidden_states, _ = self.attention(hidden_states, attention_mask, **kwargs)
    norm, drop = self.layernorm_after, self.dropout
    if (isinstance(hidden_states, torch.Tensor) and hidden_states.shape == residual.shape
            and tuple(norm.normalized_shape) == (hidden_states.shape[-1],)
            and _fused.supports(hidden_states, residual, norm.weight, norm.bias)):
        normed, hidden_states = _fused.add_layer_norm_with_sum(hidden_states, residual, norm.weight, norm.bias,
                                                               norm.eps, drop.p, drop.training)
    else:  # the class's ops
        hidden_states = drop(hidden_states) + residual
        normed = norm(hidden_states)
    residual = hidden_states
    hidden_states = self.mlp(normed)
    hidden_states = self.dropout(hidden_states)
    return hidden_states + residual


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
