"""A private copy of a checkpoint's state for a background write.

A background write must not see the training change what it writes, so the state dict handed to it may share no
memory with the live model and optimizer. Most of it is new already: split bf16 weights are combined into new fp32
tensors, reduced-byte optimizer state is decoded into new ones. Only what shares storage with a live parameter,
buffer or optimizer state tensor (fp32 parameters, fp32 state, step counters) is copied here: on a bf16 model with
int8 state that is a small part, where copying the whole state dict (DCP's own staging for ``async_save``) would
copy the checkpoint's size once more on the training thread.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # a DTensor's shard on this rank
    return local if isinstance(local, torch.Tensor) else t


def _storage(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


def live_storages(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    """The storages of everything training will change in place: parameters, buffers and optimizer state."""
    live = {_storage(t) for t in model.parameters()}
    live.update(_storage(t) for t in model.buffers())
    if optimizer is not None:
        for entry in optimizer.state.values():
            live.update(_storage(v) for v in entry.values() if isinstance(v, torch.Tensor))
    live.discard(0)
    return live


def _private(tree: Any, live: set[int]) -> Any:
    if isinstance(tree, torch.Tensor):
        ptr = _storage(tree)
        return tree.detach().clone() if ptr == 0 or ptr in live else tree
    if isinstance(tree, dict):
        return {k: _private(v, live) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_private(v, live) for v in tree)
    return copy.deepcopy(tree)


def private_copy(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 tensor_parts: tuple[str, ...] = ("model", "optim")) -> dict[str, Any]:
    """``state`` with every tensor of ``tensor_parts`` that shares memory with the live model or optimizer copied,
    and every other part deep-copied (the scheduler's lists, the caller's data position)."""
    live = live_storages(model, optimizer)
    return {k: _private(v, live) if k in tensor_parts else copy.deepcopy(v) for k, v in state.items()}
