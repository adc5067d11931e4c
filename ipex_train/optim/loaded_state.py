"""Optimizer state checked against what a fused optimizer keeps, when a checkpoint is loaded and before a step: state
is never made up and never the wrong shape.

torch.optim creates a parameter's state at its first step and needs all of it afterwards: an entry holding part of
it (``exp_avg`` without ``exp_avg_sq``, moments without ``step``) makes torch's step raise KeyError. Creating the
missing part as zeros would step on from a made-up value (a zero Adam second moment at step 20 moves the weight by
up to lr / eps per element). For the optimizers of :mod:`.registry`:

* an empty entry, or none, is a fresh parameter: its first step creates the state as torch does;
* a non-empty entry holds every key the optimizer keeps for its group: ``step`` when it counts steps, and each
  state tensor the group uses (``max_exp_avg_sq`` only with amsgrad), except SGD's ``momentum_buffer``, which
  torch itself starts from the grad when it is missing;
* ``step`` is a finite number >= 0 (an int, a float or a one-element tensor);
* each state tensor is a floating-point tensor shaped like its parameter (at the step, reduced-byte state as the
  step stores it, :mod:`.state_formats`, too).

:func:`check_checkpoint` checks a whole checkpoint before ``load_state_dict`` changes anything; :func:`check_entries`
checks the entries of one fused call before it creates or counts anything (state edited by hand, or a group switched
to amsgrad after its first step), :func:`unconvertible` is its error for a tensor that cannot be re-encoded. Each
names the parameter and the key (ValueError).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .registry import FusedOptimizer


def required_keys(entry: FusedOptimizer, group: Mapping[str, Any]) -> frozenset[str]:
    """The keys a started (non-empty) state entry of a parameter in ``group`` must hold."""
    keys = {"step"} if entry.counts_steps else set()
    if not entry.fresh_flags:  # SGD starts a missing momentum buffer from the grad, as torch does
        keys.update(s.key for s in entry.state if s.present(group))
    return frozenset(keys)


def _step_problem(value: Any) -> str | None:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
        value = value.item()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"a {type(value).__name__}"
    if not (math.isfinite(value) and value >= 0):
        return str(value)
    return None


def _tensor_problem(value: Any, p: Tensor) -> str | None:
    if not isinstance(value, Tensor):
        return f"a {type(value).__name__}, not a tensor"
    if not value.is_floating_point():
        return f"a {value.dtype} tensor"
    if value.shape != p.shape:
        return f"of shape {tuple(value.shape)}"
    return None


def check_checkpoint(entry: FusedOptimizer, state_dict: Any, param_groups: Sequence[Mapping[str, Any]],
                     where: str) -> None:
    """Raise ValueError unless every entry of ``state_dict["state"]`` that maps to one of ``param_groups``'
    parameters is fresh (empty) or complete and well-formed for ``entry`` (see the module docstring). A checkpoint
    whose groups do not match this optimizer's is left to torch's own check."""
    try:
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        sizes = [len(g["params"]) for g in saved_groups]
    except (TypeError, KeyError):
        return
    if sizes != [len(g["params"]) for g in param_groups]:
        return
    where_saved = {}
    for group, saved in zip(param_groups, saved_groups):
        for p, saved_id in zip(group["params"], saved["params"]):
            where_saved[saved_id] = (p, saved)
    for saved_id, st in saved_state.items():
        if saved_id in where_saved:
            p, saved = where_saved[saved_id]
            _check_saved_entry(entry, saved, p, st, f"{where}: state[{saved_id!r}]")


def _check_saved_entry(entry: FusedOptimizer, saved_group: Mapping[str, Any], p: Tensor, st: Any, name: str) -> None:
    """One parameter's saved state: fresh (empty), or holding every key the step needs, well-formed."""
    if not isinstance(st, Mapping):
        raise TypeError(f"{name} is a {type(st).__name__}; expected a dict of the parameter's state")
    if not st:
        return
    required = required_keys(entry, saved_group)
    missing = sorted(required - st.keys())
    if missing:
        raise ValueError(f"{name} holds {sorted(st)} but not {', '.join(map(repr, missing))}: "
                         f"the optimizer keeps {sorted(required)} for every parameter that has stepped, and "
                         "making up the missing part would step from a wrong value (torch.optim raises "
                         "KeyError). Load a complete checkpoint, or drop the entry to start this "
                         "parameter's state afresh")
    if "step" in st:
        problem = _step_problem(st["step"])
        if problem is not None:
            raise ValueError(f"{name}['step'] is {problem}; expected the number of steps taken, a finite number "
                             ">= 0 (an int, a float or a one-element tensor)")
    for key in required - {"step"} | {s.key for s in entry.state if st.get(s.key) is not None}:
        problem = _tensor_problem(st[key], p)
        if problem is not None:
            raise ValueError(f"{name}[{key!r}] is {problem}; expected a floating-point tensor shaped like its "
                             f"parameter, {tuple(p.shape)}")


def check_entries(entry: FusedOptimizer, group: Mapping[str, Any], params: Sequence[Tensor],
                  states: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError when the state of one of ``params`` (of ``group``) is started but lacks a key the step
    needs; before anything is created or counted. (Shapes are checked where the state is re-encoded,
    :func:`unconvertible`, and by the kernel argument checks.)"""
    required = required_keys(entry, group)
    for i, st in enumerate(states):
        if st and not st.keys() >= required:
            missing = sorted(required - st.keys())
            raise ValueError(f"{_who(group, i, params[i], entry)} holds {sorted(st)} but not "
                             f"{', '.join(map(repr, missing))}: the step would have to make it up (torch.optim "
                             "raises KeyError). Load a complete state, or clear this parameter's entry "
                             "(optimizer.state[p].clear()) to start it afresh")


def unconvertible(entry: FusedOptimizer, group: Mapping[str, Any], i: int, p: Tensor, key: str, t: Tensor,
                  fmt: Any) -> ValueError:
    """The error for state tensor ``t`` (``key``) of ``params[i]`` that cannot be stored in format ``fmt``."""
    return ValueError(f"{_who(group, i, p, entry)}: {key!r} ({t.dtype}, shape {tuple(t.shape)}) cannot be stored as "
                      f"{'fp32' if fmt is None else fmt.name.lower()} state of a parameter of shape {tuple(p.shape)}; "
                      "expected a tensor shaped like the parameter")


def _who(group: Mapping[str, Any], i: int, p: Tensor, entry: FusedOptimizer) -> str:
    # The parameter's index in its param group when the step has one (the optimizers), else in the call's params.
    index = next((f"parameter {j} of its param group" for j, q in enumerate(group.get("params", ())) if q is p),
                 f"params[{i}]")
    return f"fused {entry.name} step: the state of {index}"
