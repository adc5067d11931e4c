"""One fused update of one parameter group: gather grads and state (created as torch.optim creates it), then
make one call into the C++ kernels for the whole group.

Used by :class:`Lamb`, :class:`Lars`, :mod:`ipex_train.optim.functional` and the optimizer that
:func:`ipex_train.optimize` returns; what each optimizer keeps and passes is its entry in :mod:`.registry`.
``aux`` holds, per parameter, None (fp32/fp64 storage), the int16 residual of a split bf16 parameter, or the fp32
master of a bf16/fp16 parameter; optimizer state is fp32 (fp64 for fp64 parameters) unless the group's
``state_dtype`` asks for reduced-byte state (:mod:`.state_formats`).
"""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..base.ops import ops, optimizer_names
from . import loaded_state, registry, state_formats
from .checks import check_step_args
from .registry import FusedOptimizer


def check_against_kernels() -> None:
    """Raise ImportError unless the registry and the C++ kernels describe the same optimizers and arguments."""
    # The registry and the C++ list (kernels_cpu/src/optimizers.h) must name the same optimizers, and each entry's
    # lists and scalars must be its op's arguments in order: a new optimizer added on one side only fails here.
    if set(optimizer_names()) != set(registry.NAMES):
        raise ImportError(f"ipex_train: the C++ kernels have optimizers {optimizer_names()} but the registry "
                          f"(ipex_train/optim/registry.py) has {registry.NAMES}; rebuild the extension")
    for o in registry.OPTIMIZERS:
        expected = ["params", "aux", "grads", *(s.arg for s in o.state), *(["fresh_buffers"] * o.fresh_flags),
                    *(["state_steps"] * o.counts_steps), *(h.arg for h in o.hyperparameters), "state_key"]
        schema = [a.name for a in kernel(o).default._schema.arguments]
        if schema != expected:
            raise ImportError(f"ipex_train: {o.op_name} takes {schema}; its registry entry describes {expected}")


def kernel(entry: FusedOptimizer):
    """The CPU op (``torch.ops.ipex_train.<name>_step``) of registry entry ``entry``."""
    return getattr(ops, f"{entry.name}_step")


def state_dtype(p: Tensor) -> torch.dtype:
    """dtype of the optimizer state of parameter ``p``."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _state_tensor(p: Tensor, fill: float) -> Tensor:
    t = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
    return t.fill_(fill) if fill else t


def _bump_steps(states: list[dict]) -> list[Tensor]:
    for st in states:
        if "step" not in st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
    steps = [st["step"] for st in states]
    torch._foreach_add_(steps, 1)
    return steps


def state_lists(entry: FusedOptimizer, group: dict[str, Any], state: MutableMapping[Tensor, dict],
                params: Sequence[Tensor]) -> dict[str, list]:
    """The per-parameter state of ``params`` for registry entry ``entry``, as lists keyed by torch.optim's state
    names, creating what is missing (zeros, or ``initial_accumulator_value`` for Adagrad) and incrementing the
    ``step`` counters for this step.

    For SGD, ``fresh`` marks momentum buffers created now (torch starts those from the grad itself).
    """
    states = [state[p] for p in params]
    loaded_state.check_entries(entry, group, params, states)  # before anything is created or counted
    lists: dict[str, list] = {"created": [st for st in states if not st]}
    for spec in entry.state:
        if not spec.present(group):
            lists[spec.key] = []
            continue
        if entry.fresh_flags:
            lists["fresh"] = [st.get(spec.key) is None for st in states]
        fill = float(group.get(spec.fill, 0.0)) if spec.fill else 0.0
        for i, (p, st) in enumerate(zip(params, states)):
            fmt = state_formats.wanted(group, p)
            if st.get(spec.key) is None:
                fresh_zeros = fmt is not None and not fill
                st[spec.key] = state_formats.zeros(p, fmt, spec.signed) if fresh_zeros else _state_tensor(p, fill)
            # The group's state format (reduced-byte state, state_formats): created, loaded or switched.
            try:
                st[spec.key] = state_formats.convert(st[spec.key], p, fmt, spec.signed)
            except RuntimeError as e:  # a tensor that cannot be re-encoded for p (set by hand, of the wrong shape)
                undo_lists(lists)
                raise loaded_state.unconvertible(entry, group, i, p, spec.key, st[spec.key], fmt) from e
        lists[spec.key] = [st[spec.key] for st in states]
    if entry.fresh_flags and "fresh" not in lists:
        lists["fresh"] = []
    if entry.counts_steps:
        lists["step"] = _bump_steps(states)
    return lists


def undo_lists(lists: dict[str, list]) -> None:
    """Undo what :func:`state_lists` changed, for a step that does not run (its arguments were refused): the step
    counters go back and the entries it created are emptied again."""
    if "step" in lists:
        torch._foreach_sub_(lists["step"], 1)
    for st in lists["created"]:
        st.clear()


def store_state_formats(entry: FusedOptimizer, param_groups: list[dict[str, Any]],
                        state: MutableMapping[Tensor, dict]) -> None:
    """Re-encode the existing state of the optimizer of registry entry ``entry`` in each group's ``state_dtype``
    (after a load: the checkpoint holds fp32)."""
    for group in param_groups:
        for p in group["params"]:
            st = state.get(p)
            for spec in entry.state if st else ():
                if isinstance(st.get(spec.key), Tensor):
                    st[spec.key] = state_formats.convert(st[spec.key], p, state_formats.wanted(group, p),
                                                          spec.signed)


def kernel_lists(entry: FusedOptimizer, lists: dict[str, list]) -> list[list]:
    """The list arguments after params, aux and grads, in kernel order, from :func:`state_lists`' result."""
    out = [lists[s.key] for s in entry.state]
    if entry.fresh_flags:
        out.append(lists["fresh"])
    if entry.counts_steps:
        out.append(lists["step"])
    return out


def fused_step(entry: FusedOptimizer, group: dict[str, Any], state: MutableMapping[Tensor, dict],
               params: Sequence[Tensor], aux: Sequence[Tensor | None], grads: Sequence[Tensor]) -> None:
    """Apply one step of the optimizer of registry entry ``entry`` to ``params`` (those of ``group`` that have
    grads) in one kernel call.

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
            fused_step(entry, group, state, [params[i] for i in idx], [aux[i] for i in idx], [grads[i] for i in idx])
        return
    found = state_lists(entry, group, state, params)
    try:
        check_step_args(entry.op_name, params, aux, grads,
                        {s.arg: found[s.key] for s in entry.state if found[s.key]}, found.get("step"))
    except (TypeError, ValueError):
        undo_lists(found)  # a refused call counts no step and creates no state
        raise
    kernel(entry)(params, aux, grads, *kernel_lists(entry, found), *entry.kernel_args(group),
                                 state_formats.call_key(group))
