"""The fused optimizer steps and bf16 split/combine on a SYCL queue, with the same arguments, storage layouts and
state as :func:`ipex_train.optim.fused.fused_step` and the ``torch.ops.ipex_train`` ops."""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..optim import fused, registry, state_formats
from ..optim.checks import check_dense, check_same_shape, check_step_args
from ..optim.registry import FusedOptimizer
from . import _device, _runtime, _usm

_USM_RULE = "the SYCL steps take USM-backed CPU tensors (ipex_train.xpu.to_usm)"


def _slots(op: str, params: list, aux: list, grads: list, states: dict[str, list]) -> list[tuple]:
    """Check one group (raising with the argument's name) and return the per-parameter tuples the runtime takes:
    (layout, numel, param, aux, grad, state0, state1, state2) with addresses, 0 where absent, then the formats of
    the three states (:data:`ipex_train.optim.state_formats.CODECS`, 0 for fp32/fp64)."""
    device_type = params[0].device.type if params and isinstance(params[0], Tensor) else "cpu"
    rule = (f"params[0] is on {device_type}; all tensors of a step must be USM-backed CPU tensors "
            "(ipex_train.xpu.to_usm) or all torch XPU tensors")
    layouts = check_step_args(op, params, aux, grads, states, device_type=device_type, device_rule=rule,
                              contiguous=True)
    out = []
    for i, layout in enumerate(layouts):
        ptrs = [lst[i].data_ptr() for lst in states.values()]
        ptrs += [0] * (3 - len(ptrs))
        codecs = [state_formats.CODECS.get(lst[i].dtype, 0) for lst in states.values()]
        codecs += [0] * (3 - len(codecs))
        a = aux[i] if aux else None
        out.append((layout, params[i].numel(), params[i].data_ptr(), 0 if a is None else a.data_ptr(),
                    grads[i].data_ptr(), *ptrs, tuple(codecs)))
    return out


def _on_torch_xpu(params: list) -> bool:
    return isinstance(params[0], Tensor) and params[0].device.type == "xpu"


def _to_usm_state(entry: FusedOptimizer, state: MutableMapping[Tensor, dict], params: list, lists: dict[str, list],
                  queue) -> None:
    # state_lists creates missing state with torch's allocator (and load_state_dict restores it there): move such
    # tensors into USM, in the optimizer's state too, so later steps find them in place.
    for spec in entry.state:
        for i, t in enumerate(lists[spec.key]):
            if t.numel() and not (t.is_contiguous() and _usm.is_usm(t, queue)):
                moved = _usm.to_usm(t, queue)
                state[params[i]][spec.key] = moved
                lists[spec.key][i] = moved


def fused_step(kind: str | FusedOptimizer, group: dict[str, Any], state: MutableMapping[Tensor, dict],
               params: Sequence[Tensor], aux: Sequence[Tensor | None], grads: Sequence[Tensor], queue=None) -> None:
    """One step of optimizer ``kind`` (a name of :mod:`ipex_train.optim.registry`: "sgd", "adam", "adagrad",
    "lamb", "lars", or its registry entry) for one parameter group, run by the SYCL kernels on ``queue`` (a
    dpctl.SyclQueue; default :func:`default_queue`).

    Arguments mirror :func:`ipex_train.optim.fused.fused_step`: hyper-parameters come from ``group`` with
    torch.optim's key names, ``state`` is the optimizer's per-parameter state (missing entries are created as the
    CPU step creates them and kept in USM shared memory; the group's ``state_dtype`` picks their format and the
    bits are the CPU step's), ``aux`` is per parameter None, an int16 residual (split bf16) or a float32 master.
    ``params``, ``aux`` and ``grads`` must be contiguous USM-backed CPU tensors of the queue's context
    (:func:`to_usm`, :func:`module_to_usm`, :func:`usm_grads`); other memory is refused with ValueError. Torch XPU
    tensors (a torch build with XPU) run on torch's current SYCL queue instead.
    """
    entry = kind if isinstance(kind, FusedOptimizer) else registry.get(kind)
    op = f"ipex_train.xpu.fused_step({entry.name!r})"
    params, aux, grads = list(params), list(aux), list(grads)
    if not params:
        return
    if _on_torch_xpu(params) and state_formats.parse(group.get(state_formats.GROUP_KEY),
                                                      f"param group key {state_formats.GROUP_KEY!r}") is not None:
        raise RuntimeError(f"{op}: param group key {state_formats.GROUP_KEY!r} is "
                           f"{group[state_formats.GROUP_KEY]!r}, but reduced-byte state is not implemented for torch "
                           "XPU tensors (it runs on USM-backed CPU tensors and on the CPU step); use fp32 state")
    lists = fused.state_lists(entry, group, state, params)
    try:
        if _on_torch_xpu(params):
            if queue is not None:
                raise ValueError(f"{op}: params are torch XPU tensors, which run on torch's own SYCL queue; "
                                 "pass queue=None")
            rt = _runtime.runtime_for_torch_xpu(params[0].device)
        else:
            queue = _device.default_queue() if queue is None else queue
            rt = _runtime.runtime(queue)
            _to_usm_state(entry, state, params, lists, queue)
        slots = _slots(op, params, aux, grads, {s.arg: lists[s.key] for s in entry.state if lists[s.key]})
    except (TypeError, ValueError):
        fused.undo_lists(lists)  # a refused call counts no step and creates no state
        raise
    # The runtime takes the fresh flags and step counts as plain values (the host reads them anyway).
    extra = [list(lists["fresh"])] if entry.fresh_flags else []
    if entry.counts_steps:
        extra.append([float(t) for t in lists["step"]])
    getattr(rt, entry.name)(slots, *extra, *entry.kernel_args(group), state_formats.call_key(group))


def split_bf16(src: Tensor, queue=None) -> tuple[Tensor, Tensor]:
    """:func:`ipex_train.base.ops.split_bf16` on the SYCL queue: the bf16 top and int16 residual of the contiguous
    float32 USM tensor ``src``, as new USM tensors of its shape."""
    op = "ipex_train.xpu.split_bf16"
    check_dense(op, src, "src", device_rule=_USM_RULE, contiguous=True)
    if src.dtype != torch.float32:
        raise TypeError(f"{op}: src has dtype {src.dtype}; expected float32")
    top = _usm.usm_tensor(src.shape, torch.bfloat16, queue)
    res = _usm.usm_tensor(src.shape, torch.int16, queue)
    _runtime.runtime(_device.default_queue() if queue is None else queue).split_bf16(
        src.data_ptr(), top.data_ptr(), res.data_ptr(), src.numel())
    return top, res


def combine_bf16(top: Tensor, residual: Tensor, queue=None) -> Tensor:
    """:func:`ipex_train.base.ops.combine_bf16` on the SYCL queue: the exact float32 tensor from a contiguous bf16 top
    and int16 residual in USM, as a new USM tensor."""
    op = "ipex_train.xpu.combine_bf16"
    check_dense(op, top, "top", device_rule=_USM_RULE, contiguous=True)
    check_dense(op, residual, "residual", device_rule=_USM_RULE, contiguous=True)
    if top.dtype != torch.bfloat16:
        raise TypeError(f"{op}: top has dtype {top.dtype}; expected bfloat16")
    if residual.dtype != torch.int16:
        raise TypeError(f"{op}: residual has dtype {residual.dtype}; expected int16")
    check_same_shape(op, residual, "residual", top, "top")
    out = _usm.usm_tensor(top.shape, torch.float32, queue)
    _runtime.runtime(_device.default_queue() if queue is None else queue).combine_bf16(
        top.data_ptr(), residual.data_ptr(), out.data_ptr(), top.numel())
    return out
