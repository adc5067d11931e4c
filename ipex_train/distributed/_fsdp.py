"""optimize() on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): checks and preparation.

The order is FSDP2's own: ``fully_shard`` every block and the root, build the optimizer over the sharded
parameters, then ``optimize(model, optimizer, dtype=..., inplace=True)``. FSDP2 already keeps what optimize()
builds for one process: each parameter's fp32 shard is the master copy, and its ``MixedPrecisionPolicy`` casts the
gathered weights to the compute dtype. So nothing is converted here: the checks make sure the policy matches
``dtype`` and the optimizer steps shards (:mod:`._optimizer`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from ..base.options import check_model_and_optimizer
from ..precision.master_weights import MasterWeights
from ..training.optimizer import TrainingOptimizer, training_optimizer, user_class
from ._optimizer import sharded_class

_ORDER = ("fully_shard every block and the root, build the optimizer from model.parameters(), then call "
          "optimize(model, optimizer, dtype=..., inplace=True)")
_POLICY = ("fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
           "reduce_dtype=torch.float32))")


def units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_dtype(unit: nn.Module) -> torch.dtype | None:
    # The unit's MixedPrecisionPolicy: FSDP2 exposes it only on its state object.
    return unit._get_fsdp_state()._mp_policy.param_dtype


def _check_call(model: nn.Module, optimizer, inplace: bool, config, optimized_before: bool) -> None:
    if optimized_before:
        raise RuntimeError("optimize(): this model was optimize()d before fully_shard; FSDP2 then replaced its "
                           "parameters (and, with dtype=bfloat16, shards bf16 tops without their fp32 residuals), "
                           f"so the optimizer would train nothing. Start from the fp32 model: {_ORDER}")
    check_model_and_optimizer(model, optimizer, "optimize()")
    if optimizer is None:
        raise ValueError("optimize(): a fully_shard model is for training here; pass its optimizer "
                         "(optimize(model, optimizer, inplace=True)), or optimize an unsharded copy for inference")
    if not inplace:
        raise ValueError("optimize(): inplace=False copies the model, which FSDP2 does not support; pass "
                         "inplace=True (the order: " + _ORDER + ")")
    if config.sycl:
        raise ValueError("optimize(): sycl=True is not available for fully_shard models; leave sycl unset")
    if config.frozen_weights == "low_precision":
        # FSDP2 keeps one original dtype per unit and its fp32 shards are the only copy of the weights: storing
        # the frozen ones in bf16 would mean bf16 originals beside fp32 ones in a unit (FSDP2 refuses that).
        raise ValueError("optimize(): frozen_weights='low_precision' is not available for fully_shard models: "
                         "FSDP2 keeps every original parameter of a unit fp32 (its shard is the only copy), so "
                         "frozen weights stay fp32 shards and are cast to the MixedPrecisionPolicy's param_dtype "
                         "for compute; leave frozen_weights unset or pass 'lossless'")


def _check_parameters(model: nn.Module) -> None:
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(f"optimize(): {len(plain)} parameter(s) of the model are not sharded (e.g. {plain[0]!r}); "
                         "call fully_shard(model, mesh=...) on the root module too, after its blocks")
    bad = [n for n, p in model.named_parameters()
           if p.placements != (Shard(0),) or p.device_mesh.ndim != 1 or p.dtype != torch.float32]
    if bad:
        raise ValueError(f"optimize(): parameter {bad[0]!r} is not an fp32 parameter sharded on dim 0 of a 1-D "
                         "mesh; ipex_train steps FSDP2 models whose original parameters are fp32 (the shard is "
                         "the master copy), on init_device_mesh('cpu', (world_size,))")


def _check_policies(model: nn.Module, dtype) -> None:
    wanted = dtype if dtype in (torch.bfloat16, torch.float16) else None
    if wanted is torch.float16:
        raise ValueError("optimize(): dtype=torch.float16 is not available for fully_shard models; use "
                         f"dtype=torch.bfloat16 with {_POLICY}")
    for unit in units(model):
        have = _param_dtype(unit)
        have = None if have == torch.float32 else have
        if have != wanted and wanted is torch.bfloat16:
            raise ValueError(f"optimize(dtype=torch.bfloat16): the fully_shard unit {type(unit).__name__} computes "
                             f"in {have or torch.float32}; FSDP2's MixedPrecisionPolicy sets the compute dtype, so "
                             f"pass {_POLICY} to every fully_shard call")
        if have != wanted:
            raise ValueError(f"optimize(dtype={dtype}): the fully_shard unit {type(unit).__name__} computes in "
                             f"{have} (its MixedPrecisionPolicy.param_dtype); pass dtype={have} to optimize(), or "
                             "MixedPrecisionPolicy() (fp32) to fully_shard")


def check(model: nn.Module, optimizer, dtype, inplace: bool, config, optimized_before: bool) -> None:
    """Raise (ValueError/RuntimeError naming what to do) unless ``model`` (with FSDP2 units) and ``optimizer`` can
    be prepared by optimize() with these options."""
    _check_call(model, optimizer, inplace, config, optimized_before)
    _check_parameters(model)
    _check_policies(model, dtype)
    in_model = {id(p) for p in model.parameters()}
    if any(id(p) not in in_model for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("optimize(): the optimizer holds parameters that are not the sharded model's; build the "
                         f"optimizer after fully_shard ({_ORDER})")


def sharded_optimizer(optimizer, masters: MasterWeights, fuse: bool):
    """The training optimizer stepping the shards of the checked model (see :func:`check`); ``masters`` holds
    nothing (the shards are the fp32 truth)."""
    if isinstance(optimizer, TrainingOptimizer) and optimizer._ipex_masters is masters:
        return optimizer
    new = training_optimizer(optimizer, masters, fuse, None, None)
    new.__class__ = sharded_class(user_class(optimizer))
    return new
