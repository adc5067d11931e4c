"""torch CPU tensors viewing SYCL USM shared memory: the host and the SYCL device both read and write them, so
parameters, grads and optimizer state can live there while torch runs the model and SYCL kernels run the step."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from . import _device, _runtime


def _queue(queue):
    return _device.default_queue() if queue is None else queue


def usm_tensor(shape: Sequence[int] | torch.Size, dtype: torch.dtype, queue=None) -> Tensor:
    """A contiguous, zero-filled torch CPU tensor of ``shape`` and ``dtype`` whose storage is SYCL USM shared memory
    of ``queue`` (a dpctl.SyclQueue; default :func:`default_queue`). The allocation lives as long as the storage."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"usm_tensor: dtype must be a torch.dtype, got {dtype!r}")
    shape = torch.Size(shape)
    _runtime.import_dpctl()  # points the OpenCL loader at the CPU driver before dpctl loads
    from dpctl import memory  # a submodule `import dpctl` does not load

    q = _queue(queue)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    # dpctl refuses empty allocations; an empty tensor keeps a one-element allocation.
    mem = memory.MemoryUSMShared(max(numel, 1) * itemsize, queue=q)
    # torch.frombuffer keeps `mem` (and so the allocation) alive for as long as the storage exists.
    flat = torch.frombuffer(mem, dtype=dtype)
    flat.zero_()
    return flat[:numel].view(shape)


def to_usm(tensor: Tensor, queue=None) -> Tensor:
    """A copy of the CPU tensor ``tensor`` in USM shared memory of ``queue`` (contiguous, same dtype and shape,
    detached from autograd)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"to_usm: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(f"to_usm: tensor must be a dense CPU tensor, got {tensor.layout} on {tensor.device}")
    out = usm_tensor(tensor.shape, tensor.dtype, queue)
    out.copy_(tensor.detach())
    return out


def usm_kind(tensor: Tensor, queue=None) -> str:
    """The USM kind of ``tensor``'s memory in ``queue``'s context: "shared", "device", "host", or "unknown" (not
    USM of that context: torch's own allocator, another context, ...)."""
    if tensor.numel() == 0:
        return "unknown"
    return _runtime.runtime(_queue(queue)).pointer_type(tensor.data_ptr())


def is_usm(tensor: Tensor, queue=None) -> bool:
    """Whether ``tensor``'s memory is SYCL USM memory of ``queue``'s context."""
    return usm_kind(tensor, queue) != "unknown"


def module_to_usm(module: torch.nn.Module, queue=None) -> torch.nn.Module:
    """Move every parameter of ``module`` (CPU, dense) into USM shared memory of ``queue``, in place (``p.data``
    is replaced, so optimizers and hooks keep the same Parameter objects). Returns ``module``."""
    for name, p in module.named_parameters():
        if p.device.type != "cpu":
            raise ValueError(f"module_to_usm: parameter {name!r} is on {p.device}; expected CPU")
        p.data = to_usm(p.data, queue)
    return module


def usm_grads(params: Iterable[Tensor], queue=None) -> None:
    """Give every parameter in ``params`` a ``.grad`` in USM shared memory: zeros where it has none, a USM copy
    where it is elsewhere, untouched where it already is USM.

    Autograd accumulates into an existing ``.grad`` in place, so with ``optimizer.zero_grad(set_to_none=False)``
    the grads stay in USM from step to step; call this again after anything that sets them to None.
    """
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"usm_grads: params[{i}] is a {type(p).__name__}, not a tensor")
        g = p.grad
        if g is None:
            p.grad = usm_tensor(p.shape, p.dtype, queue)
        elif g.is_sparse:
            raise ValueError(f"usm_grads: params[{i}] has a sparse grad; the SYCL kernels take dense grads only")
        elif not (g.is_contiguous() and is_usm(g, queue)):
            p.grad = to_usm(g, queue)
