"""HuggingFace Accelerate plugin: :func:`ipex_train.optimize` first, then ``accelerator.prepare``.

Accelerate 1.13+ has no IPEX support and no registry for third-party plugins (``Accelerator`` accepts only its own
plugin types; its config file and CLI reject unknown keys). So the plugin converts the model and optimizer itself
and then hands everything to ``accelerator.prepare``, using only Accelerate's public API::

    from accelerate import Accelerator
    from ipex_train.integrations.accelerate import IpexTrainPlugin

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    plugin = IpexTrainPlugin()                      # dtype follows accelerator.mixed_precision
    model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)
    # then the usual Accelerate loop: accelerator.accumulate, accelerator.backward, clip_grad_norm_,
    # optimizer.step(), scheduler.step(), optimizer.zero_grad(), save_state/load_state, get_state_dict ...

Options (argument > environment variable > default). ``accelerate launch`` passes the environment to every worker,
so the variables configure a launched job without touching the script:

* ``dtype`` / ``IPEX_TRAIN_DTYPE``: bf16 (bfloat16) or fp32 (float32); None or auto (default): bf16 when the
  accelerator's mixed_precision is "bf16", else fp32.
* ``level`` / ``IPEX_TRAIN_LEVEL``: O0 or O1 (default O1).
* ``split_master_weight_for_bf16`` / ``IPEX_TRAIN_SPLIT_MASTER_WEIGHT_FOR_BF16`` and ``fuse_update_step`` /
  ``IPEX_TRAIN_FUSE_UPDATE_STEP``: True/False; in the environment 1/0, true/false, yes/no, on/off; None or auto
  (default): the level's default.
* ``bf16_compute`` / ``IPEX_TRAIN_BF16_COMPUTE``: auto (default: the CPU decides), native or emulated.

What :meth:`IpexTrainPlugin.prepare` does: check the accelerator and the objects; ``optimize(..., inplace=True)``
(so an LR scheduler created on the user's optimizer keeps driving it: the param groups are shared); with several
processes, give every process rank 0's exact fp32 weights (DDP's own broadcast copies only the bf16 tops); then
``accelerator.prepare`` on everything, in the order given. Under ``mixed_precision="bf16"`` Accelerate runs the
forward under CPU bf16 autocast; the bf16 compute policy (:mod:`ipex_train.compute_policy`, attached by optimize()
for bf16 and by the plugin for fp32 weights) computes its matmuls and convolutions in fp32 on CPUs without bf16
units, where bf16 kernels are about 10x slower. Tested with Accelerate 1.15.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

try:
    import accelerate
    from accelerate.data_loader import DataLoaderAdapter
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
    from accelerate.utils import DistributedType
except ImportError as e:  # the plugin is optional; say what to install instead of a bare ModuleNotFoundError
    raise ImportError("ipex_train.integrations.accelerate needs HuggingFace Accelerate: "
                      "pip install accelerate") from e

from .. import compute_policy
from ..config import OptimizeConfig, env_var
from ..frontend import optimize
from ._convert import broadcast_fp32_weights

__all__ = ["IpexTrainPlugin", "ENV_VARS"]

# The plugin's options (fields of OptimizeConfig) and the environment variable each falls back to.
OPTIONS = ("dtype", "level", "split_master_weight_for_bf16", "fuse_update_step", "bf16_compute")
ENV_VARS = {name: env_var(name) for name in OPTIONS}
# Distributed types the plugin serves: one process, or DDP over gloo/mpi/ccl on CPUs.
_SERVED = (DistributedType.NO, DistributedType.MULTI_CPU)


@dataclasses.dataclass(frozen=True, init=False)
class IpexTrainPlugin:
    """ipex_train for HuggingFace Accelerate: ``optimize()`` the model and optimizer, then ``accelerator.prepare``.

    The plugin holds an :class:`ipex_train.OptimizeConfig` (``config``). Its arguments are shorthand for the
    config's fields of the same name, as optimize()'s are; each one left None is read from its environment variable
    (``IPEX_TRAIN_<OPTION>``, see :data:`ENV_VARS` and the module docstring, and
    :meth:`OptimizeConfig.from_env` for the other fields), else ipex_train's default applies. A ``config`` given
    instead is used as it is (optimize() reads the environment for its fields left None); arguments given next to
    it must agree with its fields (ValueError naming both otherwise).

    Args:
        dtype: torch.bfloat16 or torch.float32 (or "bf16"/"fp32"); None follows ``accelerator.mixed_precision``.
        level: "O0" or "O1" (optimize()'s level; default "O1").
        split_master_weight_for_bf16: keep bf16 weights as bf16 top + int16 residual (see optimize()).
        fuse_update_step: fused C++ optimizer step for SGD/Adam/AdamW/Adagrad/Lamb/Lars.
        bf16_compute: "auto", "native" or "emulated": how bf16 matmuls are computed (ipex_train.compute_policy).
        config: the whole configuration at once.

    The options read back as attributes (``plugin.dtype`` ...: the resolved values). Raises ValueError naming the
    option (or its environment variable) for a value it does not accept, TypeError for one of the wrong type (also
    a ValueError).
    """

    config: OptimizeConfig

    def __init__(self, dtype: torch.dtype | str | None = None, level: str | None = None,
                 split_master_weight_for_bf16: bool | str | None = None, fuse_update_step: bool | str | None = None,
                 bf16_compute: str | None = None, *, config: OptimizeConfig | None = None) -> None:
        options = dict(dtype=dtype, level=level, split_master_weight_for_bf16=split_master_weight_for_bf16,
                       fuse_update_step=fuse_update_step, bf16_compute=bf16_compute)
        try:
            if config is None:
                config = OptimizeConfig.from_env(**options)
            elif not isinstance(config, OptimizeConfig):
                raise TypeError(f"config must be an ipex_train.OptimizeConfig or None, got {type(config).__name__}")
            else:
                config = config.merged(**options)
        except (TypeError, ValueError) as e:
            raise type(e)(f"IpexTrainPlugin: {e}") from None
        object.__setattr__(self, "config", config)

    dtype = property(lambda self: self.config.dtype, doc="The dtype option (None: follow mixed_precision).")
    level = property(lambda self: self.config.level, doc="optimize()'s level.")
    split_master_weight_for_bf16 = property(lambda self: self.config.split_master_weight_for_bf16,
                                            doc="The split_master_weight_for_bf16 option (None: the level's).")
    fuse_update_step = property(lambda self: self.config.fuse_update_step,
                                doc="The fuse_update_step option (None: the level's).")
    bf16_compute = property(lambda self: self.config.bf16_compute, doc="The bf16 compute policy (None: auto).")

    def resolve_dtype(self, accelerator: accelerate.Accelerator) -> torch.dtype:
        """The dtype optimize() gets under ``accelerator``: the plugin's dtype, else bf16 when the accelerator's
        mixed_precision is "bf16" and fp32 when it is "no". Raises ValueError for combinations the CPU cannot serve.
        """
        precision = accelerator.mixed_precision
        if precision not in ("no", "bf16"):
            why = ("Accelerate runs no fp16 autocast or gradient scaling on the CPU"
                   if precision == "fp16" else "the plugin trains on the CPU")
            raise ValueError(f"IpexTrainPlugin: Accelerator(mixed_precision={precision!r}) is not supported ({why}); "
                             "use mixed_precision='bf16' or 'no'")
        if self.dtype == torch.float16:
            raise ValueError("IpexTrainPlugin: dtype=torch.float16 is not supported on the CPU: Accelerate runs no "
                             "fp16 autocast or gradient scaling there, so fp16 gradients would underflow; use "
                             "dtype=torch.bfloat16 with Accelerator(mixed_precision='bf16'), or torch.float32")
        if self.dtype == torch.bfloat16 and precision == "no":
            raise ValueError("IpexTrainPlugin: dtype=torch.bfloat16 needs Accelerator(mixed_precision='bf16') (its "
                             "autocast keeps the model's outputs and the loss in fp32); the accelerator has "
                             "mixed_precision='no'. Pass mixed_precision='bf16', or dtype=torch.float32 / None")
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if precision == "bf16" else torch.float32

    def prepare(self, accelerator: accelerate.Accelerator, *args: Any, device_placement: list[bool] | None = None):
        """``optimize()`` the one model and one optimizer among ``args``, then ``accelerator.prepare(*args)``.

        ``args`` are what ``accelerator.prepare`` takes (exactly one torch.nn.Module and one torch.optim.Optimizer
        over its parameters, plus any DataLoaders and LR schedulers, the schedulers created on that optimizer),
        none of them prepared yet. Returns the prepared objects in the same order, as ``accelerator.prepare`` does;
        use the returned model and optimizer (the optimizer passed in shares its param groups and state with the
        returned one, so schedulers created on it keep working).

        Raises TypeError/ValueError, before anything is modified, for an unsupported accelerator
        (DeepSpeed, FSDP, Megatron-LM, XLA, a non-CPU device, fp16/fp8), already prepared objects, not exactly
        one model and one optimizer, or step_in_backward with several processes or gradient accumulation.
        """
        if not isinstance(accelerator, accelerate.Accelerator):
            raise TypeError(f"IpexTrainPlugin.prepare: accelerator must be an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}")
        _check_accelerator(accelerator)
        _check_step_in_backward(accelerator, self.config.step_in_backward)
        dtype = self.resolve_dtype(accelerator)
        model_at, optimizer_at = _find_model_and_optimizer(args)
        model, optimizer = args[model_at], args[optimizer_at]
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and obj.optimizer is not optimizer:
                raise ValueError(f"IpexTrainPlugin.prepare: the LR scheduler at position {i} drives another "
                                 "optimizer; create it on the optimizer passed to prepare()")

        model, optimizer = optimize(model, optimizer, inplace=True,
                                    config=dataclasses.replace(self.config, dtype=dtype))
        if accelerator.mixed_precision == "bf16" and dtype != torch.bfloat16:
            # optimize() attaches the policy only to bf16 models; fp32 weights under Accelerate's bf16 autocast
            # would otherwise run bf16 matmuls.
            compute_policy.attach(model, compute_policy.resolve(self.bf16_compute))
        if accelerator.num_processes > 1:
            broadcast_fp32_weights(model)

        args = list(args)
        args[model_at], args[optimizer_at] = model, optimizer
        return accelerator.prepare(*args, device_placement=device_placement)


def _check_accelerator(accelerator: accelerate.Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind not in _SERVED:
        raise ValueError(f"IpexTrainPlugin: accelerator.state.distributed_type is {kind}; the plugin serves "
                         f"{' and '.join(str(t) for t in _SERVED)} (DeepSpeed, FSDP, Megatron-LM and XLA keep their "
                         "own weight copies and optimizer); use plain DDP on CPUs, or drop the plugin (to shard "
                         "on CPUs: torchrun, torch's fully_shard, then ipex_train.optimize(..., inplace=True))")
    if accelerator.device.type != "cpu":
        raise ValueError(f"IpexTrainPlugin: accelerator.device is {accelerator.device}; ipex_train trains on the "
                         "CPU: create the accelerator with Accelerator(cpu=True) (or accelerate launch --cpu)")


def _check_step_in_backward(accelerator: accelerate.Accelerator, step_in_backward: bool | None) -> None:
    # The hooks step each parameter as its local grad is ready: before DDP's all-reduce (ranks would drift apart
    # silently) and once per backward (accumulation raises only at the second backward, mid-run).
    if not step_in_backward:
        return
    if accelerator.num_processes > 1:
        raise ValueError(f"IpexTrainPlugin: step_in_backward (IPEX_TRAIN_STEP_IN_BACKWARD) steps each parameter "
                         f"before DistributedDataParallel's all-reduce; it cannot run with {accelerator.num_processes}"
                         " processes: turn it off, or train in one process")
    if accelerator.gradient_accumulation_steps > 1:
        raise ValueError(f"IpexTrainPlugin: step_in_backward (IPEX_TRAIN_STEP_IN_BACKWARD) makes each backward one "
                         f"optimizer step; Accelerator(gradient_accumulation_steps="
                         f"{accelerator.gradient_accumulation_steps}) needs several backwards per step: turn one off")


def _find_model_and_optimizer(args: tuple) -> tuple[int, int]:
    """Positions of the one model and the one optimizer in ``args``; errors for prepared objects."""
    models, optimizers = [], []
    for i, obj in enumerate(args):
        if isinstance(obj, AcceleratedOptimizer):
            raise TypeError(f"IpexTrainPlugin.prepare: the optimizer at position {i} is an AcceleratedOptimizer "
                            "(already passed through accelerator.prepare); pass the plain torch optimizer")
        if isinstance(obj, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise TypeError(f"IpexTrainPlugin.prepare: the model at position {i} is wrapped in "
                            f"{type(obj).__name__} (already prepared); pass the plain torch.nn.Module")
        if isinstance(obj, (AcceleratedScheduler, DataLoaderAdapter)):
            raise TypeError(f"IpexTrainPlugin.prepare: the object at position {i} ({type(obj).__name__}) was "
                            "already prepared by Accelerate; pass the plain DataLoader / LR scheduler")
        if isinstance(obj, nn.Module):
            models.append(i)
        elif isinstance(obj, torch.optim.Optimizer):
            optimizers.append(i)
    if len(models) != 1 or len(optimizers) != 1:
        raise ValueError(f"IpexTrainPlugin.prepare: exactly one torch.nn.Module and one torch.optim.Optimizer are "
                         f"accepted, got {len(models)} model(s) at positions {models} and {len(optimizers)} "
                         f"optimizer(s) at positions {optimizers}; prepare other models with accelerator.prepare")
    return models[0], optimizers[0]
