"""SYCL devices through dpctl: listing, availability and the default queue."""
from __future__ import annotations

import os
import sys
import threading

from ..base import envvars as _envvars
from . import _runtime

DEVICE_ENV = _envvars.SYCL_DEVICE.name

_lock = threading.Lock()
_default_queue = None


def _dpctl():
    try:
        return _runtime.import_dpctl()
    except ImportError:
        return None


def _describe(d) -> dict:
    return {
        "name": d.name,
        "filter_string": d.filter_string,
        "device_type": d.device_type.name,
        "backend": d.backend.name,
        "driver_version": d.driver_version,
        "fp16": bool(d.has_aspect_fp16),
        "fp64": bool(d.has_aspect_fp64),
        "max_work_group_size": int(d.max_work_group_size),
        "max_compute_units": int(d.max_compute_units),
        "usm_shared": bool(d.has_aspect_usm_shared_allocations),
        "usm_device": bool(d.has_aspect_usm_device_allocations),
        "usm_host": bool(d.has_aspect_usm_host_allocations),
    }


def devices() -> list[dict]:
    """Every SYCL device dpctl sees, each as a dict: name, filter_string, device_type, backend, driver_version,
    fp16, fp64, max_work_group_size, max_compute_units, usm_shared, usm_device, usm_host. Empty without dpctl."""
    dpctl = _dpctl()
    return [] if dpctl is None else [_describe(d) for d in dpctl.get_devices()]


def unavailable_reason() -> str | None:
    """Why the SYCL kernels cannot run in this process, or None when they can."""
    dpctl = _dpctl()
    if dpctl is None:
        return "dpctl is not installed (pip install 'ipex_train[xpu]', i.e. dpctl and intel-opencl-rt)"
    if not os.path.exists(os.path.join(sys.prefix, "include", "sycl", "sycl.hpp")):
        return f"the SYCL headers of intel-sycl-rt are not under {sys.prefix}/include"
    if not any(d.has_aspect_usm_shared_allocations for d in dpctl.get_devices()):
        return ("no SYCL device with USM shared allocations (for the SYCL CPU device: pip install intel-opencl-rt, "
                "and OCL_ICD_VENDORS must not hide it; see kernels_xpu/sycl_env.sh)")
    return None


def is_available() -> bool:
    """Whether a SYCL device the kernels can use is present (False, never an exception, when dpctl, the runtime or
    a device is missing)."""
    try:
        return unavailable_reason() is None
    except Exception:  # a broken driver install must read as "not available", not crash ipex_train.info()
        return False


def select_device():
    """The dpctl.SyclDevice the default queue uses: ``$IPEX_TRAIN_SYCL_DEVICE`` (a dpctl filter string such as
    ``opencl:cpu``) if set, else the first GPU with USM shared allocations, else the first such device."""
    dpctl = _runtime.import_dpctl()
    wanted = _envvars.SYCL_DEVICE.read()
    if wanted:
        return dpctl.SyclDevice(wanted)
    usable = [d for d in dpctl.get_devices() if d.has_aspect_usm_shared_allocations]
    if not usable:
        raise RuntimeError(f"ipex_train.xpu: no usable SYCL device: {unavailable_reason()}")
    gpus = [d for d in usable if d.has_aspect_gpu]
    return (gpus or usable)[0]


def default_queue():
    """The process-wide dpctl.SyclQueue used when no queue is passed (created on first use).

    Keep using one queue: USM memory belongs to the queue's context, and every tensor of a step must share it.
    """
    global _default_queue
    with _lock:
        if _default_queue is None:
            dpctl = _runtime.import_dpctl()
            _default_queue = dpctl.SyclQueue(select_device())
        return _default_queue
