"""Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim``).

torch's CPU allocator takes tensors from the C library's malloc. glibc serves a block under its mmap threshold from
its heap, and that threshold rises (up to 32 MiB) each time a larger mmap'd block is freed, so after a model's first
weights are freed most weight-sized tensors of an LLM live on the heap. A tensor freed in the middle of the heap
stays resident until malloc reuses its space. The first step inside backward creates each parameter's optimizer
state (long-lived) between grads that are freed at once (short-lived): the holes the grads leave add up to ~0.4
bytes per parameter of resident memory that no tensor uses (a ~1B decoder with int8 state: 0.36 GiB free in the
heap after its first step). Releasing those pages as they appear keeps the peak at what the tensors need.

Without glibc (musl, macOS, Windows, or an allocator preloaded in its place that leaves glibc's heap unused) there
is nothing to do and :func:`release_free_memory` returns False.
"""
from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    # gnu_get_libc_version tells glibc apart from a libc that may define a malloc_trim of its own meaning.
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "malloc_trim"):
        return None
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the free pages of every glibc malloc arena to the OS (``malloc_trim(0)``: a walk of the free lists
    and an madvise per free run of pages, no copying); True when glibc is present and gave memory back."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
