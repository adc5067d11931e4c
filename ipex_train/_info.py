"""ipex_train.info(): what this machine offers and what ipex_train will use on it."""
from __future__ import annotations

import platform

import torch

from . import _ops


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sycl_available() -> bool:
    try:
        from . import xpu
    except ImportError:
        return False
    return xpu.is_available()


def info() -> dict:
    """A dict describing the torch version, CPU model, ISA features, kernel variant, threads and backends."""
    from . import compute_policy

    features = _ops.cpu_features()
    policy = compute_policy.info()
    return {
        "ipex_train": __import__("ipex_train").__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "isa": features,
        "kernel_variant": _ops.kernel_variant(),
        "kernel_variants_supported": _ops.supported_kernel_variants(),
        "threads": torch.get_num_threads(),
        "bf16_compute_policy": policy["bf16_compute"],
        "bf16_compute_chosen_by": policy["chosen_by"],
        "sycl_available": _sycl_available(),
    }
