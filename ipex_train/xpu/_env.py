"""Process environment for the SYCL runtime that the pip packages ``dpctl`` and ``intel-opencl-rt`` install.

The wheel's OpenCL ICD file (``<prefix>/etc/OpenCL/vendors/intel-cpu.icd``) names a placeholder path, so the ICD
loader finds no OpenCL CPU driver until ``OCL_ICD_VENDORS`` points at a folder holding one ``.icd`` file whose
content is the absolute path of ``<prefix>/lib/libintelocl.so``. A private folder also keeps any other installed
ICD (e.g. Debian's pocl, which has no USM) out of the device list.

``OCL_ICD_VENDORS`` is read when the SYCL runtime first enumerates platforms, so setting it in ``os.environ`` before
dpctl is first imported is enough. ``LD_LIBRARY_PATH`` is not needed inside Python (dpctl, libsycl and this
package's extension find the wheel's libraries through their RUNPATHs; checked with dpctl 0.22.1 and
intel-opencl-rt 2026.2). A plain C++ program linked against the wheel's libOpenCL without an rpath does need
``LD_LIBRARY_PATH=<prefix>/lib``, which the loader reads only at process start: kernels_xpu/sycl_env.sh sets both
for shells and CI.
"""
from __future__ import annotations

import hashlib
import os
import sys

ICD_ENV = "OCL_ICD_VENDORS"


def prefix_lib(prefix: str | None = None) -> str:
    """The ``lib`` folder of the environment that holds the SYCL runtime wheels (this interpreter's by default)."""
    return os.path.join(prefix or sys.prefix, "lib")


def vendors_dir(prefix: str | None = None) -> str | None:
    """Create (if needed) and return a private OpenCL vendors folder for the Intel CPU driver of ``prefix``.

    Returns None when ``prefix`` has no ``lib/libintelocl.so`` (intel-opencl-rt not installed). The folder lives in
    the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``), keyed by the prefix, so a read-only environment works.
    """
    driver = os.path.join(prefix_lib(prefix), "libintelocl.so")
    if not os.path.exists(driver):
        return None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha1(os.path.realpath(driver).encode()).hexdigest()[:12]
    folder = os.path.join(cache, "ipex_train", f"opencl-vendors-{key}")
    icd = os.path.join(folder, "intel-cpu.icd")
    want = os.path.realpath(driver) + "\n"
    try:
        with open(icd) as f:
            if f.read() == want:
                return folder
    except OSError:
        pass
    os.makedirs(folder, exist_ok=True)
    tmp = f"{icd}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(want)
    os.replace(tmp, icd)  # atomic: concurrent processes never read a half-written file
    return folder


def sycl_env(prefix: str | None = None) -> dict[str, str]:
    """The environment variables a process needs to see the SYCL CPU device of ``prefix`` (default: this one).

    Returns ``{"OCL_ICD_VENDORS": ..., "LD_LIBRARY_PATH": ...}`` (the latter with ``<prefix>/lib`` prepended), or an
    empty dict when intel-opencl-rt is not installed there. Use it for subprocesses:
    ``subprocess.run(cmd, env={**os.environ, **sycl_env()})``.
    """
    folder = vendors_dir(prefix)
    if folder is None:
        return {}
    lib = prefix_lib(prefix)
    old = os.environ.get("LD_LIBRARY_PATH", "")
    paths = [lib] + [p for p in old.split(os.pathsep) if p and p != lib]
    return {ICD_ENV: folder, "LD_LIBRARY_PATH": os.pathsep.join(paths)}


def ensure_icd() -> bool:
    """Point ``OCL_ICD_VENDORS`` at the private vendors folder unless the user already set it.

    Must run before dpctl is first imported to have an effect. Returns whether ``OCL_ICD_VENDORS`` is now set.
    """
    if os.environ.get(ICD_ENV):
        return True
    folder = vendors_dir()
    if folder is None:
        return False
    os.environ[ICD_ENV] = folder
    return True
