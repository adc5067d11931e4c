"""The optimizer optimize() returns for a model sharded with FSDP2: the usual training optimizer, stepping shards.

Its class derives from the class optimize() makes for the user's optimizer (so isinstance, schedulers, hooks and
param groups are torch's) and changes three things, all in :mod:`ipex_train.optim.sharded`:

* the fused part of ``step`` steps the local shards;
* ``state_dict`` returns the state as fp32 DTensors (reduced-byte state decoded shard by shard), what
  ``torch.distributed.checkpoint`` saves and reshards;
* ``load_state_dict`` checks the checkpoint on every rank as one process does (a refusal on one rank raises on all,
  nothing loaded), keeps the loaded fp32 DTensors (and the group dicts' identity); each group's ``state_dtype``
  re-encodes them at the next step.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from ..optim import sharded
from ..training.optimizer import TrainingOptimizer, fused_entry, training_class


class ShardedTrainingOptimizer(TrainingOptimizer):
    """Base of the optimizer classes returned for FSDP2 models; see the module docstring."""

    def _fused_part(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        entry = fused_entry(self)
        if entry is None:
            return params  # the user's own step, which torch's DTensor ops run on shards
        sharded.step(entry, group, self.state, params)
        return []

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict with every state tensor as an fp32 DTensor (reduced-byte state decoded)."""
        return sharded.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, keeping the param group dicts the same objects and each group's own
        ``state_dtype`` (the checkpoint's state is fp32; the next step stores it in the group's format). The
        checkpoint is checked as in one process, on every rank, before any rank loads (a refusal raises on all)."""
        sharded.load_state_dict(self, state_dict, self._fused_entry, f"{self._user_class.__name__}.load_state_dict()")


_CLASSES: dict[type, type] = {}


def sharded_class(user_class: type) -> type:
    """The ShardedTrainingOptimizer subclass for ``user_class`` (created once, named like it)."""
    cls = _CLASSES.get(user_class)
    if cls is None:
        base = training_class(user_class)
        cls = type(user_class.__name__, (ShardedTrainingOptimizer, base), {
            "__module__": __name__, "__qualname__": f"ShardedTrainingOptimizer[{user_class.__qualname__}]",
            "__doc__": user_class.__doc__})
        _CLASSES[user_class] = cls
    return cls
