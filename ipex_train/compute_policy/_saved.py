"""What autograd keeps of the fp32 casts of bf16 tensors that ops on mixed operands run on (bf16 weights on fp32
activations, the emulated policy under optimize()): the bf16 tensor, cast again when backward needs it.

Saving the fp32 copy of every weight from forward to backward would hold 4 bytes per weight element at the start of
backward, above fp32 training's peak; recasting costs one more cast per weight in backward. Large casts (weights of
linear and convolution layers) are written into per-thread scratch buffers reused every step instead of freshly
allocated tensors: a fresh multi-megabyte tensor is page-faulted in on every write (measured ~1 ns per element
against ~0.2 into a reused buffer; ResNet-50's 23.5M weights took ~20 ms per forward, now 4-5 ms). Such a cast is
only alive during its op (forward: a C++ linear or convolution, inside which no backward runs) or its node's
backward (the engine runs a CPU graph's nodes one after another on the thread that called backward, a node's
unpacked tensors die with its apply, and no forward op runs inside a C++ node), so one buffer per thread serves
every op of both phases. (A buffer per phase held one more copy of the largest weight through the step: 9.4 MB on a
ResNet-18, which put its peak memory above fp32 training's.)
"""
from __future__ import annotations

import contextlib
import threading

import torch

# Casts below this many elements are cheap to allocate and not worth the bookkeeping; casts above the cap (an LLM's
# tied embedding / output layer) would keep scratch that large alive for good, so they are allocated as usual.
_SCRATCH_MIN, _SCRATCH_MAX = 1 << 16, 1 << 23


class _Scratch(threading.local):
    def __init__(self):
        self.buffer = torch.empty(0)


_scratch = _Scratch()


def _dense(t: torch.Tensor) -> bool:
    # Layouts whose elements fill storage [0, numel) once: the cast can take them over from the bf16 tensor.
    return (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
            or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)))


def _eligible(t: torch.Tensor) -> bool:
    return _SCRATCH_MIN <= t.numel() <= _SCRATCH_MAX and _dense(t)


def buffer(end: int) -> torch.Tensor:
    """This thread's scratch buffer, grown to at least ``end`` fp32 elements."""
    if _scratch.buffer.numel() < end:
        _scratch.buffer = torch.empty(end, dtype=torch.float32)
    return _scratch.buffer


def scratch_for(weight: torch.Tensor) -> torch.Tensor:
    """The scratch buffer for the fp32 cast of ``weight`` when it is worth one (else an empty tensor): what
    ``torch.ops.ipex_train.emulated_linear`` casts into, in forward and again in backward."""
    return buffer(weight.numel()) if _eligible(weight) and weight.is_contiguous() else _EMPTY


_EMPTY = torch.empty(0)


def _in_buffer(end: int, source: torch.Tensor, offset: int) -> torch.Tensor:
    """An fp32 tensor shaped and strided like ``source`` over elements [offset, offset + numel) of this thread's
    buffer (grown to ``end`` elements when shorter), not an autograd view of it (so that writes in one op are no
    in-place history of another's)."""
    return torch.empty(0).set_(buffer(end).untyped_storage(), offset, source.shape, source.stride())


def _layout(sources: list[torch.Tensor], scratch: bool) -> tuple[list[int | None], int]:
    """Per source, its offset in a scratch buffer (None: not eligible) and the elements the buffer needs."""
    offsets, end = [], 0
    for s in sources:
        offsets.append(end if scratch and _eligible(s) else None)
        end += s.numel() if offsets[-1] is not None else 0
    return offsets, end


def cast_up(sources: list[torch.Tensor], scratch: bool) -> list[torch.Tensor]:
    """fp32 casts of the bf16 ``sources`` (autograd-tracked); with ``scratch`` the large ones are written into this
    thread's buffer, valid only while the op they are for runs, under recast_saved."""
    offsets, end = _layout(sources, scratch)
    return [s.float() if o is None else _in_buffer(end, s, o).copy_(s) for s, o in zip(sources, offsets)]


class _Recast:
    """What autograd keeps instead of a saved fp32 cast of a bf16 tensor: the bf16 tensor (alive anyway as a
    parameter), its version at save time, the saved view's geometry relative to the cast (linear saves the weight
    transposed), and where in the scratch buffer to cast it (None: a fresh tensor)."""

    __slots__ = ("end", "geometry", "offset", "source", "version")

    def __init__(self, source, geometry, offset, end):
        self.source, self.version, self.geometry = source, source._version, geometry
        self.offset, self.end = offset, end


def _unpack(saved):
    if type(saved) is not _Recast:
        return saved
    source = saved.source
    if source._version != saved.version:
        # What autograd says for a saved tensor modified in place; the fp32 copy it would have kept hides it.
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: a bf16 {tuple(source.shape)} tensor (a weight stepped or written between "
                           "forward and backward?)")
    # With create_graph the recast becomes part of the new graph, so it must outlive this node: a fresh tensor.
    if saved.offset is None or torch.is_grad_enabled():
        t = source.float()
    else:
        t = _in_buffer(saved.end, source, saved.offset).copy_(source)
    if saved.geometry is None:
        return t
    size, stride, offset = saved.geometry
    return t.as_strided(size, stride, t.storage_offset() + offset)


@contextlib.contextmanager
def recast_saved(sources: list[torch.Tensor], casts: list[torch.Tensor], scratch: bool):
    """Context in which autograd saves each fp32 cast in ``casts`` of the bf16 tensor at the same index of
    ``sources`` (or a view of the cast) as that bf16 tensor, cast again when backward unpacks it (into this
    thread's scratch buffer with ``scratch``, for the ops whose backward nodes only read it)."""
    offsets, end = _layout(sources, scratch)
    entries = list(zip(sources, casts, offsets))

    def pack(t):
        for source, cast, offset in entries:
            if t is cast:
                return _Recast(source, None, offset, end)
            if t.dtype == cast.dtype and t.untyped_storage().data_ptr() == cast.untyped_storage().data_ptr():
                start = cast.data_ptr()
                if start <= t.data_ptr() < start + cast.numel() * cast.element_size():
                    geometry = (t.size(), t.stride(), t.storage_offset() - cast.storage_offset())
                    return _Recast(source, geometry, offset, end)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
    finally:
        entries.clear()  # autograd keeps the pack hook with each saved tensor: let the fp32 casts go
