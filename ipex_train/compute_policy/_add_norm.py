"""The native policy's routing of Hugging Face post-norm output blocks (``BertSelfOutput``, ``BertOutput`` and the
classes with the very same forward) to ``ipex_train.add_norm``.

Such a block computes ``LayerNorm(dropout(dense(h)) + input_tensor)``. The swapped forward (:mod:`._swap`, on the
instance; the class is untouched) still calls ``self.dense`` (so the linear goes through the policy as before) and
then the fused dropout + add + LayerNorm; any call it would not compute as the class does runs the class's own
forward, or, once ``self.dense`` has run, the class's remaining ops.
"""
from __future__ import annotations

import torch

from .. import add_norm as _fused
from ._swap import Swap, global_hooks, plain

# Hugging Face classes whose forward is exactly BertSelfOutput's (dense, dropout, LayerNorm(h + input_tensor)) and
# whose __init__ builds nn.Linear / nn.LayerNorm / nn.Dropout, checked in the transformers 5.x source (an AST
# comparison of the forward bodies). Many other classes share that forward but are not listed until checked the same
# way; DeBERTa's share it with their own LayerNorm class, which the type checks below refuse anyway.
POST_NORM_OUTPUT = frozenset({
    "BertSelfOutput", "BertOutput", "RobertaSelfOutput", "RobertaOutput", "XLMRobertaSelfOutput", "XLMRobertaOutput",
    "CamembertSelfOutput", "CamembertOutput", "ElectraSelfOutput", "ElectraOutput", "Data2VecTextSelfOutput",
    "Data2VecTextOutput", "ErnieSelfOutput", "ErnieOutput",
})


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face block of :data:`POST_NORM_OUTPUT` with its class's own forward and a plain
    ``nn.Dropout`` and ``nn.LayerNorm`` over the last dimension."""
    cls = type(module)
    if not (cls.__name__ in POST_NORM_OUTPUT and cls.__module__.startswith("transformers.models.")
            and "forward" not in vars(module)):
        return False
    dense, norm, drop = (getattr(module, name, None) for name in ("dense", "LayerNorm", "dropout"))
    return (isinstance(dense, torch.nn.Module) and type(norm) is torch.nn.LayerNorm and type(drop) is torch.nn.Dropout
            and len(norm.normalized_shape) == 1)


def _fusable(self, input_tensor) -> bool:
    """What can be checked before ``self.dense`` runs: the submodules as at routing, without hooks, and no autocast
    (under which torch's LayerNorm computes and returns fp32)."""
    norm, drop = self.LayerNorm, self.dropout
    return (type(norm) is torch.nn.LayerNorm and type(drop) is torch.nn.Dropout and plain(norm) and plain(drop)
            and len(norm.normalized_shape) == 1 and 0.0 <= drop.p < 1.0 and not global_hooks()
            and not torch.is_autocast_enabled("cpu")
            and isinstance(input_tensor, torch.Tensor) and input_tensor.device.type == "cpu")


def forward(self, hidden_states, input_tensor):
    """The routed forward: ``self.dense`` as before, then dropout + add + LayerNorm fused where the operands are
    bf16 or fp32 CPU tensors of one dtype and shape; every other call as the class computes it."""
    if not _fusable(self, input_tensor):
        return type(self).forward(self, hidden_states, input_tensor)
    h = self.dense(hidden_states)
    norm, drop = self.LayerNorm, self.dropout
    if (h.shape != input_tensor.shape or tuple(norm.normalized_shape) != (h.shape[-1],)
            or not _fused.supports(h, input_tensor, norm.weight, norm.bias)):
        return norm(drop(h) + input_tensor)  # the class's remaining ops
    return _fused.add_layer_norm(h, input_tensor, norm.weight, norm.bias, norm.eps, drop.p, drop.training)


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
