"""A fused step's arguments checked in Python before any kernel runs (CPU and SYCL alike), against the storage
layouts of :mod:`._layouts`.

Every check names the argument (``grads[1]``) and raises ValueError or TypeError, so a bad call raises a Python
exception even on a build where an exception thrown inside the extension cannot unwind (seen as SIGSEGV on one
machine with torch 2.11).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _layouts, state_formats
from ._layouts import Layout


def _reducible(layout: Layout, t: Tensor, p: Tensor) -> bool:
    return layout.state == torch.float32 and state_formats.fits(t, p)

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


_CPU_RULE = "kernels_cpu takes CPU tensors only"


def check_dense(op: str, t, name: str, device_type: str = "cpu", device_rule: str = _CPU_RULE,
                contiguous: bool = False) -> None:
    """Raise unless ``t`` is a dense tensor on ``device_type`` (``device_rule`` ends the message), and contiguous
    when ``contiguous`` (the SYCL kernels' rule)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} is a {t.layout} tensor; the fused kernels take dense (strided) tensors only")
    if t.device.type != device_type:
        raise ValueError(f"{op}: {name} is on {t.device}; {device_rule}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous; the SYCL kernels take contiguous tensors (to_usm and "
                         "usm_tensor make contiguous ones)")


def check_same_shape(op: str, t: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    """Raise ValueError unless ``t`` has the shape of ``ref``."""
    if t.shape != ref.shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def _plain_cpu_layouts(params: list, aux: list, grads: list, states: dict[str, list]) -> list[int] | None:
    """Each parameter's layout when every tensor is a dense CPU tensor of the right dtype and shape (the usual
    step), else None. Only reads attributes: ~2 us per parameter, a sixth of naming each argument as it goes."""
    strided = torch.strided
    lists = list(states.values())
    layouts = []
    try:
        for i, p in enumerate(params):
            a, g = aux[i] if aux else None, grads[i]
            layout = _layouts.find(p.dtype, None if a is None else a.dtype)
            if (layout is None or p.layout != strided or not p.is_cpu or g.layout != strided or not g.is_cpu
                    or g.dtype != layout.grad or g.shape != p.shape
                    or a is not None and (a.layout != strided or not a.is_cpu or a.shape != p.shape)):
                return None
            for lst in lists:
                t = lst[i]
                if t.layout != strided or not t.is_cpu:
                    return None
                if (t.shape != p.shape) if t.dtype == layout.state else not _reducible(layout, t, p):
                    return None
            layouts.append(layout.code)
    except (AttributeError, IndexError):  # not a tensor, or a short list: the named checks say which
        return None
    return layouts


def check_step_args(op: str, params: list, aux: list, grads: list, states: dict[str, list], steps: list | None = None,
                    *, device_type: str = "cpu", device_rule: str = _CPU_RULE, contiguous: bool = False) -> list[int]:
    """Check the tensors of one fused step as the kernels would, and return each parameter's storage layout.

    Raises ValueError (list lengths, devices, layouts, shapes, step counters) or TypeError (dtypes, non-tensors)
    naming the argument, e.g. ``grads[1]``. Every fused step checks here before it enters C++/SYCL, so a bad call
    raises a Python exception even on a build where an exception thrown inside the extension cannot unwind (seen as
    SIGSEGV on one machine; see kernels_cpu/src/ops.cpp). ``aux`` may be empty (no parameter has one); ``states``
    maps the op's argument names to per-parameter lists; ``steps`` are the already incremented step counters;
    ``device_rule`` ends the message for a tensor not on ``device_type``; ``contiguous`` is the SYCL kernels' rule.
    """
    n = len(params)
    lengths = {"grads": len(grads), "aux entries": len(aux) if aux else n, "state_steps": n if steps is None else
               len(steps), **{name: len(lst) for name, lst in states.items()}}
    for name, length in lengths.items():
        if length != n:
            raise ValueError(f"{op}: got {n} params but {length} {name}")
    layouts = _plain_cpu_layouts(params, aux, grads, states) if device_type == "cpu" and not contiguous else None
    if layouts is None:
        layouts = _named_checks(op, params, aux, grads, states, (device_type, device_rule, contiguous))
    for i, t in enumerate(steps or []):
        if not (isinstance(t, Tensor) and t.numel() == 1 and t.is_cpu):
            raise ValueError(f"{op}: state_steps[{i}] must be a one-element CPU tensor holding the step count")
    # The counts' values are data, unreadable while torch.compile traces; the kernel checks them there.
    if steps and not torch.compiler.is_compiling():
        try:
            values = torch.stack(steps)
        except RuntimeError:  # one-element tensors of different shapes
            values = torch.stack([t.reshape(()) for t in steps])
        if not bool(values.ge(1).all()):  # NaN fails too
            i = next(i for i, t in enumerate(steps) if not float(t) >= 1)
            raise ValueError(f"{op}: state_steps[{i}] is {float(steps[i])}; increment the step before calling the "
                             "kernel")
    return layouts


def _named_checks(op: str, params: list, aux: list, grads: list, states: dict[str, list], rule: tuple) -> list[int]:
    """check_step_args' per-tensor checks in the kernels' order, raising at the first problem with its name."""
    layouts = []
    for i in range(len(params)):
        p, a, g = params[i], aux[i] if aux else None, grads[i]
        check_dense(op, p, f"params[{i}]", *rule)
        if a is not None:
            check_dense(op, a, f"aux[{i}]", *rule)
            check_same_shape(op, a, f"aux[{i}]", p, f"params[{i}]")
        layout = _layout_of(op, i, p, a)
        if isinstance(g, Tensor) and g.is_sparse:
            raise ValueError(f"{op}: grads[{i}] is sparse; the fused kernels take dense grads only")
        check_dense(op, g, f"grads[{i}]", *rule)
        if g.dtype != layout.grad:
            raise TypeError(f"{op}: grads[{i}] has dtype {g.dtype} but params[{i}] is stored as {layout.description} "
                            f"and needs {layout.grad} grads")
        check_same_shape(op, g, f"grads[{i}]", p, f"params[{i}]")
        for sname, lst in states.items():
            t = lst[i]
            check_dense(op, t, f"{sname}[{i}]", *rule)
            if t.dtype != layout.state and state_formats.format_of(t) is not None and layout.state == torch.float32:
                if not state_formats.fits(t, p):
                    raise ValueError(f"{op}: {sname}[{i}] is {t.dtype} reduced-byte state of shape {tuple(t.shape)}; "
                                     f"params[{i}] needs bfloat16 shaped like it, or a packed 1-D int8/uint8 tensor of "
                                     f"{state_formats.packed_bytes(p.numel())} bytes")
                continue
            if t.dtype != layout.state:
                raise TypeError(f"{op}: {sname}[{i}] has dtype {t.dtype}; optimizer state for a {layout.description} "
                                f"parameter is {layout.state}")
            check_same_shape(op, t, f"{sname}[{i}]", p, f"params[{i}]")
        layouts.append(layout.code)
    return layouts


