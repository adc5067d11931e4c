"""The fused steps as typed functions, one per optimizer, in the form of torch.optim's functional API
(``torch.optim.adam.adam`` and friends): lists of tensors in, updated in place, hyper-parameters as keywords.

    from ipex_train.optim import functional as F
    F.adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
           eps=1e-8)

Each call is one C++ kernel call for the whole list. Tensors are dense CPU tensors; parameters are float32 or
float64, or 16-bit with ``aux`` holding each one's fp32 truth (an int16 residual for a split bf16 parameter, or a
float32 master for a bf16/fp16 one; None for a float32/float64 parameter). Optimizer state is float32 (float64
for float64 parameters) and shaped like its parameter, or reduced-byte state (bf16 shaped like the parameter, or the
packed int8/uint8 tensors of ipex_train/optim/state_formats.py; ``state_key`` then keys the stochastic rounding of
bf16 state: the same key and inputs give the same bits). As in torch's functional forms, ``state_steps`` (one-element
float tensors) count the steps taken and are incremented here. Errors name the argument (ValueError/TypeError).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..base.ops import ops
from .fused import state_dtype

__all__ = ["adagrad", "adam", "lamb", "lars", "sgd"]


def _aux(aux: Sequence[Tensor | None] | None) -> list[Tensor | None]:
    # The op's "no aux" form is an empty list (what torch.compile can functionalize).
    if aux is None or all(a is None for a in aux):
        return []
    return list(aux)


def _bump(state_steps: Sequence[Tensor]) -> list[Tensor]:
    steps = list(state_steps)
    if steps:
        torch._foreach_add_(steps, 1)
    return steps


def sgd(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: list[Tensor | None], *,
        aux: Sequence[Tensor | None] | None = None, lr: float, momentum: float = 0.0, dampening: float = 0.0,
        weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False, state_key: int = 0) -> None:
    """SGD as ``torch.optim.SGD``. With ``momentum`` != 0, ``momentum_buffers`` holds one buffer per parameter;
    a None entry is a buffer created now (torch starts it from the grad) and is replaced in the list by the new
    tensor. Without momentum the list is ignored."""
    params = list(params)
    fresh: list[bool] = []
    buffers: list[Tensor] = []
    if momentum != 0:
        if len(momentum_buffers) != len(params):
            raise ValueError(f"sgd: got {len(params)} params but {len(momentum_buffers)} momentum_buffers")
        for i, p in enumerate(params):
            fresh.append(momentum_buffers[i] is None)
            if fresh[-1]:
                momentum_buffers[i] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
        buffers = list(momentum_buffers)
    ops.sgd_step(params, _aux(aux), list(grads), buffers, fresh, float(lr), float(momentum),
                 float(dampening), float(weight_decay), bool(nesterov), bool(maximize), int(state_key))


def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor], state_steps: Sequence[Tensor], *,
         aux: Sequence[Tensor | None] | None = None, lr: float, beta1: float, beta2: float, weight_decay: float,
         eps: float, amsgrad: bool = False, maximize: bool = False, decoupled_weight_decay: bool = False,
         state_key: int = 0) -> None:
    """Adam as ``torch.optim.Adam``, or AdamW with ``decoupled_weight_decay=True``. ``max_exp_avg_sqs`` is used
    with ``amsgrad`` only (pass an empty list otherwise)."""
    ops.adam_step(list(params), _aux(aux), list(grads), list(exp_avgs), list(exp_avg_sqs),
                  list(max_exp_avg_sqs), _bump(state_steps), float(lr), float(beta1), float(beta2),
                  float(weight_decay), float(eps), bool(amsgrad), bool(maximize), bool(decoupled_weight_decay),
                  int(state_key))


def adagrad(params: Sequence[Tensor], grads: Sequence[Tensor], state_sums: Sequence[Tensor],
            state_steps: Sequence[Tensor], *, aux: Sequence[Tensor | None] | None = None, lr: float,
            lr_decay: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-10, maximize: bool = False,
            state_key: int = 0) -> None:
    """Adagrad as ``torch.optim.Adagrad`` (``state_sums`` start at its ``initial_accumulator_value``)."""
    ops.adagrad_step(list(params), _aux(aux), list(grads), list(state_sums), _bump(state_steps),
                     float(lr), float(lr_decay), float(weight_decay), float(eps), bool(maximize), int(state_key))


def lamb(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], state_steps: Sequence[Tensor], *, aux: Sequence[Tensor | None] | None = None,
         lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, bias_correction: bool = True,
         state_key: int = 0) -> None:
    """Lamb as :class:`ipex_train.optim.Lamb`: Adam's moments with a per-tensor trust ratio."""
    ops.lamb_step(list(params), _aux(aux), list(grads), list(exp_avgs), list(exp_avg_sqs),
                  _bump(state_steps), float(lr), float(beta1), float(beta2), float(weight_decay), float(eps),
                  bool(bias_correction), int(state_key))


def lars(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor], *,
         aux: Sequence[Tensor | None] | None = None, lr: float, momentum: float, weight_decay: float, eeta: float,
         epsilon: float, state_key: int = 0) -> None:
    """Lars as :class:`ipex_train.optim.Lars`: momentum SGD with a per-tensor local learning rate (buffers start
    at zero)."""
    ops.lars_step(list(params), _aux(aux), list(grads), list(momentum_buffers), float(lr),
                  float(momentum), float(weight_decay), float(eeta), float(epsilon), int(state_key))
