"""The fused optimizer steps as SYCL kernels (kernels_xpu), and the SYCL devices they can run on.

The kernels are SYCL source compiled at run time (SYCL-RTC) from kernels_xpu/rtc/steps.cpp, which includes the
same per-element math headers as the CPU kernels; the host glue (kernels_xpu/host/module.cpp) is an optional
extension built on first use. Nothing here is imported by ``import ipex_train``, and without dpctl
:func:`is_available` is False.

Two ways to run them:

* torch XPU tensors (a torch build where ``torch.xpu.is_available()``): :func:`fused_step` runs on torch's current
  SYCL queue. Not exercised by this project's tests, which run where torch has no XPU.
* Opt-in USM mode (``IPEX_TRAIN_SYCL=1`` or ``enabled(True)``): parameters, grads and optimizer state are torch CPU
  tensors viewing SYCL USM shared memory (:func:`to_usm`, :func:`module_to_usm`, :func:`usm_grads`), and every step
  runs on a dpctl SYCL queue. With the pip packages dpctl and intel-opencl-rt this is the SYCL CPU device (OpenCL
  driver on the host CPU): real SYCL kernels, not an Intel GPU.

    import ipex_train.xpu as sx
    q = sx.default_queue()
    sx.module_to_usm(model, q); sx.usm_grads(model.parameters(), q)
    ...; loss.backward()
    for group in opt.param_groups:
        ps = [p for p in group["params"] if p.grad is not None]
        sx.fused_step("adam", group, opt.state, ps, [None] * len(ps), [p.grad for p in ps], q)
    opt.zero_grad(set_to_none=False)   # keeps the grads in USM
"""
from __future__ import annotations

from ..base import envvars as _envvars
from ..base.options import check_bool
from ._backend import SyclBackend
from ._device import DEVICE_ENV, default_queue, devices, is_available, select_device, unavailable_reason
from ._env import sycl_env
from ._runtime import release_all
from ._steps import combine_bf16, fused_step, split_bf16
from ._usm import is_usm, module_to_usm, to_usm, usm_grads, usm_kind, usm_tensor

ENABLE_ENV = _envvars.SYCL.name


def enabled(flag: bool | None = None) -> bool:
    """Whether the optimizer step should run on the SYCL queue: ``flag`` when given (the frontend's argument),
    else ``IPEX_TRAIN_SYCL`` in the environment (1/true/yes/on). Raises RuntimeError when asked for but no device
    is usable, ValueError for an environment value that is not a switch."""
    check_bool(flag, "enabled: flag")
    if flag is None:
        flag = bool(_envvars.SYCL.read())
    if flag and not is_available():
        raise RuntimeError(f"SYCL step requested ({ENABLE_ENV}=1 or sycl=True) but unavailable: {unavailable_reason()}")
    return flag


def step_backend(flag: bool | None = None) -> SyclBackend | None:
    """The step backend of an optimizer that optimize() returns: a :class:`SyclBackend` on :func:`default_queue`
    when :func:`enabled` (``flag``), else None (the CPU step). Raises as :func:`enabled` does."""
    return SyclBackend(default_queue()) if enabled(flag) else None


def torch_xpu_available() -> bool:
    """Whether this torch build has a usable XPU device (then torch XPU tensors can use :func:`fused_step`)."""
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available()


__all__ = [
    "DEVICE_ENV", "ENABLE_ENV", "SyclBackend", "combine_bf16", "default_queue", "devices", "enabled", "fused_step",
    "is_available",
    "is_usm", "module_to_usm", "release_all", "select_device", "split_bf16", "step_backend", "sycl_env", "to_usm",
    "torch_xpu_available", "unavailable_reason", "usm_grads", "usm_kind", "usm_tensor",
]
