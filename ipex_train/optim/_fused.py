"""One fused update of one parameter group: gather grads and state (created as torch.optim creates it), then
make one call into the C++ kernels for the whole group.

Used by :class:`Lamb`, :class:`Lars` and by the optimizer that :func:`ipex_train.optimize` returns for
torch.optim.SGD / Adam / AdamW / Adagrad. ``aux`` holds, per parameter, None (fp32/fp64 storage), the int16
residual of a split bf16 parameter, or the fp32 master of a bf16/fp16 parameter; optimizer state is always fp32
(fp64 for fp64 parameters).
"""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._ops import check_step_args, ops

KINDS = ("sgd", "adam", "adagrad", "lamb", "lars")
# The state lists each kind hands to the kernels, in kernel order: (key of state_lists, argument name of the op).
STATE_ARGS = {
    "sgd": (("momentum_buffer", "momentum_buffers"),),
    "adam": (("exp_avg", "exp_avgs"), ("exp_avg_sq", "exp_avg_sqs"), ("max_exp_avg_sq", "max_exp_avg_sqs")),
    "adagrad": (("sum", "state_sums"),),
    "lamb": (("exp_avg", "exp_avgs"), ("exp_avg_sq", "exp_avg_sqs")),
    "lars": (("momentum_buffer", "momentum_buffers"),),
}


def state_dtype(p: Tensor) -> torch.dtype:
    """dtype of the optimizer state of parameter ``p``."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _zeros(p: Tensor) -> Tensor:
    return torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)


def _bump_steps(states: list[dict]) -> list[Tensor]:
    for st in states:
        if "step" not in st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
    steps = [st["step"] for st in states]
    torch._foreach_add_(steps, 1)
    return steps


def _lazy(st: dict, key: str, make) -> Tensor:
    if st.get(key) is None:
        st[key] = make()
    return st[key]


def state_lists(kind: str, group: dict[str, Any], state: MutableMapping[Tensor, dict],
                params: Sequence[Tensor]) -> dict[str, list]:
    """The per-parameter state of ``params`` as lists keyed by torch.optim's state names, creating what is missing
    (zeros, or ``initial_accumulator_value`` for Adagrad) and incrementing the ``step`` counters for this step.

    For SGD, ``fresh`` marks momentum buffers created now (torch starts those from the grad itself).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    states = [state[p] for p in params]

    def get(key, make=_zeros):
        return [_lazy(st, key, lambda p=p: make(p)) for p, st in zip(params, states)]

    if kind == "sgd":
        if float(group["momentum"]) == 0:
            return {"momentum_buffer": [], "fresh": []}
        fresh = [st.get("momentum_buffer") is None for st in states]
        return {"momentum_buffer": get("momentum_buffer"), "fresh": fresh}
    if kind == "adam":
        lists = {"exp_avg": get("exp_avg"), "exp_avg_sq": get("exp_avg_sq"), "max_exp_avg_sq": []}
        if group.get("amsgrad", False):
            lists["max_exp_avg_sq"] = get("max_exp_avg_sq")
        lists["step"] = _bump_steps(states)
        return lists
    if kind == "adagrad":
        init = float(group.get("initial_accumulator_value", 0.0))
        return {"sum": get("sum", lambda p: _zeros(p).fill_(init)), "step": _bump_steps(states)}
    if kind == "lamb":
        return {"exp_avg": get("exp_avg"), "exp_avg_sq": get("exp_avg_sq"), "step": _bump_steps(states)}
    return {"momentum_buffer": get("momentum_buffer")}


def fused_step(kind: str, group: dict[str, Any], state: MutableMapping[Tensor, dict], params: Sequence[Tensor],
               aux: Sequence[Tensor | None], grads: Sequence[Tensor]) -> None:
    """Apply one step of optimizer ``kind`` to ``params`` (those of ``group`` that have grads) in one kernel call.

    ``state`` is the optimizer's per-parameter state mapping; missing entries are created here. Hyper-parameters
    are read from ``group`` with torch.optim's key names.
    """
    params, aux, grads = list(params), list(aux), list(grads)
    if not params:
        return
    if all(a is None for a in aux):
        aux = []  # the op's "no aux" form, which torch.compile can functionalize (None inside the list it cannot)
    elif torch.compiler.is_compiling() and any(a is None for a in aux):
        # Mixed storage under torch.compile: one call for the plain params, one for the rest (same math).
        plain = [i for i, a in enumerate(aux) if a is None]
        rest = [i for i, a in enumerate(aux) if a is not None]
        for idx in (plain, rest):
            fused_step(kind, group, state, [params[i] for i in idx], [aux[i] for i in idx], [grads[i] for i in idx])
        return
    s = state_lists(kind, group, state, params)
    check_step_args(f"ipex_train::{kind}_step", params, aux, grads,
                    {arg: s[key] for key, arg in STATE_ARGS[kind] if s.get(key)}, s.get("step"))
    lr = float(group["lr"])
    maximize = bool(group.get("maximize", False))
    if kind == "sgd":
        ops.sgd_step(params, aux, grads, s["momentum_buffer"], s["fresh"], lr, float(group["momentum"]),
                     float(group["dampening"]), float(group["weight_decay"]), bool(group["nesterov"]), maximize)
    elif kind == "adam":
        beta1, beta2 = (float(b) for b in group["betas"])
        ops.adam_step(params, aux, grads, s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"], s["step"], lr, beta1,
                      beta2, float(group["weight_decay"]), float(group["eps"]), bool(group.get("amsgrad", False)),
                      maximize, bool(group.get("decoupled_weight_decay", False)))
    elif kind == "adagrad":
        ops.adagrad_step(params, aux, grads, s["sum"], s["step"], lr, float(group["lr_decay"]),
                         float(group["weight_decay"]), float(group["eps"]), maximize)
    elif kind == "lamb":
        beta1, beta2 = (float(b) for b in group["betas"])
        ops.lamb_step(params, aux, grads, s["exp_avg"], s["exp_avg_sq"], s["step"], lr, beta1, beta2,
                      float(group["weight_decay"]), float(group["eps"]), bool(group["bias_correction"]))
    else:
        ops.lars_step(params, aux, grads, s["momentum_buffer"], lr, float(group["momentum"]),
                      float(group["weight_decay"]), float(group["eeta"]), float(group["epsilon"]))
