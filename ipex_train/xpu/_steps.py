"""The fused optimizer steps and bf16 split/combine on a SYCL queue, with the same arguments, storage layouts and
state as :func:`ipex_train.optim._fused.fused_step` and the ``torch.ops.ipex_train`` ops."""
from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..optim import _fused, _layouts, _registry
from ..optim._layouts import Layout
from ..optim._registry import FusedOptimizer
from . import _device, _runtime, _usm


def _layout_of(op: str, i: int, p: Tensor, aux: Tensor | None) -> Layout:
    layout = _layouts.find(p.dtype, None if aux is None else aux.dtype)
    if layout is not None:
        return layout
    if aux is None:
        raise TypeError(f"{op}: params[{i}] has dtype {p.dtype}; without aux[{i}] the kernel takes float32 or "
                        "float64 params (a bfloat16 param needs an int16 residual or a float32 master in aux, a "
                        "float16 param a float32 master)")
    raise TypeError(f"{op}: params[{i}] ({p.dtype}) with aux[{i}] ({aux.dtype}) is not a storage layout; expected a "
                    "bfloat16 param with an int16 residual (split), or a bfloat16/float16 param with a float32 master")


def _check_dense(op: str, t: Any, name: str, device_type: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} is a {t.layout} tensor; the SYCL kernels take dense tensors only")
    if t.device.type != device_type:
        raise ValueError(f"{op}: {name} is on {t.device} but params[0] is on {device_type}; all tensors of a step must "
                         "be USM-backed CPU tensors (ipex_train.xpu.to_usm) or all torch XPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous; the SYCL kernels take contiguous tensors (to_usm and "
                         "usm_tensor make contiguous ones)")


def _check_same_shape(op: str, t: Tensor, name: str, p: Tensor, pname: str) -> None:
    if t.shape != p.shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but {pname} has shape {tuple(p.shape)}")


def _slots(op: str, params: list, aux: list, grads: list, states: dict[str, list]) -> list[tuple]:
    """Check one group (raising with the argument's name) and return the per-parameter tuples the runtime takes:
    (layout, numel, param, aux, grad, state0, state1, state2) with addresses, 0 where absent."""
    n = len(params)
    if len(grads) != n:
        raise ValueError(f"{op}: got {n} params but {len(grads)} grads")
    if len(aux) != n:
        raise ValueError(f"{op}: got {n} params but {len(aux)} aux entries (pass None for a parameter without a "
                         "residual or master)")
    for name, lst in states.items():
        if len(lst) != n:
            raise ValueError(f"{op}: got {n} params but {len(lst)} {name}")
    device_type = params[0].device.type if n and isinstance(params[0], Tensor) else "cpu"
    out = []
    for i in range(n):
        p, a, g = params[i], aux[i], grads[i]
        _check_dense(op, p, f"params[{i}]", device_type)
        if a is not None:
            _check_dense(op, a, f"aux[{i}]", device_type)
            _check_same_shape(op, a, f"aux[{i}]", p, f"params[{i}]")
        layout = _layout_of(op, i, p, a)
        if isinstance(g, Tensor) and g.is_sparse:
            raise ValueError(f"{op}: grads[{i}] is sparse; the fused kernels take dense grads only")
        _check_dense(op, g, f"grads[{i}]", device_type)
        if g.dtype != layout.grad:
            raise TypeError(f"{op}: grads[{i}] has dtype {g.dtype} but params[{i}] is stored as {layout.description} "
                            f"and needs {layout.grad} grads")
        _check_same_shape(op, g, f"grads[{i}]", p, f"params[{i}]")
        ptrs = []
        for name, lst in states.items():
            t = lst[i]
            _check_dense(op, t, f"{name}[{i}]", device_type)
            if t.dtype != layout.state:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; optimizer state for a {layout.description} "
                                f"parameter is {layout.state}")
            _check_same_shape(op, t, f"{name}[{i}]", p, f"params[{i}]")
            ptrs.append(t.data_ptr())
        ptrs += [0] * (3 - len(ptrs))
        out.append((layout.code, p.numel(), p.data_ptr(), 0 if a is None else a.data_ptr(), g.data_ptr(), *ptrs))
    return out


def _on_torch_xpu(params: list) -> bool:
    return isinstance(params[0], Tensor) and params[0].device.type == "xpu"


def _to_usm_state(entry: FusedOptimizer, state: MutableMapping[Tensor, dict], params: list, lists: dict[str, list],
                  queue) -> None:
    # entry_lists creates missing state with torch's allocator (and load_state_dict restores it there): move such
    # tensors into USM, in the optimizer's state too, so later steps find them in place.
    for spec in entry.state:
        for i, t in enumerate(lists[spec.key]):
            if t.numel() and not (t.is_contiguous() and _usm.is_usm(t, queue)):
                moved = _usm.to_usm(t, queue)
                state[params[i]][spec.key] = moved
                lists[spec.key][i] = moved


def fused_step(kind: str, group: dict[str, Any], state: MutableMapping[Tensor, dict], params: Sequence[Tensor],
               aux: Sequence[Tensor | None], grads: Sequence[Tensor], queue=None) -> None:
    """One step of optimizer ``kind`` (a name of :mod:`ipex_train.optim._registry`: "sgd", "adam", "adagrad",
    "lamb", "lars") for one parameter group, run by the SYCL kernels on ``queue`` (a dpctl.SyclQueue; default
    :func:`default_queue`).

    Arguments mirror :func:`ipex_train.optim._fused.fused_step`: hyper-parameters come from ``group`` with
    torch.optim's key names, ``state`` is the optimizer's per-parameter state (missing entries are created as the
    CPU step creates them and kept in USM shared memory), ``aux`` is per parameter None, an int16 residual (split
    bf16) or a float32 master. ``params``, ``aux`` and ``grads`` must be contiguous USM-backed CPU tensors of the
    queue's context (:func:`to_usm`, :func:`module_to_usm`, :func:`usm_grads`); other memory is refused with
    ValueError. Torch XPU tensors (a torch build with XPU) run on torch's current SYCL queue instead.
    """
    op = f"ipex_train.xpu.fused_step({kind!r})"
    entry = _registry.get(kind)
    params, aux, grads = list(params), list(aux), list(grads)
    if not params:
        return
    lists = _fused.entry_lists(entry, group, state, params)
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
    # The runtime takes the fresh flags and step counts as plain values (the host reads them anyway).
    extra = [list(lists["fresh"])] if entry.fresh_flags else []
    if entry.counts_steps:
        extra.append([float(t) for t in lists["step"]])
    getattr(rt, entry.name)(slots, *extra, *entry.kernel_args(group))


def split_bf16(src: Tensor, queue=None) -> tuple[Tensor, Tensor]:
    """:func:`ipex_train._ops.split_bf16` on the SYCL queue: the bf16 top and int16 residual of the contiguous
    float32 USM tensor ``src``, as new USM tensors of its shape."""
    op = "ipex_train.xpu.split_bf16"
    _check_dense(op, src, "src", "cpu")
    if src.dtype != torch.float32:
        raise TypeError(f"{op}: src has dtype {src.dtype}; expected float32")
    top = _usm.usm_tensor(src.shape, torch.bfloat16, queue)
    res = _usm.usm_tensor(src.shape, torch.int16, queue)
    _runtime.runtime(_device.default_queue() if queue is None else queue).split_bf16(
        src.data_ptr(), top.data_ptr(), res.data_ptr(), src.numel())
    return top, res


def combine_bf16(top: Tensor, residual: Tensor, queue=None) -> Tensor:
    """:func:`ipex_train._ops.combine_bf16` on the SYCL queue: the exact float32 tensor from a contiguous bf16 top
    and int16 residual in USM, as a new USM tensor."""
    op = "ipex_train.xpu.combine_bf16"
    _check_dense(op, top, "top", "cpu")
    _check_dense(op, residual, "residual", "cpu")
    if top.dtype != torch.bfloat16:
        raise TypeError(f"{op}: top has dtype {top.dtype}; expected bfloat16")
    if residual.dtype != torch.int16:
        raise TypeError(f"{op}: residual has dtype {residual.dtype}; expected int16")
    _check_same_shape(op, residual, "residual", top, "top")
    out = _usm.usm_tensor(top.shape, torch.float32, queue)
    _runtime.runtime(_device.default_queue() if queue is None else queue).combine_bf16(
        top.data_ptr(), residual.data_ptr(), out.data_ptr(), top.numel())
    return out
