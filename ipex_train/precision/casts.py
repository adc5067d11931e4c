"""The forward hooks that give each converted module inputs of its weight dtype (or fp32 under the emulated policy).

A module whose weights went low precision casts its floating-point inputs to that dtype (forward pre-hook), so fp32
batches and fp32 normalisation outputs feed it; one keeping an fp32 weight matrix casts low-precision inputs up to
fp32. Under the emulated bf16 policy activations stay fp32: converted modules take inputs as they come and return
fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .selection import LOW_PRECISION


def _cast_floats(value, to: torch.dtype, only: tuple[torch.dtype, ...] | None, memo: dict):
    """``value`` with its floating-point tensors (those of a dtype in ``only``, or any) cast to ``to``, through
    tuples (an RNN's ``(h, c)``, a PackedSequence). One tensor passed twice stays one tensor (MultiheadAttention
    takes the self-attention path only when query is key is value)."""
    if isinstance(value, Tensor):
        if not value.is_floating_point() or value.dtype == to or (only is not None and value.dtype not in only):
            return value
        if id(value) not in memo:
            memo[id(value)] = value.to(to)
        return memo[id(value)]
    if isinstance(value, tuple):
        items = [_cast_floats(v, to, only, memo) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _cast_call(args: tuple, kwargs: dict, to: torch.dtype, only: tuple[torch.dtype, ...] | None):
    memo: dict = {}
    return (tuple(_cast_floats(a, to, only, memo) for a in args),
            {k: _cast_floats(v, to, only, memo) for k, v in kwargs.items()})


def cast_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a module whose parameters are all low precision: cast its floating-point inputs
    (positional and keyword: an attention mask too) to its weights' dtype.

    The user's data loader yields fp32 batches, and an fp32 normalisation layer may sit before a bf16 layer.
    """
    dtype = next(p.dtype for p in module._parameters.values() if p is not None)
    return _cast_call(args, kwargs, dtype, None)


def upcast_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a module that keeps an fp32 matrix parameter: cast bf16/fp16 inputs to fp32, so that
    a matmul of its own on that parameter (``x @ self.weight`` in a custom module) does not meet a low-precision
    activation. Its output is then fp32; the next converted module casts it back down."""
    return _cast_call(args, kwargs, torch.float32, LOW_PRECISION)


def upcast_outputs(module: nn.Module, args: tuple, output):
    """Forward hook of a module whose parameters are all low precision, under the emulated bf16 compute policy:
    its low-precision outputs (an embedding lookup, an op on bf16 inputs) come back as fp32, so that activations
    stay fp32 between modules and only the weights are cast."""
    return _cast_floats(output, torch.float32, LOW_PRECISION, {})


_HOOKS = (cast_inputs, upcast_inputs, upcast_outputs)


def register_input_casts(model: nn.Module, fp32_activations: bool = False) -> None:
    """Make every module of ``model`` that owns parameters take inputs of any floating dtype.

    * Parameters all bf16/fp16 (converted modules, or a low-precision model): inputs cast to that dtype; with
      ``fp32_activations`` (the emulated bf16 compute policy, which computes bf16 weights against fp32 inputs in
      fp32) inputs are left as they are (except for RNN modules, which refuse them) and low-precision outputs are
      cast up to fp32 instead.
    * An fp32 matrix parameter (two or more dimensions above 1: a bare weight a matmul may use): low-precision
      inputs cast up to fp32, and the module runs as the user wrote it, in fp32.
    * Otherwise (normalisation layers, layer scales, class tokens: fp32 vectors, whatever their view) nothing:
      they act elementwise, where torch takes mixed dtypes (its CPU norms take bf16 inputs with fp32 weights and
      return bf16).

    Nothing when no parameter of ``model`` is low precision. Idempotent: a module already holding one of these
    hooks is left alone.
    """
    if not any(p.dtype in LOW_PRECISION for p in model.parameters()):
        return
    for m in model.modules():
        params = [p for p in m._parameters.values() if p is not None and p.is_floating_point()]
        hooks = list(m._forward_pre_hooks.values()) + list(m._forward_hooks.values())
        if not params or any(h in _HOOKS for h in hooks):
            continue
        if all(p.dtype == params[0].dtype for p in params) and params[0].dtype in LOW_PRECISION:
            if not fp32_activations or isinstance(m, nn.RNNBase):  # nn.RNN* refuse inputs not in their dtype
                m.register_forward_pre_hook(cast_inputs, with_kwargs=True)
            if fp32_activations:
                m.register_forward_hook(upcast_outputs)
        elif any(p.dtype == torch.float32 and sum(d > 1 for d in p.shape) >= 2 for p in params):
            m.register_forward_pre_hook(upcast_inputs, with_kwargs=True)
