"""The optimize() record on a model: what optimize() leaves on the module it returns, read by the summary, the
memory report, the transformers integration and a second optimize() of the same model.

Two attributes, written and read only through the functions here: the model's :class:`MasterWeights` (training:
the fp32 truth of its low-precision parameters) and the dtype optimize() was asked for (None for fp32). Also
:func:`copy_model`, the deepcopy optimize(inplace=False) and quantization.prepare/convert make.
"""
from __future__ import annotations

import copy

from torch import Tensor, nn

_MASTERS = "_ipex_train_masters"
_DTYPE = "_ipex_train_dtype"  # copied with the model, ignored by state_dict and tracing
_UNSET = object()


def masters(model: nn.Module):
    """The :class:`MasterWeights` optimize() gave ``model`` for training, or None."""
    return getattr(model, _MASTERS, None)


def set_masters(model: nn.Module, value) -> None:
    """Record ``value`` (a :class:`MasterWeights`) as the fp32 truth of ``model``'s parameters."""
    setattr(model, _MASTERS, value)


def dtype(model: nn.Module, default=None):
    """The low-precision dtype optimize() was asked for on ``model`` (None for fp32), or ``default`` when
    optimize() has not recorded one."""
    value = getattr(model, _DTYPE, _UNSET)
    return default if value is _UNSET else value


def has_dtype(model: nn.Module) -> bool:
    """Whether optimize() recorded a dtype on ``model``."""
    return hasattr(model, _DTYPE)


def set_dtype(model: nn.Module, value) -> None:
    """Record the dtype optimize() was asked for (None for fp32)."""
    setattr(model, _DTYPE, value)


def copy_model(model: nn.Module) -> tuple[nn.Module, dict[int, object]]:
    """deepcopy of ``model`` and its memo. Non-leaf tensors stored on modules (cached activations) cannot be
    deep-copied; the copy shares them instead."""
    memo: dict[int, object] = {}
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, dict):
                value = list(value.values())
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, Tensor) and not t.is_leaf:
                    memo[id(t)] = t
    return copy.deepcopy(model, memo), memo
