"""ipex_train.info(): what this machine offers and what ipex_train will use on it."""
from __future__ import annotations

import os
import platform

import torch

from ..base import ops as _ops


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _openmp_runtimes() -> list[str]:
    """The OpenMP runtime files loaded in this process, read from /proc/self/maps ([] where there is none). The
    extension is built with -fopenmp for at::parallel_for and must share torch's runtime: a second one (a wheel
    whose bundled libgomp has another SONAME, or torch on Intel's libiomp5) gives two thread pools."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith("/") and os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
                    found.add(path)
    except OSError:
        pass
    return sorted(found)


def _sycl() -> tuple[list[dict], str | None]:
    """The SYCL devices dpctl lists (name, filter string, type, backend, USM support, whether the optimizer step's
    default queue would use it) and why the SYCL step cannot run here (None when it can). Never raises: a missing
    dpctl or a broken driver install reads as no device, with the reason."""
    try:
        from .. import xpu

        reason = xpu.unavailable_reason()
        found = xpu.devices()
    except Exception as e:  # ImportError without dpctl; anything a broken OpenCL/SYCL install raises
        return [], f"{type(e).__name__}: {e}"
    try:
        selected = xpu.select_device().filter_string if reason is None else None
    except Exception as e:  # e.g. IPEX_TRAIN_SYCL_DEVICE names no device
        selected, reason = None, f"{type(e).__name__}: {e}"
    keys = ("name", "filter_string", "device_type", "backend", "usm_shared", "usm_device", "usm_host")
    return [dict({k: d[k] for k in keys}, default=d["filter_string"] == selected) for d in found], reason


def info() -> dict:
    """A dict describing the torch version, CPU model, ISA features, kernel variant, threads and backends.

    ``openmp_runtimes``: the OpenMP runtime files loaded (one, torch's, in a sound install).
    SYCL: ``sycl_available`` (the optimizer step can run on a SYCL device), ``sycl_devices`` (every device dpctl
    lists: name, filter_string, device_type, backend, usm_shared/usm_device/usm_host, and ``default`` for the one
    optimize(sycl=True) would use) and ``sycl_unavailable_reason`` (None when available).
    """
    from .. import compute_policy

    features = _ops.cpu_features()
    policy = compute_policy.info()
    devices, reason = _sycl()
    return {
        "ipex_train": __import__("ipex_train").__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "isa": features,
        "kernel_variant": _ops.kernel_variant(),
        "kernel_variants_supported": _ops.supported_kernel_variants(),
        "threads": torch.get_num_threads(),
        "openmp_runtimes": _openmp_runtimes(),
        "bf16_compute_policy": policy["bf16_compute"],
        "bf16_compute_chosen_by": policy["chosen_by"],
        "sycl_available": reason is None,
        "sycl_devices": devices,
        "sycl_unavailable_reason": reason,
    }
