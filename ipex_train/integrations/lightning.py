"""Lightning precision plugin: :func:`ipex_train.optimize` on the LightningModule and on the optimizers its
``configure_optimizers`` returns::

    import lightning as L
    from ipex_train.integrations.lightning import IpexTrainPrecision

    trainer = L.Trainer(accelerator="cpu", plugins=[IpexTrainPrecision("bf16")])
    trainer.fit(module)                                   # or fit(module, ckpt_path=...) to resume

Lightning's own ``precision="bf16-mixed"`` runs the fp32 module under CPU autocast; this plugin instead trains bf16
weights with an exact fp32 truth (split master weights) and fused optimizer steps, without autocast.

Where it hooks in (Lightning 2.6): the strategy calls ``Precision.convert_module`` on the module before it moves or
wraps it (DDP builds its gradient buckets from the parameter dtypes), and ``Precision.connect`` with the optimizers
and LR scheduler configs ``configure_optimizers`` returned. ``convert_module`` converts the module in place (bf16
weights with their fp32 truth; with several processes every rank then takes rank 0's exact fp32 weights), and
``connect`` returns ``optimize(module, optimizer, inplace=True)`` for each optimizer. The LR schedulers keep the
optimizer they were created on, which shares its param groups and state with the returned one, so they drive it.

Checkpoints hold the module's fp32 weights and the optimizers' fp32 state (``fit(ckpt_path=...)`` restores the
weights before the strategy sets up, then the optimizer state: the run continues exactly). Not supported (ValueError
from ``convert_module``, before anything changes): fp16, and ``step_in_backward`` with ``accumulate_grad_batches >
1``, ``gradient_clip_val`` or several processes. Strategies other than single-device and DDP (FSDP, DeepSpeed) keep
their own precision plugins; Lightning refuses a second one.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

try:
    from lightning.pytorch.plugins.precision import Precision
except ImportError as e:  # optional; say what to install instead of a bare ModuleNotFoundError
    raise ImportError("ipex_train.integrations.lightning needs Lightning: pip install 'lightning>=2.6'") from e

from .. import config as _config
from ..config import OptimizeConfig
from ..frontend import optimize
from ._convert import broadcast_fp32_weights, convert_model, refuse_step_in_backward_options

__all__ = ["IpexTrainPrecision"]

_BF16 = ("bf16", "bf16-true", "bf16-mixed", torch.bfloat16)
_FP32 = ("32", "32-true", 32, torch.float32)


class IpexTrainPrecision(Precision):
    """ipex_train as a Lightning precision plugin (see the module docstring).

    Args:
        precision: "bf16" (also "bf16-true", "bf16-mixed", torch.bfloat16): bf16 weights with fp32 truth and fused
            steps; "32" (also "32-true", 32, torch.float32): fp32 weights with the fused steps.
        config: an :class:`ipex_train.OptimizeConfig` with optimize()'s other options (``step_in_backward``,
            ``optimizer_state_dtype``, ``level`` ...); its ``dtype`` must be None or agree with ``precision``.
            Options it leaves None are read from the ``IPEX_TRAIN_<OPTION>`` environment variables.

    ``precision`` reads back as Lightning's name ("bf16-true" or "32-true": the weights' dtype); ``config`` is the
    resolved OptimizeConfig. Raises ValueError/TypeError naming the argument for values it does not accept.
    """

    def __init__(self, precision: str | int | torch.dtype = "bf16", *, config: OptimizeConfig | None = None) -> None:
        if precision in _BF16:
            dtype, self.precision = torch.bfloat16, "bf16-true"
        elif precision in _FP32:
            dtype, self.precision = torch.float32, "32-true"
        else:
            raise ValueError(f"IpexTrainPrecision: precision must be 'bf16' or '32' (or torch.bfloat16 / "
                             f"torch.float32), got {precision!r}; fp16 is not supported on the CPU (no loss scaling)")
        if config is None:
            config = OptimizeConfig()
        elif not isinstance(config, OptimizeConfig):
            raise TypeError(f"IpexTrainPrecision: config must be an ipex_train.OptimizeConfig or None, got "
                            f"{type(config).__name__}")
        if config.dtype not in (None, dtype):
            raise ValueError(f"IpexTrainPrecision: config.dtype={config.dtype} conflicts with precision="
                             f"{precision!r}; leave config.dtype None")
        self.config = _config.resolve(dataclasses.replace(config, dtype=dtype))
        self._module: nn.Module | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module`` in place (bf16 weights with their fp32 truth) before the strategy moves or wraps it;
        with several processes, give every rank rank 0's exact fp32 weights. Returns ``module``."""
        self._check_trainer(getattr(module, "_trainer", None))
        convert_model(module, self.config)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            broadcast_fp32_weights(module)
        self._module = module
        return module

    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """``optimize(module, optimizer, inplace=True)`` for each optimizer ``configure_optimizers`` returned; the
        model (maybe DDP-wrapped) and the LR scheduler configs are returned as they are."""
        module = self._module
        if module is None:  # a strategy that did not call convert_module first
            module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
            convert_model(module, self.config)
        out = []
        was_training = module.training
        module.train()
        try:
            for optimizer in optimizers:
                out.append(optimize(module, optimizer, inplace=True, config=self.config)[1])
        finally:
            module.train(was_training)
        return model, out, lr_schedulers

    def _check_trainer(self, trainer) -> None:
        if trainer is None or not self.config.step_in_backward:
            return
        refuse_step_in_backward_options("IpexTrainPrecision", "Trainer",
                                        ("accumulate_grad_batches", trainer.accumulate_grad_batches),
                                        ("gradient_clip_val", trainer.gradient_clip_val), trainer.world_size)
