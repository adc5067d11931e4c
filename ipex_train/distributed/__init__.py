"""Training across processes: optimize() on models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

The order is FSDP2's: ``fully_shard`` every block and the root (on ``init_device_mesh("cpu", (world_size,))``),
build the optimizer, then ``ipex_train.optimize(model, optimizer, dtype=..., inplace=True)``. For bf16 pass
``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` to every
``fully_shard`` call: FSDP2 then keeps the fp32 shard as the master copy and computes in bf16; optimize() attaches
the bf16 compute policy and makes the optimizer step the shards with the fused kernels (Lamb and Lars with
whole-parameter norms summed across the shard group). The optimizer's ``state_dict`` holds fp32 DTensors, so
``torch.distributed.checkpoint`` with ``get_state_dict``/``set_state_dict`` saves and reshards it.

optimize() before ``fully_shard`` is refused (at optimize() or at the optimizer's first step), and so is
``inplace=False`` on a sharded model. ``docs/distributed.md`` has the commands and the measurements.
"""
from __future__ import annotations

import sys

from torch import nn

from ._guard import guard

__all__ = ["check_sharded", "guard", "is_sharded", "sharded_optimizer"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``model`` or one of its modules."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # a sharded model exists only once FSDP2 is imported
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def check_sharded(model: nn.Module, optimizer, dtype, inplace: bool, config, optimized_before: bool) -> None:
    """Raise unless optimize() can prepare the FSDP2 ``model`` and ``optimizer`` with these options (the order,
    inplace, the MixedPrecisionPolicy against ``dtype``); changes nothing. ``optimized_before``: optimize() converted
    this model's weights before ``fully_shard`` (refused)."""
    from . import _fsdp

    _fsdp.check(model, optimizer, dtype, inplace, config, optimized_before)


def sharded_optimizer(optimizer, masters, fuse: bool):
    """The training optimizer for the checked FSDP2 model's ``optimizer``: it steps the shards (fused when
    ``fuse``); ``masters`` is the model's (empty) MasterWeights. An optimizer optimize() already returned for this
    model is returned as it is."""
    from . import _fsdp

    return _fsdp.sharded_optimizer(optimizer, masters, fuse)
