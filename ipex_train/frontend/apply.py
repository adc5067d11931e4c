"""optimize()'s second half: carry out a plan (:mod:`.plan`), one application per plan type, then one finish.

Order of passes (training): copy (inplace=False) -> low-precision conversion with fp32 truth, channels-last ->
model hooks -> bf16 compute policy -> the libraries' hooks (transformers, peft) -> optimizer. Every check ran in
:func:`.plan.make_plan`, so nothing here raises for a bad argument.
"""
from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from .. import distributed
from ..base.choices import LOW_PRECISION
from ..optim import state_formats
from ..precision import channels_last, record
from ..precision.casts import register_input_casts
from ..precision.master_weights import MasterWeights, set_memory_format
from ..precision.selection import convertible_parameters
from ..reports.memory import memory_report
from ..reports.summary import summary
from ..training.optimizer import set_nonfinite_guard, training_optimizer, user_class
from .plan import InferencePlan, Plan, ReoptimizePlan, ShardedPlan, TrainingPlan

_log = logging.getLogger("ipex_train")


def convert(model: nn.Module, plan: Plan, keep_fp32_truth: bool) -> MasterWeights:
    """Low precision (with fp32 truth when ``keep_fp32_truth``, except for frozen parameters with
    frozen_weights="low_precision") and channels-last, in place on ``model``."""
    low = plan.low_dtype
    masters = MasterWeights(low, plan.switches.split_master_weight_for_bf16,
                            plan.config.frozen_weights == "low_precision")
    formats = channels_last.memory_formats(model) if plan.switches.auto_channels_last else {}
    with torch.no_grad():
        for p in convertible_parameters(model) if low is not None else []:
            fmt = formats.get(p, torch.contiguous_format)
            if keep_fp32_truth:
                masters.convert(p, low, fmt)
            else:
                p.data = p.data.to(low).contiguous(memory_format=fmt)
        for p, fmt in formats.items():
            if p.dtype not in LOW_PRECISION:
                set_memory_format(p, fmt)
    return masters


def attach_hooks(model: nn.Module, plan: Plan) -> None:
    """The converted model's dtype hooks, then (bf16) its compute policy. Under the emulated policy activations
    stay fp32 and only the bf16 weights are cast (inside each fp32 matmul/conv): casting activations to bf16 and
    back around every layer would only add work where bf16 is computed in fp32 anyway."""
    register_input_casts(model, fp32_activations=plan.policy == "emulated")
    if plan.policy is not None:
        from .. import compute_policy

        compute_policy.attach(model, plan.policy)


def _apply_inference(plan: InferencePlan, model: nn.Module, optimizer):
    from ..inference import fold_conv_bn, fold_linear_bn, jit, replace_dropout

    if not plan.inplace:
        model, _ = record.copy_model(model)
    if plan.switches.conv_bn_folding:
        fold_conv_bn(model, plan.sample_input)
    if plan.switches.linear_bn_folding:
        fold_linear_bn(model, plan.sample_input)
    if plan.switches.replace_dropout_with_identity:
        replace_dropout(model)
    convert(model, plan, keep_fp32_truth=False)
    attach_hooks(model, plan)
    jit.enable_torchscript_fusion()
    return model, None


def _apply_reoptimize(plan: ReoptimizePlan, model: nn.Module, optimizer):
    _log.info("ipex_train.optimize: model and optimizer are already optimized; returned as they are "
              "(optimizer_state_dtype and step_in_backward, when given, still apply)")
    return model, optimizer


def _convert_for_training(model: nn.Module, plan: TrainingPlan) -> MasterWeights:
    masters = convert(model, plan, keep_fp32_truth=True)
    for p in model.parameters():
        masters.adopt(p)
    masters.register_hooks(model)
    attach_hooks(model, plan)
    record.set_masters(model, masters)
    if "transformers" in sys.modules or "peft" in sys.modules:  # only then can the model be one of theirs
        from ..precision import libraries

        libraries.keep_fp32_checkpoints(model)
        libraries.keep_adapter_storage(model, masters)
    return masters


def _apply_training(plan: TrainingPlan, model: nn.Module, optimizer):
    if not plan.inplace and any("initial_lr" in g for g in optimizer.param_groups):
        _log.warning("ipex_train.optimize(inplace=False): an LR scheduler created on the original optimizer keeps "
                     "driving the original; create it on the returned optimizer, or use inplace=True")
    param_map = None
    if not plan.inplace:
        originals = [p for g in optimizer.param_groups for p in g["params"]]
        model, memo = record.copy_model(model)
        param_map = {p: memo[id(p)] for p in originals}
    masters = record.masters(model)
    if masters is None:
        masters = _convert_for_training(model, plan)
    if plan.sycl is not None:
        plan.sycl.place_params(masters, model.parameters())
    if plan.switches.fuse_update_step and not plan.fuse:
        _log.info("ipex_train.optimize: %s has no fused step; it runs its own step on fp32 values of the "
                  "low-precision parameters (slower than SGD/Adam/AdamW/Adagrad/Lamb/Lars)",
                  user_class(optimizer).__name__)
    if plan.sycl is not None and not plan.fuse:
        _log.info("ipex_train.optimize(sycl=True): without a fused step the optimizer steps on the CPU; the "
                  "parameters still live in USM shared memory")
    optimizer = training_optimizer(optimizer, masters, plan.fuse, param_map, plan.sycl)
    distributed.guard(model, optimizer)
    return model, optimizer


def _apply_sharded(plan: ShardedPlan, model: nn.Module, optimizer):
    if plan.policy is not None:
        from .. import compute_policy

        compute_policy.attach(model, plan.policy)
    masters = record.masters(model)
    if masters is None:
        masters = MasterWeights(None, False)  # holds nothing: the fp32 shards are the truth
        record.set_masters(model, masters)
    return model, distributed.sharded_optimizer(optimizer, masters, plan.fuse)


_APPLY = {InferencePlan: _apply_inference, ReoptimizePlan: _apply_reoptimize, TrainingPlan: _apply_training,
          ShardedPlan: _apply_sharded}


def finish(plan: Plan, model: nn.Module, optimizer):
    """The last step of every plan: the optimizer options that apply to any training optimizer (state format,
    step_in_backward, the non-finite-gradient guard), the dtype record,
    and the INFO lines (summary; memory in training). Returns what optimize() returns."""
    config = plan.config
    if optimizer is not None:
        if config.optimizer_state_dtype is not None:
            for group in optimizer.param_groups:
                group.setdefault(state_formats.GROUP_KEY, config.optimizer_state_dtype)
            optimizer.defaults.setdefault(state_formats.GROUP_KEY, config.optimizer_state_dtype)  # add_param_group
        if config.step_in_backward is not None:
            optimizer.set_step_in_backward(config.step_in_backward)
        set_nonfinite_guard(optimizer, config.nonfinite_grads, model)
    record.set_dtype(model, plan.low_dtype)
    if _log.isEnabledFor(logging.INFO):
        _log.info("%s", summary(model, optimizer))
        if optimizer is not None:
            _log.info("%s", memory_report(model, optimizer))
    return model if optimizer is None else (model, optimizer)


def apply(plan: Plan, model: nn.Module, optimizer):
    """Carry out ``plan`` on ``model`` and ``optimizer`` (dispatched on the plan's type), then :func:`finish`."""
    model, optimizer = _APPLY[type(plan)](plan, model, optimizer)
    return finish(plan, model, optimizer)
