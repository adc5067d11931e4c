"""DTensor helpers that import nothing of ipex_train: whether a tensor is a DTensor (a parameter, grad or state
sharded by FSDP2), and its local shard; the memory report and the summary count a rank's shards with them.

A DTensor can only exist once ``torch.distributed.tensor`` is imported, so the checks look it up in ``sys.modules``
instead of importing it (``import ipex_train`` must not load torch.distributed).
"""
from __future__ import annotations

import sys

from torch import Tensor


def dtensor_class():
    """torch's DTensor class, or None while ``torch.distributed.tensor`` is not imported (no DTensor exists)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (a sharded FSDP2 parameter, its grad or state)."""
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` when it is a DTensor, else ``t``."""
    return t.to_local() if is_dtensor(t) else t
