"""Loading dpctl, building the host glue (kernels_xpu/host/module.cpp) and holding one kernel runtime per queue.

The glue is an optional extension built on first use with ``torch.utils.cpp_extension.load`` (g++ against
intel-sycl-rt's headers and libsycl), cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
and rebuilt only when its sources change, so ``pip install -e .`` never needs dpctl or SYCL headers.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

from ..base import envvars as _envvars
from ..optim.registry import NAMES
from . import _env

_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)


def source_root(package: str = _PACKAGE) -> str:
    """Where kernels_xpu/ and kernels_cpu/ are read from for the ipex_train package at ``package``: the repository
    of an editable install, else the copies a wheel carries in ipex_train/_sources (setup.py's build_py)."""
    tree = os.path.dirname(package)
    if os.path.exists(os.path.join(tree, "kernels_xpu", "rtc", "steps.cpp")):
        return tree
    return os.path.join(package, "_sources")


_ROOT = source_root()
KERNELS_XPU = os.path.join(_ROOT, "kernels_xpu")
KERNELS_CPU = os.path.join(_ROOT, "kernels_cpu")

# The headers the kernel source includes, as SYCL-RTC's include_files sees them (name -> file under kernels_cpu).
_INCLUDES = {
    "kernel_abi.h": "src/kernel_abi.h",
    "optimizers.h": "src/optimizers.h",
    "ipex_train/common.h": "include/ipex_train/common.h",
    "ipex_train/convert.h": "include/ipex_train/convert.h",
    "ipex_train/elementwise.h": "include/ipex_train/elementwise.h",
    "ipex_train/state_codec.h": "include/ipex_train/state_codec.h",
    **{f"ipex_train/updates/{k}.h": f"include/ipex_train/updates/{k}.h"
       for k in NAMES},
}

_lock = threading.Lock()
_module = None
_runtimes: dict[Any, Any] = {}


def import_dpctl():
    """Import dpctl after pointing the OpenCL ICD loader at the Intel CPU driver; raises ImportError if missing."""
    _env.ensure_icd()
    import dpctl

    return dpctl


def _source_tree() -> None:
    needed = (os.path.join(KERNELS_XPU, "rtc", "steps.cpp"), os.path.join(KERNELS_XPU, "host", "module.cpp"),
              os.path.join(KERNELS_CPU, "src", "kernel_abi.h"))
    missing = [p for p in needed if not os.path.exists(p)]
    if missing:
        raise RuntimeError(
            "ipex_train.xpu compiles its SYCL kernels at run time from their sources, which are missing here "
            f"({', '.join(missing)}); reinstall ipex_train from the repository (pip install --no-build-isolation .)"
        )


def extension():
    """The host-glue module (``ipex_train_xpu_C``), building it on first use."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        _source_tree()
        dpctl = import_dpctl()
        from torch.utils.cpp_extension import load

        include = os.path.join(sys.prefix, "include")
        lib = _env.prefix_lib()
        headers, libsycl = os.path.join(include, "sycl", "sycl.hpp"), os.path.join(lib, "libsycl.so")
        if not (os.path.exists(headers) and os.path.exists(libsycl)):
            raise RuntimeError(f"SYCL headers or libsycl.so not found under {sys.prefix}; pip install intel-sycl-rt")
        _module = load(
            name="ipex_train_xpu_C",
            sources=[os.path.join(KERNELS_XPU, "host", "module.cpp")],
            extra_include_paths=[include, dpctl.get_include(), os.path.join(KERNELS_CPU, "include"),
                                 os.path.join(KERNELS_CPU, "src")],
            # The sycl.hpp warning is about device code; this file is host-only (SYCL-RTC compiles the kernels).
            # -Wno-attributes: dpctl4pybind11.hpp's classes have wider visibility than pybind11's (harmless).
            extra_cflags=["-O2", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING", "-Wno-attributes"],
            extra_ldflags=[f"-L{lib}", "-lsycl", f"-Wl,-rpath,{lib}"],
            verbose=bool(_envvars.XPU_VERBOSE_BUILD.read()),
        )
        return _module


def _kernel_sources() -> tuple[str, list[tuple[str, str]]]:
    with open(os.path.join(KERNELS_XPU, "rtc", "steps.cpp")) as f:
        source = f.read()
    includes = []
    for name, rel in _INCLUDES.items():
        with open(os.path.join(KERNELS_CPU, rel)) as f:
            includes.append((name, f.read()))
    return source, includes


def runtime(queue):
    """The kernel runtime of ``queue`` (a dpctl.SyclQueue), created on first use and kept until process exit."""
    with _lock:
        rt = _runtimes.get(queue)
    if rt is not None:
        return rt
    ext = extension()
    source, includes = _kernel_sources()
    rt = ext.Runtime(queue, source, includes)
    with _lock:
        return _runtimes.setdefault(queue, rt)


def runtime_for_torch_xpu(device) -> Any:
    """The kernel runtime of torch's current SYCL queue on an XPU ``device`` (torch builds with XPU only)."""
    import torch

    stream = torch.xpu.current_stream(device)
    key = ("torch.xpu", stream.device_index, stream.stream_id)
    with _lock:
        rt = _runtimes.get(key)
    if rt is not None:
        return rt
    source, includes = _kernel_sources()
    rt = extension().Runtime.from_queue_address(int(stream.sycl_queue), source, includes)
    with _lock:
        return _runtimes.setdefault(key, rt)


def release_all() -> None:
    """Release every runtime's compiled kernels and scratch memory.

    Registered with atexit: a sycl::kernel still alive when the process tears down its statics crashes the exit.
    A step after this call compiles the kernels again (and needs another call before exit).
    """
    with _lock:
        runtimes = list(_runtimes.values())
        _runtimes.clear()
    for rt in runtimes:
        rt.release()


atexit.register(release_all)
