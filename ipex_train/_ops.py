"""The one place Python reaches the C++ kernels.

Importing this module loads ``ipex_train._C``, whose TORCH_LIBRARY block registers the ``torch.ops.ipex_train``
ops, and gives each op a fake (meta) implementation so ``torch.compile`` and FakeTensor tracing can see through
it. Kernel-variant (ISA) selection also lives here; ``IPEX_TRAIN_KERNEL=auto|avx512|avx2|scalar`` picks one at
import time. :func:`check_step_args` checks a fused step's arguments in Python before any kernel runs.
"""
from __future__ import annotations

import os

import torch

from . import _C  # noqa: F401  (registers torch.ops.ipex_train)

ops = torch.ops.ipex_train

KERNEL_ENV = "IPEX_TRAIN_KERNEL"


def cpu_features() -> dict[str, bool]:
    """ISA features of this CPU as the kernels see them (present only with OS support for their registers)."""
    pairs = (item.split("=") for item in ops.cpu_features().split(","))
    return {name: flag == "1" for name, flag in pairs}


def kernel_variant() -> str:
    """The kernel variant the fused steps run: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
    return ops.kernel_variant()


def set_kernel_variant(name: str) -> None:
    """Force a kernel variant (``"auto"`` restores the best one for this CPU).

    Raises ValueError for an unknown name and RuntimeError when this CPU lacks the variant's features.
    """
    if not isinstance(name, str):
        raise TypeError(f"set_kernel_variant: name must be a str, got {type(name).__name__}")
    ops.set_kernel_variant(name)


def supported_kernel_variants() -> list[str]:
    """The variants this CPU can run, best first."""
    current = kernel_variant()
    found = []
    try:
        for name in ("avx512", "avx2", "scalar"):
            try:
                ops.set_kernel_variant(name)
            except RuntimeError:
                continue
            found.append(name)
    finally:
        ops.set_kernel_variant(current)
    return found


def _apply_env() -> None:
    requested = os.environ.get(KERNEL_ENV)
    if not requested:
        return
    try:
        ops.set_kernel_variant(requested)
    except (ValueError, RuntimeError) as e:
        raise RuntimeError(f"{KERNEL_ENV}={requested!r}: {e}") from None


_apply_env()


def _check_cpu(op: str, args) -> None:
    # A fake impl also serves as the Meta kernel: refuse real meta tensors (FakeTensors report "cpu").
    names = [a.name for a in getattr(ops, op).default._schema.arguments]
    for name, value in zip(names, args):
        is_list = isinstance(value, (list, tuple))
        for i, t in enumerate(value if is_list else [value]):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                where = f"{name}[{i}]" if is_list else name
                raise ValueError(f"ipex_train::{op}: {where} is on {t.device}; kernels_cpu takes CPU tensors only")


def _register_fakes() -> None:
    # The step ops only mutate their inputs, so their fake versions only check devices.
    for name in ("sgd_step", "adam_step", "adagrad_step", "lamb_step", "lars_step"):
        torch.library.register_fake(f"ipex_train::{name}")(lambda *args, _op=name: _check_cpu(_op, args))

    @torch.library.register_fake("ipex_train::split_bf16")
    def _split_fake(src):
        return torch.empty_like(src, dtype=torch.bfloat16), torch.empty_like(src, dtype=torch.int16)

    @torch.library.register_fake("ipex_train::combine_bf16")
    def _combine_fake(top, residual):
        return torch.empty_like(top, dtype=torch.float32)


_register_fakes()


# Storage layouts of a parameter, numbered as kernels_cpu/src/kernel_abi.h's Layout: name and grad dtype.
F32, F64, SPLIT_BF16, BF16_MASTER, F16_MASTER = range(5)
LAYOUTS = {F32: ("float32", torch.float32), F64: ("float64", torch.float64),
           SPLIT_BF16: ("split bfloat16", torch.bfloat16), BF16_MASTER: ("bfloat16 with float32 master", torch.bfloat16),
           F16_MASTER: ("float16 with float32 master", torch.float16)}


_LAYOUT_OF = {(torch.float32, None): F32, (torch.float64, None): F64, (torch.bfloat16, torch.int16): SPLIT_BF16,
              (torch.bfloat16, torch.float32): BF16_MASTER, (torch.float16, torch.float32): F16_MASTER}


def _layout_of(op: str, i: int, p: torch.Tensor, aux: torch.Tensor | None) -> int:
    layout = _LAYOUT_OF.get((p.dtype, None if aux is None else aux.dtype))
    if layout is None and aux is None:
        raise TypeError(f"{op}: params[{i}] has dtype {p.dtype}; without aux[{i}] the kernel takes float32 or "
                        "float64 params (a bfloat16 param needs an int16 residual or a float32 master in aux, a "
                        "float16 param a float32 master)")
    if layout is None:
        raise TypeError(f"{op}: params[{i}] ({p.dtype}) with aux[{i}] ({aux.dtype}) is not a storage layout; expected "
                        "a bfloat16 param with an int16 residual (split), or a bfloat16/float16 param with a float32 "
                        "master")
    return layout


_CPU_RULE = "kernels_cpu takes CPU tensors only"


def check_dense(op: str, t, name: str, device_type: str = "cpu", device_rule: str = _CPU_RULE,
                contiguous: bool = False) -> None:
    """Raise unless ``t`` is a dense tensor on ``device_type`` (``device_rule`` ends the message), and contiguous
    when ``contiguous`` (the SYCL kernels' rule)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {name} is a {t.layout} tensor; the fused kernels take dense (strided) tensors only")
    if t.device.type != device_type:
        raise ValueError(f"{op}: {name} is on {t.device}; {device_rule}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} is not contiguous; the SYCL kernels take contiguous tensors (to_usm and "
                         "usm_tensor make contiguous ones)")


def check_same_shape(op: str, t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
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
            layout = _LAYOUT_OF.get((p.dtype, None if a is None else a.dtype))
            if (layout is None or p.layout != strided or not p.is_cpu or g.layout != strided or not g.is_cpu
                    or g.dtype != LAYOUTS[layout][1] or g.shape != p.shape
                    or a is not None and (a.layout != strided or not a.is_cpu or a.shape != p.shape)):
                return None
            state_dtype = torch.float64 if layout == F64 else torch.float32
            for lst in lists:
                t = lst[i]
                if t.layout != strided or not t.is_cpu or t.dtype != state_dtype or t.shape != p.shape:
                    return None
            layouts.append(layout)
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
        if not (isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_cpu):
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
        if isinstance(g, torch.Tensor) and g.is_sparse:
            raise ValueError(f"{op}: grads[{i}] is sparse; the fused kernels take dense grads only")
        check_dense(op, g, f"grads[{i}]", *rule)
        name, grad_dtype = LAYOUTS[layout]
        if g.dtype != grad_dtype:
            raise TypeError(f"{op}: grads[{i}] has dtype {g.dtype} but params[{i}] is stored as {name} and needs "
                            f"{grad_dtype} grads")
        check_same_shape(op, g, f"grads[{i}]", p, f"params[{i}]")
        state_dtype = torch.float64 if layout == F64 else torch.float32
        for sname, lst in states.items():
            t = lst[i]
            check_dense(op, t, f"{sname}[{i}]", *rule)
            if t.dtype != state_dtype:
                raise TypeError(f"{op}: {sname}[{i}] has dtype {t.dtype}; optimizer state for a {name} parameter is "
                                f"{state_dtype}")
            check_same_shape(op, t, f"{sname}[{i}]", p, f"params[{i}]")
        layouts.append(layout)
    return layouts


def split_bf16(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an fp32 tensor into its bf16 top (nearest, ties away from zero) and int16 residual.

    ``combine_bf16(*split_bf16(x))`` gives back the bits of ``x`` for every non-NaN value; NaN comes back as a
    quiet NaN of the same sign. The outputs keep ``src``'s memory format.
    """
    return ops.split_bf16(src)


def combine_bf16(top: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Rebuild the exact fp32 tensor from a bf16 top and its int16 residual (inverse of :func:`split_bf16`)."""
    return ops.combine_bf16(top, residual)
