"""optimize()'s first half: decide everything and check everything, changing nothing.

:func:`make_plan` reads the model, the optimizer and the resolved :class:`ipex_train.OptimizeConfig`, raises
(TypeError/ValueError/RuntimeError naming the argument) for anything it cannot do, and returns a frozen plan whose
type says which application runs (:mod:`.apply`): :class:`InferencePlan`, :class:`TrainingPlan`,
:class:`ReoptimizePlan` (a model and optimizer optimize() returned, passed again with inplace=True) or
:class:`ShardedPlan` (an FSDP2 model). Only the application modifies the model and the optimizer, so an error leaves
both as they were.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..base import ops as _ops
from ..base.choices import LOW_PRECISION
from ..base.options import check_model_and_optimizer
from ..config import OptimizeConfig
from ..optim import state_formats
from ..precision import channels_last, model_checks, record
from ..training import step_in_backward
from ..training.optimizer import TrainingOptimizer, has_fused_step, user_class

_log = logging.getLogger("ipex_train")


@dataclass(frozen=True)
class Switches:
    """The optimization switches optimize() runs with: each explicit option, else its level's default."""

    conv_bn_folding: bool
    linear_bn_folding: bool
    replace_dropout_with_identity: bool
    split_master_weight_for_bf16: bool
    fuse_update_step: bool
    auto_channels_last: bool


@dataclass(frozen=True, eq=False)
class Plan:
    """What optimize() will do: the resolved ``config``, its ``switches``, ``inplace``, and ``policy`` (the bf16
    compute policy to attach, "native"/"emulated", or None)."""

    config: OptimizeConfig
    switches: Switches
    inplace: bool
    policy: str | None

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The low-precision dtype weights go to, or None (fp32)."""
        return self.config.dtype if self.config.dtype in LOW_PRECISION else None


@dataclass(frozen=True, eq=False)
class InferencePlan(Plan):
    """An eval model without optimizer: inference passes, weights cast (no fp32 truth), returns the model."""

    sample_input: Any = None


@dataclass(frozen=True, eq=False)
class TrainingPlan(Plan):
    """A model and its optimizer: low precision with fp32 truth (unless the model was optimized before), and the
    training optimizer, fused when ``fuse``, stepping on ``sycl`` (a SYCL step backend) or the CPU (None)."""

    fuse: bool = False
    sycl: Any = None


@dataclass(frozen=True, eq=False)
class ReoptimizePlan(Plan):
    """A model and the optimizer optimize() returned for it, again with inplace=True: returned as they are (the
    optimizer_state_dtype and step_in_backward options still apply)."""


@dataclass(frozen=True, eq=False)
class ShardedPlan(Plan):
    """An FSDP2 model: nothing converted (its fp32 shards are the truth), the training optimizer steps shards."""

    fuse: bool = False


def resolve_switches(config: OptimizeConfig) -> Switches:
    """The switches of ``config``: explicit fields over the level's defaults (O1: all on, O0: all off)."""
    on = config.level == "O1"  # O0 changes nothing but the dtype handling
    given = {f.name: getattr(config, f.name) for f in fields(Switches)}
    cl = channels_last.resolve(given.pop("auto_channels_last"), on)
    return Switches(auto_channels_last=cl, **{k: on if v is None else v for k, v in given.items()})


def will_fuse(optimizer: torch.optim.Optimizer, switches: Switches) -> bool:
    """Whether the returned optimizer steps with a fused kernel: the switch is on and one exists for its class."""
    return switches.fuse_update_step and has_fused_step(user_class(optimizer))


def _policy(config: OptimizeConfig) -> str | None:
    """The bf16 compute policy to attach (bf16 only); a bad bf16_compute raises here for any dtype."""
    if config.dtype != torch.bfloat16 and config.bf16_compute is None:
        return None
    from .. import compute_policy

    policy = compute_policy.resolve(config.bf16_compute)
    return policy if config.dtype == torch.bfloat16 else None


def _check_foreign_parameters(model: nn.Module, optimizer, masters) -> None:
    in_model = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in in_model for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(f"optimize(): {foreign} parameter(s) of the optimizer are not parameters of the model; "
                         "build the optimizer from model.parameters() (or add extra tensors with "
                         "add_param_group after optimize())")
    if isinstance(optimizer, TrainingOptimizer) and optimizer._ipex_masters is not masters:
        raise ValueError("optimize(): this optimizer was returned by optimize() for another model; pass the "
                         "model it was returned with, or a fresh optimizer")


def _check_devices(model: nn.Module) -> None:
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    if len(devices) > 1:
        raise ValueError(f"optimize(): the model's tensors are on several devices ({sorted(map(str, devices))}); "
                         "move the whole model to the CPU first (model.to('cpu'))")
    if devices and devices != {torch.device("cpu")}:
        raise ValueError(f"optimize(): the model is on {devices.pop()}; ipex_train trains on the CPU, call "
                         "model.to('cpu') first")


def check_call(model, optimizer, dtype) -> None:
    """The checks of every optimize() call: types, the train/eval mode against the optimizer, one CPU device, a
    dtype that agrees with an earlier optimize(), and an optimizer over this model's parameters."""
    check_model_and_optimizer(model, optimizer, "optimize()")
    if model.training and optimizer is None:
        raise ValueError("optimize(): the model is in training mode but no optimizer was given; pass the optimizer "
                         "(optimize(model, optimizer, ...)) to train, or call model.eval() first for inference")
    if not model.training and optimizer is not None:
        raise ValueError("optimize(): an optimizer was given but the model is in eval mode; call model.train() "
                         "before optimize() to train, or leave the optimizer out for inference")
    _check_devices(model)
    masters = record.masters(model)
    if masters is not None and dtype is not None and (dtype if dtype in LOW_PRECISION else None) != masters.dtype:
        raise ValueError(f"optimize(): the model was already optimized with dtype={masters.dtype}; pass that dtype "
                         "(or None), or start again from the fp32 model")
    if optimizer is not None:
        _check_foreign_parameters(model, optimizer, masters)


def check_training_options(optimizer, config: OptimizeConfig, switches: Switches) -> None:
    """optimizer_state_dtype (the option and every group's own key) and step_in_backward against ``optimizer``."""
    wanted = {config.optimizer_state_dtype} | {
        state_formats.parse(g.get(state_formats.GROUP_KEY), f"optimize(): param group {i} key "
                                                              f"{state_formats.GROUP_KEY!r}")
        for i, g in enumerate(optimizer.param_groups)}
    if wanted != {None} and not will_fuse(optimizer, switches):
        raise ValueError(f"optimize(): optimizer_state_dtype={config.optimizer_state_dtype!r} (or a param group's "
                         "state_dtype) needs the fused step: SGD, Adam, AdamW, Adagrad, Lamb or Lars with "
                         "fuse_update_step left on")
    if config.step_in_backward:
        cls = user_class(optimizer)
        step_in_backward.check_supported(cls, has_fused_step(cls))


def _sycl_backend(config: OptimizeConfig, switches: Switches):
    """The SYCL step backend (ipex_train.xpu.SyclBackend) when config.sycl asks for it, else None; raises when it
    is asked for but unavailable, or with auto_channels_last=True."""
    if not config.sycl:
        return None
    from .. import xpu  # only here: `import ipex_train` must not load the SYCL runtime

    try:
        backend = xpu.step_backend(config.sycl)
    except RuntimeError as e:
        raise RuntimeError(f"optimize(): {e}") from None
    if backend is not None and switches.auto_channels_last:
        if config.auto_channels_last:
            raise ValueError("optimize(): auto_channels_last=True cannot apply with the SYCL step (sycl=True or "
                             "IPEX_TRAIN_SYCL=1), which keeps every parameter contiguous in USM shared memory; pass "
                             "auto_channels_last=False or None")
        _log.info("ipex_train.optimize(sycl=True): conv weights stay contiguous (the SYCL step takes contiguous "
                  "tensors), not channels-last")
    return backend


def _sharded_plan(model, optimizer, config: OptimizeConfig, inplace: bool) -> ShardedPlan:
    masters = record.masters(model)
    distributed.check_sharded(model, optimizer, config.dtype, inplace, config,
                              optimized_before=masters is not None and bool(masters.aux))
    check_call(model, optimizer, None)
    switches = resolve_switches(config)
    policy = _policy(config)
    check_training_options(optimizer, config, switches)
    return ShardedPlan(config, switches, inplace, policy, fuse=will_fuse(optimizer, switches))


def make_plan(model, optimizer, config: OptimizeConfig, inplace: bool, sample_input=None) -> Plan:
    """Check the call and decide what optimize() does (see the module docstring); raises before any change."""
    _ops.kernel_variant()  # raises for an IPEX_TRAIN_KERNEL the kernels cannot honour
    if isinstance(model, nn.Module) and distributed.is_sharded(model):
        return _sharded_plan(model, optimizer, config, inplace)
    check_call(model, optimizer, config.dtype)
    fresh = record.masters(model) is None
    model_checks.check_model(model, config.dtype if fresh else None,
                             training_copy=optimizer is not None and not inplace)
    if optimizer is not None:
        model_checks.check_optimizer(optimizer)
    switches = resolve_switches(config)
    policy = _policy(config)
    sycl = _sycl_backend(config, switches) if optimizer is not None else None
    if fresh:
        model_checks.check_aliases(model, config.dtype, copies=not inplace or sycl is not None)
    if optimizer is None:
        if config.step_in_backward:
            raise ValueError("optimize(): step_in_backward=True needs an optimizer (it is a training option)")
        from ..inference import jit

        jit.onednn_fusion_enabled()  # raises for a bad IPEX_TRAIN_ONEDNN_FUSION
        return InferencePlan(config, switches, inplace, policy, sample_input=sample_input)
    check_training_options(optimizer, config, switches)
    if isinstance(optimizer, TrainingOptimizer) and inplace:
        return ReoptimizePlan(config, switches, inplace, policy)
    return TrainingPlan(config, switches, inplace, policy, fuse=will_fuse(optimizer, switches), sycl=sycl)
