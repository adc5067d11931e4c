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
import os
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
from ..frontend import LEVELS, optimize

__all__ = ["IpexTrainPlugin", "ENV_VARS"]

# The environment variable each option falls back to.
ENV_VARS = {
    "dtype": "IPEX_TRAIN_DTYPE",
    "level": "IPEX_TRAIN_LEVEL",
    "split_master_weight_for_bf16": "IPEX_TRAIN_SPLIT_MASTER_WEIGHT_FOR_BF16",
    "fuse_update_step": "IPEX_TRAIN_FUSE_UPDATE_STEP",
    "bf16_compute": compute_policy.ENV_VAR,
}

_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
                "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_AUTO = ("auto", "")
# Distributed types the plugin serves: one process, or DDP over gloo/mpi/ccl on CPUs.
_SERVED = (DistributedType.NO, DistributedType.MULTI_CPU)


def _parse_dtype(value: Any, where: str) -> torch.dtype | None:
    if value is None or (isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values()):
        return value
    if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.strip().lower()]
    if isinstance(value, str) and value.strip().lower() in _AUTO:
        return None
    raise ValueError(f"IpexTrainPlugin: {where}={value!r} is not accepted; use torch.bfloat16 / 'bf16', "
                     "torch.float32 / 'fp32', or None / 'auto' (follow accelerator.mixed_precision)")


def _parse_level(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().upper() in LEVELS:
        return value.strip().upper()
    raise ValueError(f"IpexTrainPlugin: {where}={value!r} is not accepted; use 'O0' or 'O1'")


def _parse_bool(value: Any, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE or text in _AUTO:
            return True if text in _TRUE else False if text in _FALSE else None
    raise ValueError(f"IpexTrainPlugin: {where}={value!r} is not accepted; use True/False/None, or in the "
                     f"environment one of {', '.join(_TRUE + _FALSE)} or auto")


def _parse_bf16_compute(value: Any, where: str) -> str | None:
    accepted = ("auto",) + compute_policy.POLICIES
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in accepted:
        return value.strip().lower()
    raise ValueError(f"IpexTrainPlugin: {where}={value!r} is not accepted; use one of {', '.join(accepted)}")


_PARSERS = {"dtype": _parse_dtype, "level": _parse_level, "split_master_weight_for_bf16": _parse_bool,
            "fuse_update_step": _parse_bool, "bf16_compute": _parse_bf16_compute}


@dataclasses.dataclass
class IpexTrainPlugin:
    """ipex_train for HuggingFace Accelerate: ``optimize()`` the model and optimizer, then ``accelerator.prepare``.

    Each option left None is read from its environment variable (see :data:`ENV_VARS` and the module docstring),
    else ipex_train's default applies. After construction the fields hold the resolved values (None: default).

    Args:
        dtype: torch.bfloat16 or torch.float32 (or "bf16"/"fp32"); None follows ``accelerator.mixed_precision``.
        level: "O0" or "O1" (optimize()'s level; default "O1").
        split_master_weight_for_bf16: keep bf16 weights as bf16 top + int16 residual (see optimize()).
        fuse_update_step: fused C++ optimizer step for SGD/Adam/AdamW/Adagrad/Lamb/Lars.
        bf16_compute: "auto", "native" or "emulated": how bf16 matmuls are computed (ipex_train.compute_policy).

    Raises ValueError naming the option (or its environment variable) for a value it does not accept.
    """

    dtype: torch.dtype | str | None = None
    level: str | None = None
    split_master_weight_for_bf16: bool | str | None = None
    fuse_update_step: bool | str | None = None
    bf16_compute: str | None = None

    def __post_init__(self) -> None:
        for name, parse in _PARSERS.items():
            value = parse(getattr(self, name), name)
            if value is None and os.environ.get(ENV_VARS[name]) is not None:
                value = parse(os.environ[ENV_VARS[name]], ENV_VARS[name])
            setattr(self, name, value)

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
        (DeepSpeed, FSDP, Megatron-LM, XLA, a non-CPU device, fp16/fp8), already prepared objects, or not exactly
        one model and one optimizer.
        """
        if not isinstance(accelerator, accelerate.Accelerator):
            raise TypeError(f"IpexTrainPlugin.prepare: accelerator must be an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}")
        _check_accelerator(accelerator)
        dtype = self.resolve_dtype(accelerator)
        model_at, optimizer_at = _find_model_and_optimizer(args)
        model, optimizer = args[model_at], args[optimizer_at]
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and obj.optimizer is not optimizer:
                raise ValueError(f"IpexTrainPlugin.prepare: the LR scheduler at position {i} drives another "
                                 "optimizer; create it on the optimizer passed to prepare()")

        model, optimizer = optimize(
            model, optimizer, dtype=dtype, level=self.level or "O1", inplace=True,
            split_master_weight_for_bf16=self.split_master_weight_for_bf16,
            fuse_update_step=self.fuse_update_step, bf16_compute=self.bf16_compute)
        if accelerator.mixed_precision == "bf16" and dtype != torch.bfloat16:
            # optimize() attaches the policy only to bf16 models; fp32 weights under Accelerate's bf16 autocast
            # would otherwise run bf16 matmuls.
            compute_policy.attach(model, compute_policy.resolve(self.bf16_compute))
        if accelerator.num_processes > 1:
            _broadcast_fp32_weights(model)

        args = list(args)
        args[model_at], args[optimizer_at] = model, optimizer
        return accelerator.prepare(*args, device_placement=device_placement)


def _check_accelerator(accelerator: accelerate.Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind not in _SERVED:
        raise ValueError(f"IpexTrainPlugin: accelerator.state.distributed_type is {kind}; the plugin serves "
                         f"{' and '.join(str(t) for t in _SERVED)} (DeepSpeed, FSDP, Megatron-LM and XLA keep their "
                         "own weight copies and optimizer); use plain DDP on CPUs, or drop the plugin")
    if accelerator.device.type != "cpu":
        raise ValueError(f"IpexTrainPlugin: accelerator.device is {accelerator.device}; ipex_train trains on the "
                         "CPU: create the accelerator with Accelerator(cpu=True) (or accelerate launch --cpu)")


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


def _broadcast_fp32_weights(model: nn.Module) -> None:
    """Give every process rank 0's exact weights: DDP's own broadcast at wrap time copies only the bf16 tops,
    which would leave different residuals (hence different fp32 weights) on ranks seeded differently."""
    state = model.state_dict()  # fp32 values of the low-precision parameters, aliases of the others
    for value in state.values():
        if isinstance(value, torch.Tensor):
            torch.distributed.broadcast(value, src=0)
    model.load_state_dict(state)  # re-splits the fp32 values into top + residual
