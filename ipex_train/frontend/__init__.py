"""``optimize()``: validate everything, resolve the level and flags, then convert the model and the optimizer.

Order of passes (training): copy (inplace=False) -> low-precision conversion with fp32 truth, channels-last ->
model hooks -> bf16 compute policy -> optimizer. Nothing is modified before every argument has been checked, so an
error leaves the user's model and optimizer as they were.

Mixed dtypes in one model: the weights of matmul modules (``_master_weights.MATMUL_MODULES``: Linear, Conv*,
Embedding*, RNNs, MultiheadAttention, transformers' Conv1D, ...) go low precision, normalisation layers (and every
other parameter) stay fp32. Each converted module casts its floating-point inputs to its weight dtype (forward
pre-hook), so fp32 batches and fp32 normalisation outputs feed it; a module keeping an fp32 weight matrix casts
bf16 inputs up to fp32; torch's CPU LayerNorm/BatchNorm/GroupNorm take bf16 inputs with fp32 weights and return
bf16. The model output is therefore bf16 when its last layer is converted; ``torch.autocast("cpu",
dtype=torch.bfloat16)`` around the forward works as well. Under the emulated bf16 compute policy (CPUs without bf16
units) activations stay fp32 instead: converted modules take inputs as they come and return fp32, and only their
weights are cast, inside each fp32 matmul/convolution.
With dtype=bfloat16 the bf16 compute policy (:mod:`ipex_train.compute_policy`) is attached to the model: on
CPUs without bf16 units bf16 matmuls/convolutions are computed in fp32 from the bf16 operands.

SYCL step (``sycl=True`` or ``IPEX_TRAIN_SYCL=1``, training only): after conversion the model's parameters, the
residuals/masters and the optimizer state are moved into SYCL USM shared memory (still torch CPU tensors, so the
model runs as before) and every fused optimizer step runs on :func:`ipex_train.xpu.default_queue`.

Distributed: call optimize() first, then wrap the returned model in DistributedDataParallel (DDP builds its
gradient buckets from the parameter dtypes). All ranks must start from the same fp32 weights (same seed or the
same checkpoint): DDP's initial broadcast syncs the bf16 tops, not the residuals. FSDP2 is the other way round:
fully_shard first, then the optimizer, then optimize(..., inplace=True) (:mod:`ipex_train.distributed`).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .. import config as _config
from .. import distributed
from ..base import ops as _ops
from ..config import OptimizeConfig
from ..optim import state_formats
from ..precision import channels_last as _channels_last
from ..precision import model_checks as _model_checks
from ..precision import record as _record
from ..precision.master_weights import (
    LOW_PRECISION,
    MasterWeights,
    convertible_parameters,
    register_input_casts,
    set_memory_format,
)
from ..reports import summary as _summary
from ..training import step_in_backward as _step_in_backward
from ..training.optimizer import TrainingOptimizer, has_fused_step, training_optimizer, user_class

_log = logging.getLogger("ipex_train")

@dataclass(frozen=True)
class Flags:
    """The resolved optimization switches (explicit arguments over the level's defaults)."""

    conv_bn_folding: bool
    linear_bn_folding: bool
    replace_dropout_with_identity: bool
    split_master_weight_for_bf16: bool
    fuse_update_step: bool
    auto_channels_last: bool


def _resolve_flags(config: OptimizeConfig) -> Flags:
    on = config.level == "O1"  # O0 changes nothing but the dtype handling
    given = {name: getattr(config, name) for name in Flags.__dataclass_fields__}
    cl = _channels_last.resolve(given.pop("auto_channels_last"), on)
    return Flags(auto_channels_last=cl, **{k: on if v is None else v for k, v in given.items()})


def _validate(model, optimizer, dtype) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize(): model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimize(): optimizer must be a torch.optim.Optimizer or None, got "
                        f"{type(optimizer).__name__}")
    if model.training and optimizer is None:
        raise ValueError("optimize(): the model is in training mode but no optimizer was given; pass the optimizer "
                         "(optimize(model, optimizer, ...)) to train, or call model.eval() first for inference")
    if not model.training and optimizer is not None:
        raise ValueError("optimize(): an optimizer was given but the model is in eval mode; call model.train() "
                         "before optimize() to train, or leave the optimizer out for inference")
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    if len(devices) > 1:
        raise ValueError(f"optimize(): the model's tensors are on several devices ({sorted(map(str, devices))}); "
                         "move the whole model to the CPU first (model.to('cpu'))")
    if devices and devices != {torch.device("cpu")}:
        raise ValueError(f"optimize(): the model is on {devices.pop()}; ipex_train trains on the CPU, call "
                         "model.to('cpu') first")
    masters = _record.masters(model)
    if masters is not None and dtype is not None and (dtype if dtype in LOW_PRECISION else None) != masters.dtype:
        raise ValueError(f"optimize(): the model was already optimized with dtype={masters.dtype}; pass that dtype "
                         "(or None), or start again from the fp32 model")
    if optimizer is not None:
        in_model = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in in_model for g in optimizer.param_groups for p in g["params"])
        if foreign:
            raise ValueError(f"optimize(): {foreign} parameter(s) of the optimizer are not parameters of the model; "
                             "build the optimizer from model.parameters() (or add extra tensors with "
                             "add_param_group after optimize())")
        if isinstance(optimizer, TrainingOptimizer) and optimizer._ipex_masters is not masters:
            raise ValueError("optimize(): this optimizer was returned by optimize() for another model; pass the "
                             "model it was returned with, or a fresh optimizer")


def _check_release(optimizer) -> None:
    if optimizer is None:
        raise ValueError("optimize(): step_in_backward=True needs an optimizer (it is a training option)")
    cls = user_class(optimizer)
    _step_in_backward.check_supported(cls, has_fused_step(cls))


def _step_backend(sycl: bool | None, training: bool):
    """The step backend of the returned optimizer (ipex_train.xpu.SyclBackend), or None for the CPU step. Raises,
    in training, when SYCL is asked for (``sycl`` resolved to True: the argument, else IPEX_TRAIN_SYCL) but
    unavailable."""
    if not training or not sycl:
        return None
    from .. import xpu  # only here: `import ipex_train` must not load the SYCL runtime

    try:
        return xpu.step_backend(sycl)
    except RuntimeError as e:
        raise RuntimeError(f"optimize(): {e}") from None


def _check_state_dtype(state_dtype, optimizer, flags: Flags) -> None:
    """Raise unless the optimizer state can be kept in ``state_dtype`` (and every group's own choice is valid)."""
    wanted = {state_dtype} | {state_formats.parse(g.get(state_formats.GROUP_KEY),
                                                   f"optimize(): param group {i} key {state_formats.GROUP_KEY!r}")
                              for i, g in enumerate(optimizer.param_groups)}
    if wanted == {None}:
        return
    name = f"optimize(): optimizer_state_dtype={state_dtype!r} (or a param group's state_dtype)"
    if not flags.fuse_update_step or not has_fused_step(user_class(optimizer)):
        raise ValueError(f"{name} needs the fused step: SGD, Adam, AdamW, Adagrad, Lamb or Lars with "
                         "fuse_update_step left on")


def _set_state_dtype(optimizer: TrainingOptimizer, state_dtype) -> None:
    if state_dtype is None:
        return
    for group in optimizer.param_groups:
        group.setdefault(state_formats.GROUP_KEY, state_dtype)
    optimizer.defaults.setdefault(state_formats.GROUP_KEY, state_dtype)  # for add_param_group


def _convert(model: nn.Module, dtype: torch.dtype | None, flags: Flags, keep_fp32_truth: bool,
             frozen_low_precision: bool = False) -> MasterWeights:
    """Low precision (with fp32 truth when ``keep_fp32_truth``, except for frozen parameters with
    ``frozen_low_precision``) and channels-last, in place on ``model``."""
    low = dtype if dtype in LOW_PRECISION else None
    masters = MasterWeights(low, flags.split_master_weight_for_bf16, frozen_low_precision)
    formats = _channels_last.memory_formats(model) if flags.auto_channels_last else {}
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


def _register_casts_and_policy(model: nn.Module, dtype: torch.dtype | None, bf16_compute: str | None) -> None:
    """The converted model's dtype hooks, then (bf16) its compute policy. Under the emulated policy activations
    stay fp32 and only the bf16 weights are cast (inside each fp32 matmul/conv): casting activations to bf16 and
    back around every layer would only add work where bf16 is computed in fp32 anyway."""
    policy = None
    if dtype == torch.bfloat16:
        from .. import compute_policy

        policy = compute_policy.resolve(bf16_compute)
    register_input_casts(model, fp32_activations=policy == "emulated")
    if policy is not None:
        compute_policy.attach(model, policy)


def _inference_passes(model: nn.Module, flags: Flags, sample_input) -> None:
    """The inference-only passes of :mod:`ipex_train.inference` that ``flags`` ask for, on the fp32 eval model."""
    from ..inference import fold_conv_bn, fold_linear_bn, replace_dropout

    if flags.conv_bn_folding:
        fold_conv_bn(model, sample_input)
    if flags.linear_bn_folding:
        fold_linear_bn(model, sample_input)
    if flags.replace_dropout_with_identity:
        replace_dropout(model)


def _optimize_sharded(model: nn.Module, optimizer, config: OptimizeConfig, inplace: bool):
    """optimize() for a model sharded with FSDP2 (see :mod:`ipex_train.distributed`): checks, then the compute
    policy and the shard-stepping optimizer; the weights stay FSDP2's fp32 shards."""
    masters = _record.masters(model)
    distributed.check_sharded(model, optimizer, config.dtype, inplace, config,
                              optimized_before=masters is not None and bool(masters.aux))
    _validate(model, optimizer, None)
    flags = _resolve_flags(config)
    if config.dtype == torch.bfloat16 or config.bf16_compute is not None:
        from .. import compute_policy

        compute_policy.resolve(config.bf16_compute)  # raises for a bad value before anything changes
    _check_state_dtype(config.optimizer_state_dtype, optimizer, flags)
    if config.step_in_backward:
        _check_release(optimizer)
    optimizer, masters = distributed.prepare_sharded(model, optimizer, config.dtype, config, flags, masters)
    _record.set_masters(model, masters)
    _set_state_dtype(optimizer, config.optimizer_state_dtype)
    if config.step_in_backward is not None:
        optimizer.set_step_in_backward(config.step_in_backward)
    _summary.record(model, optimizer, config.dtype)
    return model, optimizer


def optimize(model, optimizer=None, dtype=None, level=None, inplace=False, conv_bn_folding=None,
             linear_bn_folding=None, replace_dropout_with_identity=None, split_master_weight_for_bf16=None,
             fuse_update_step=None, auto_channels_last=None, sample_input=None, bf16_compute=None, sycl=None, *,
             step_in_backward=None, optimizer_state_dtype=None, frozen_weights=None,
             config: OptimizeConfig | None = None):
    """Prepare ``model`` (and ``optimizer``) for fast CPU training, or ``model`` alone for inference.

    Training (``model.training`` and an optimizer): returns ``(model, optimizer)``; use both in an unchanged
    training loop. Inference (``model.eval()`` and no optimizer): returns the model.

    Every option below from ``dtype`` to ``optimizer_state_dtype`` left None (not given, and not set by
    ``config``) is read from its environment variable ``IPEX_TRAIN_<OPTION>`` (e.g. ``IPEX_TRAIN_DTYPE=bf16``,
    ``IPEX_TRAIN_STEP_IN_BACKWARD=1``; any case, see docs/environment.md) once, when optimize() starts, else takes
    its default: a keyword argument or config field > the environment > the default.

    Args:
        model: the torch.nn.Module, all on the CPU.
        optimizer: a torch.optim.Optimizer over the model's parameters. SGD, Adam, AdamW, Adagrad,
            ipex_train.optim.Lamb/Lars (and subclasses keeping their step) get a fused step, one C++ call per
            param group; other optimizers run their own step on fp32 values.
        dtype: None or torch.float32 (fp32 training), torch.bfloat16 or torch.float16: the weights of Linear,
            Conv*, ConvTranspose*, Embedding, EmbeddingBag, RNN/LSTM/GRU, MultiheadAttention and transformers'
            Conv1D go to that dtype, everything else stays fp32; the exact fp32 value is kept (see
            split_master_weight_for_bf16), and model.state_dict() and optimizer state stay fp32.
        level: "O1" (None: the default, unless IPEX_TRAIN_LEVEL says "O0") turns every optimization on, "O0" only
            the dtype handling; explicit flags win.
        inplace: modify ``model`` and ``optimizer`` (the returned optimizer is a new object sharing the param
            group dicts and state of ``optimizer``; use the returned one). With False (default) ``model`` is deep
            copied and ``model``/``optimizer`` are left untouched; the returned optimizer has its own group dicts,
            so an LR scheduler must be created on it (one created before on ``optimizer`` keeps driving
            ``optimizer``; a warning says so).
        conv_bn_folding, linear_bn_folding, replace_dropout_with_identity: inference passes (ignored in training).
        split_master_weight_for_bf16: keep bf16 weights as bf16 top + int16 residual (True, no extra memory),
            else bf16 weights + fp32 master copies.
        fuse_update_step: use the fused C++ step for supported optimizers.
        auto_channels_last: lay Conv2d/Conv3d weights out channels-last (default: the level, unless
            enable_/disable_auto_channels_last() was called).
        sample_input: a sample batch; used by the inference folding passes to prove Conv/Linear + BN pairs.
        bf16_compute: None/"auto", "native" or "emulated": how bf16 matmuls are computed (see
            ipex_train.compute_policy.resolve; None defers to IPEX_TRAIN_BF16_COMPUTE, then the CPU).
        sycl: training only. True: keep the parameters, their residuals/masters and the optimizer state in SYCL USM
            shared memory (torch CPU tensors viewing it; contiguous, so no channels-last weights) and run every
            fused optimizer step on the dpctl queue of ipex_train.xpu.default_queue() (IPEX_TRAIN_SYCL_DEVICE picks
            the device). Grads not already in USM are copied into USM buffers before each step; give them USM
            storage with ipex_train.xpu.usm_grads() and zero_grad(set_to_none=False) to skip that copy. Optimizers
            without a fused step run their own step on the CPU. Needs dpctl (the ``xpu`` extra). None (default)
            defers to IPEX_TRAIN_SYCL=1; False turns it off.
        step_in_backward: training only. True: step each parameter inside backward as soon as its grad is summed
            (the same fused kernels, one parameter at a time) and free the grad, so the model's grads never exist
            at once; optimizer.step() then steps nothing. One backward per step: no gradient accumulation, no
            clipping (a second backward before step(), grads found at step(), or torch.nn.utils.clip_grad_norm_ /
            clip_grad_value_ on these parameters raise RuntimeError), no DistributedDataParallel.
            optimizer.set_step_in_backward(False) turns it off.
            Refused (ValueError) for torch.optim.LBFGS and for optimizer classes with a step of their own (it may
            read several parameters' grads at once) unless they set ``per_parameter_step = True``; accepted for the
            fused optimizers and torch.optim's per-parameter classes. A backward that raised part way is completed
            by retrying it (docs/bad_inputs.md).
        optimizer_state_dtype: training only. None/torch.float32 (fp32 optimizer state), torch.bfloat16 (bf16 state
            with stochastic rounding) or "int8" (block-wise 8-bit state): sets the ``state_dtype`` key of every
            param group that has none (a group with ``state_dtype=torch.float32`` keeps fp32 state, e.g. for
            embeddings); parameters under 4096 elements keep fp32 state. Needs a fused step, on the CPU or with
            sycl (not with fuse_update_step=False or an optimizer without one). state_dict() still holds fp32 state;
            load_state_dict() re-encodes it in each group's own state_dtype (not the checkpoint's).
        frozen_weights: training only; how parameters with requires_grad=False at this call (a LoRA/peft base
            model) are held. A frozen weight already in bf16/fp16 is kept as it is, without residual or master,
            whatever this says. None/"lossless" (default): a frozen fp32 weight that goes low precision keeps its
            exact fp32 value (bf16 + int16 residual), as trainable ones do. "low_precision": it is held in ``dtype``
            alone (2 bytes instead of 4 with bf16): state_dict() then holds that rounded bf16 value, and stepping
            it later (after setting requires_grad=True) raises RuntimeError. The summary and memory lines count
            frozen parameters separately. On fully_shard (FSDP2) models frozen weights stay fp32 shards (lossless);
            "low_precision" is refused there (docs/distributed.md).
        config: an :class:`ipex_train.OptimizeConfig` holding the options above (dtype through
            optimizer_state_dtype), instead of passing them one by one; a keyword argument given next to it must
            agree with the config's field (ValueError naming both otherwise); fields left None are read from the
            environment.

    Each call logs one line at INFO on the "ipex_train" logger saying what it did (ipex_train.summary(model,
    optimizer) returns it as data). For inference it also turns torch's TorchScript oneDNN Graph fusion switch on,
    so the user's torch.jit.trace + torch.jit.freeze fuse (logged; ipex_train.enable_onednn_fusion(False) opts out).

    Raises TypeError/ValueError for bad arguments or environment values (also an IPEX_TRAIN_KERNEL the kernels
    cannot honour), and RuntimeError when SYCL is asked for but unavailable, before anything is modified. Also
    refused (ValueError): a lazy module not materialised yet, a TorchScript submodule with a low-precision dtype or
    with inplace=False in training, distinct Parameters sharing storage where optimize() would separate them, a
    param group with differentiable=True, and auto_channels_last=True with the SYCL step (which keeps weights
    contiguous).
    """
    shorthand = dict(dtype=dtype, level=level, conv_bn_folding=conv_bn_folding, linear_bn_folding=linear_bn_folding,
                     replace_dropout_with_identity=replace_dropout_with_identity,
                     split_master_weight_for_bf16=split_master_weight_for_bf16, fuse_update_step=fuse_update_step,
                     auto_channels_last=auto_channels_last, bf16_compute=bf16_compute, sycl=sycl,
                     step_in_backward=step_in_backward,
                     optimizer_state_dtype=optimizer_state_dtype, frozen_weights=frozen_weights)
    config = _config.resolve(config, training=optimizer is not None, **shorthand)  # the one read of the environment
    _ops.kernel_variant()  # raises for an IPEX_TRAIN_KERNEL the kernels cannot honour, before anything changes
    dtype, bf16_compute = config.dtype, config.bf16_compute
    if isinstance(model, nn.Module) and distributed.is_sharded(model):
        return _optimize_sharded(model, optimizer, config, inplace)
    _validate(model, optimizer, dtype)
    _model_checks.check_model(model, dtype if _record.masters(model) is None else None,
                              training_copy=optimizer is not None and not inplace)
    if optimizer is not None:
        _model_checks.check_optimizer(optimizer)
    flags = _resolve_flags(config)
    if dtype == torch.bfloat16 or bf16_compute is not None:
        from .. import compute_policy

        compute_policy.resolve(bf16_compute)  # raises for a bad value before anything changes
    backend = _step_backend(config.sycl, training=optimizer is not None)
    if _record.masters(model) is None:
        _model_checks.check_aliases(model, dtype, copies=not inplace or backend is not None)
    if backend is not None and flags.auto_channels_last:
        if config.auto_channels_last:
            raise ValueError("optimize(): auto_channels_last=True cannot apply with the SYCL step (sycl=True or "
                             "IPEX_TRAIN_SYCL=1), which keeps every parameter contiguous in USM shared memory; pass "
                             "auto_channels_last=False or None")
        _log.info("ipex_train.optimize(sycl=True): conv weights stay contiguous (the SYCL step takes contiguous "
                  "tensors), not channels-last")
    if optimizer is not None:
        _check_state_dtype(config.optimizer_state_dtype, optimizer, flags)
    if config.step_in_backward:
        _check_release(optimizer)

    if optimizer is None:
        from ..inference import jit

        jit.onednn_fusion_enabled()  # raises for a bad IPEX_TRAIN_ONEDNN_FUSION before anything changes
        if not inplace:
            model, _ = _record.copy_model(model)
        _inference_passes(model, flags, sample_input)
        _convert(model, dtype, flags, keep_fp32_truth=False)
        _register_casts_and_policy(model, dtype, bf16_compute)
        jit.enable_torchscript_fusion()
        _summary.record(model, None, dtype)
        return model

    already = isinstance(optimizer, TrainingOptimizer)
    if already and inplace:
        _log.info("ipex_train.optimize: model and optimizer are already optimized; returned as they are "
                  "(optimizer_state_dtype and step_in_backward, when given, still apply)")
        _set_state_dtype(optimizer, config.optimizer_state_dtype)
        if config.step_in_backward is not None:
            optimizer.set_step_in_backward(config.step_in_backward)
        return model, optimizer
    if not inplace and any("initial_lr" in g for g in optimizer.param_groups):
        _log.warning("ipex_train.optimize(inplace=False): an LR scheduler created on the original optimizer keeps "
                     "driving the original; create it on the returned optimizer, or use inplace=True")
    param_map = None
    if not inplace:
        originals = [p for g in optimizer.param_groups for p in g["params"]]
        model, memo = _record.copy_model(model)
        param_map = {p: memo[id(p)] for p in originals}
    masters = _record.masters(model)
    if masters is None:
        masters = _convert(model, dtype, flags, keep_fp32_truth=True,
                           frozen_low_precision=config.frozen_weights == "low_precision")
        for p in model.parameters():
            masters.adopt(p)
        masters.register_hooks(model)
        _register_casts_and_policy(model, dtype, bf16_compute)
        _record.set_masters(model, masters)
        if "transformers" in sys.modules:  # only then can the model be one of its PreTrainedModels
            from ..integrations.transformers import keep_fp32_checkpoints

            keep_fp32_checkpoints(model)
        if "peft" in sys.modules:  # only then can the model hold peft tuners
            from ..integrations.peft import keep_adapter_storage

            keep_adapter_storage(model, masters)
    if backend is not None:
        backend.place_params(masters, model.parameters())
    cls = user_class(optimizer)
    fuse = flags.fuse_update_step and has_fused_step(cls)
    if flags.fuse_update_step and not fuse:
        _log.info("ipex_train.optimize: %s has no fused step; it runs its own step on fp32 values of the "
                  "low-precision parameters (slower than SGD/Adam/AdamW/Adagrad/Lamb/Lars)", cls.__name__)
    if backend is not None and not fuse:
        _log.info("ipex_train.optimize(sycl=True): without a fused step the optimizer steps on the CPU; the "
                  "parameters still live in USM shared memory")
    optimizer = training_optimizer(optimizer, masters, fuse, param_map, backend)
    distributed.guard(model, optimizer)
    _set_state_dtype(optimizer, config.optimizer_state_dtype)
    if config.step_in_backward:
        optimizer.set_step_in_backward(True)
    _summary.record(model, optimizer, dtype)
    return model, optimizer
