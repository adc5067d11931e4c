"""Process memory readings the memory benchmarks share: /proc/self/status fields, resetting the peak RSS, and
pinning glibc's mmap threshold so that peak RSS follows the live tensors."""
from __future__ import annotations

import ctypes


def status_kb(key: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_peak() -> bool:
    """Reset VmHWM (the peak RSS) to the current RSS (Linux 4.0+); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at its 128 KiB default, so that freed large tensors go back to the OS.

    By default glibc raises the threshold to the size of each large block freed (up to 32 MiB), after which such
    blocks come from the heap and stay in the RSS when freed: peak RSS then measures heap retention (the order and
    sizes of frees) as much as the memory a variant holds. With the threshold pinned, peak RSS follows the live
    tensors, at the price of page faults on every large allocation (slower steps), which is why memory is measured
    apart from time. Returns False where this is not glibc.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
