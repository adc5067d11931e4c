"""HuggingFace ``Trainer`` with :func:`ipex_train.optimize` applied by the Trainer itself.

A drop-in for ``transformers.Trainer`` (re-exported as ``ipex_train.integrations.transformers.Trainer``)::

    from ipex_train.integrations.transformers import Trainer

    args = TrainingArguments("out", bf16=True, use_cpu=True, optim="adamw_torch", lr_scheduler_type="cosine")
    trainer = Trainer(model=model, args=args, train_dataset=data)   # everything else as with transformers.Trainer
    trainer.train()

What changes against ``transformers.Trainer``:

* ``bf16=True`` means ``optimize(dtype=torch.bfloat16)`` of the model and of the optimizer the Trainer creates
  (its own weight-decay parameter groups, ``optim=`` class and hyperparameters; ``optim="adamw_torch"``,
  ``"adamw_torch_fused"``, ``"sgd"`` and ``"adagrad"`` get the fused step, the others run their own step on fp32
  values, with a log line), and no autocast: the Accelerator is created with ``mixed_precision="no"``, since
  autocast on top of the bf16 weights would only add casts. ``bf16=False`` means ``optimize(dtype=float32)`` (the
  fused fp32 step). An optimizer passed in ``optimizers=(optimizer, scheduler)`` is optimized in place, so its
  scheduler keeps driving it.
* The LR scheduler the Trainer creates is created on the returned optimizer, after accelerator.prepare, as stock;
  gradient accumulation, ``max_grad_norm`` clipping, evaluation, ``save_model``, checkpoints and
  ``resume_from_checkpoint`` are the Trainer's own code (checkpoints hold fp32 weights and optimizer state).
* Evaluation or prediction before training converts the model the same way (bf16 weights, fp32 truth kept).
* The other options of optimize() come from ``optimize_config=ipex_train.OptimizeConfig(...)`` (its ``dtype`` left
  None, or equal to what ``bf16`` says), then from the ``IPEX_TRAIN_<OPTION>`` environment variables.

Refused with ValueError when the Trainer is created: ``fp16=True`` (no fp16 autocast or loss scaling on the CPU),
``bf16_full_eval``/``fp16_full_eval`` (``model.to(bf16)`` would drop the fp32 norms and master weights), DeepSpeed,
FSDP, a device other than the CPU, and ``step_in_backward`` with ``gradient_accumulation_steps > 1``,
``max_grad_norm > 0`` or several processes.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

try:
    import transformers
except ImportError as e:  # optional; say what to install instead of a bare ModuleNotFoundError
    raise ImportError("ipex_train.integrations.hf_trainer needs HuggingFace Transformers: pip install transformers"
                      ) from e

from .. import config as _config
from ..config import OptimizeConfig
from ..frontend import optimize
from ..optim import registry
from ._convert import broadcast_fp32_weights, convert_model, refuse_step_in_backward_options

__all__ = ["Trainer", "FUSED_OPTIM"]

_log = logging.getLogger("ipex_train")
# The TrainingArguments.optim names whose optimizer ipex_train steps with a fused kernel.
FUSED_OPTIM = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad")


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose model and optimizer go through :func:`ipex_train.optimize` (see the module
    docstring).

    Args:
        *args, **kwargs: as ``transformers.Trainer``.
        optimize_config: an :class:`ipex_train.OptimizeConfig` with the other options of optimize()
            (``step_in_backward``, ``optimizer_state_dtype``, ``frozen_weights``, ``level`` ...). Its ``dtype``
            must be None or agree with ``TrainingArguments.bf16``; options it leaves None are read from the
            ``IPEX_TRAIN_<OPTION>`` environment variables, as optimize() does.

    Raises TypeError/ValueError naming the argument for settings it cannot serve (module docstring), before the
    model is touched.
    """

    def __init__(self, *args, optimize_config: OptimizeConfig | None = None, **kwargs) -> None:
        if optimize_config is not None and not isinstance(optimize_config, OptimizeConfig):
            raise TypeError(f"Trainer: optimize_config must be an ipex_train.OptimizeConfig or None, got "
                            f"{type(optimize_config).__name__}")
        self._ipex_user_config = optimize_config or OptimizeConfig()
        self._ipex_config: OptimizeConfig | None = None  # resolved in _build_accelerator_args (args known there)
        self._ipex_converted = None  # the model last converted
        super().__init__(*args, **kwargs)

    @property
    def optimize_config(self) -> OptimizeConfig:
        """The configuration optimize() runs with: dtype from ``TrainingArguments.bf16``, the rest from
        ``optimize_config`` and the environment."""
        return self._ipex_config

    def _build_accelerator_args(self, **kwargs):
        # The first hook that sees the resolved TrainingArguments, before the Accelerator exists: validate here, and
        # turn Accelerate's bf16 autocast off (the weights are bf16 themselves).
        self._ipex_config = _resolve(self.args, self._ipex_user_config)
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"
        return out

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The stock optimizer (parameter groups, ``optim=`` class), then ``optimize(model, optimizer,
        inplace=True)``; returns the optimized optimizer (also ``self.optimizer``)."""
        if model is not None and model is not self.model:
            raise ValueError("Trainer.create_optimizer: ipex_train optimizes Trainer.model itself; a wrapped model "
                             "(FSDP, SageMaker) is not supported")
        optimizer = super().create_optimizer(model)
        inner = getattr(optimizer, "optimizer", optimizer)  # an earlier train() left accelerate's wrapper
        optimized = getattr(inner, "_ipex_masters", None) is not None
        if optimized and self._ipex_converted is self.model:
            return optimizer  # optimized by an earlier train() call
        cls = type(optimizer)
        if not optimized and registry.for_class(cls) is None and self._ipex_config.fuse_update_step is not False:
            _log.warning("ipex_train Trainer: optim=%r (%s) has no fused step in ipex_train; it runs its own step on "
                         "fp32 values of the low-precision parameters (fused: %s)",
                         getattr(self.args.optim, "value", self.args.optim),
                         cls.__name__, ", ".join(FUSED_OPTIM))
        was_training = self.model.training  # eval after from_pretrained or evaluate(); train() switches it later
        self.model.train()
        try:
            model, optimizer = optimize(self.model, optimizer, inplace=True, config=self._ipex_config)
        finally:
            self.model.train(was_training)
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            broadcast_fp32_weights(model)  # before DDP wraps it in accelerator.prepare
        self.optimizer = optimizer
        self._ipex_converted = model
        return optimizer

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # Evaluation/prediction before training: convert the model as training would (train() creates the
        # optimizer, and optimizes both, before it wraps the model).
        if not training and self._ipex_converted is not self.model and model is self.model:
            convert_model(self.model, self._ipex_config)
            self._ipex_converted = self.model
        return super()._wrap_model(model, training=training, dataloader=dataloader)


def _resolve(args: transformers.TrainingArguments, user: OptimizeConfig) -> OptimizeConfig:
    """The optimize() configuration of a Trainer with ``args``; ValueError for settings it cannot serve."""
    precision = args.mixed_precision
    if precision == "fp16" or user.dtype == torch.float16:
        raise ValueError("Trainer: TrainingArguments(fp16=True) (or optimize_config.dtype=torch.float16) is not "
                         "supported: ipex_train's Trainer trains on the CPU, where there is no fp16 loss scaling; "
                         "use bf16=True")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if user.dtype not in (None, dtype):
        raise ValueError(f"Trainer: optimize_config.dtype={user.dtype} conflicts with TrainingArguments(bf16="
                         f"{precision == 'bf16'}); bf16 decides the dtype: leave optimize_config.dtype None")
    if args.bf16_full_eval or args.fp16_full_eval:
        raise ValueError("Trainer: TrainingArguments(bf16_full_eval/fp16_full_eval=True) is not supported: "
                         "model.to(dtype) would drop the fp32 norms and master weights; with bf16=True evaluation "
                         "already runs on the bf16 weights")
    if args.deepspeed or args.fsdp:
        raise ValueError("Trainer: DeepSpeed and FSDP keep their own weight copies and optimizer; use "
                         "transformers.Trainer for them (or plain DDP with this Trainer)")
    if args.device.type != "cpu":
        raise ValueError(f"Trainer: TrainingArguments resolve to device {args.device}; ipex_train trains on the CPU: "
                         "pass use_cpu=True")
    config = _config.resolve(dataclasses.replace(user, dtype=dtype))  # the environment for the options left None
    if config.step_in_backward:
        _check_step_in_backward(args)
    return config


def _check_step_in_backward(args: transformers.TrainingArguments) -> None:
    refuse_step_in_backward_options("Trainer", "TrainingArguments",
                                    ("gradient_accumulation_steps", args.gradient_accumulation_steps),
                                    ("max_grad_norm", args.max_grad_norm), args.world_size)
