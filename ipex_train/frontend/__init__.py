"""``optimize()``: a plan, then its application.

:func:`.plan.make_plan` checks every argument and decides everything (a frozen plan object) before anything
changes, so an error leaves the user's model and optimizer as they were; :func:`.apply.apply` carries the plan out
(one application per plan type: inference, training, re-optimize, FSDP2) and ends with one shared finish.

Mixed dtypes in one model: the weights of matmul modules (``precision.selection.MATMUL_MODULES``: Linear, Conv*,
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

from ..config import OptimizeConfig
from ..config import resolve as resolve_config
from .apply import apply
from .plan import make_plan

__all__ = ["optimize"]


def optimize(model, optimizer=None, dtype=None, level=None, inplace=False, conv_bn_folding=None,
             linear_bn_folding=None, replace_dropout_with_identity=None, split_master_weight_for_bf16=None,
             fuse_update_step=None, auto_channels_last=None, sample_input=None, bf16_compute=None, sycl=None, *,
             step_in_backward=None, optimizer_state_dtype=None, frozen_weights=None, nonfinite_grads=None,
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
        nonfinite_grads: training only; what a step whose gradients hold NaN or Inf does. None/"skip" (default):
            nothing is stepped (no weight, no optimizer state changes), the step is counted
            (summary().nonfinite_skipped_steps) and the first one is logged at WARNING with the parameter's name;
            with step_in_backward the same per parameter (the others stay stepped). "raise": RuntimeError naming
            the parameter, nothing stepped. "off": no check (it reads every gradient once per step:
            docs/bad_inputs.md has its cost).
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
                     optimizer_state_dtype=optimizer_state_dtype, frozen_weights=frozen_weights,
                     nonfinite_grads=nonfinite_grads)
    config = resolve_config(config, training=optimizer is not None, **shorthand)  # the one read of the environment
    plan = make_plan(model, optimizer, config, inplace=inplace, sample_input=sample_input)
    return apply(plan, model, optimizer)
