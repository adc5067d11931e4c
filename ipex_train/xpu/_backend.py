"""The step backend optimize(sycl=True) hands the optimizer it returns: where the fused step runs, and where
parameters and optimizer state must live for it. The plain CPU step needs no backend (the optimizer then calls
:func:`ipex_train.optim.fused.fused_step` and moves nothing)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from . import _steps, _usm


class SyclBackend:
    """The fused step on a dpctl SYCL queue: :func:`ipex_train.xpu.fused_step` over USM-backed params,
    residuals/masters and state, which :meth:`place_params` and :meth:`place_state` put there.

    The kernels refuse memory that is not USM, and autograd allocates new grads with torch's allocator (after
    ``zero_grad()``, which sets them to None by default). Such grads are copied into a USM staging buffer kept per
    parameter; grads already in USM (``ipex_train.xpu.usm_grads`` with ``zero_grad(set_to_none=False)``) are used
    as they are. ``p.grad`` itself is never replaced, so grad hooks, clipping and DDP's bucket views keep the
    tensors they hold.
    """

    def __init__(self, queue):
        self.queue = queue
        self._staging: dict[Tensor, Tensor] = {}

    def _in_usm(self, t: Tensor) -> bool:
        # Contiguous USM memory of this queue's context, as the SYCL kernels take it.
        return t.is_contiguous() and _usm.is_usm(t, self.queue)

    def _usm(self, t: Tensor) -> Tensor:
        return t if self._in_usm(t) else _usm.to_usm(t, self.queue)

    def _usm_grad(self, p: Tensor, grad: Tensor) -> Tensor:
        if self._in_usm(grad):
            return grad
        buf = self._staging.get(p)
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
            buf = self._staging[p] = _usm.usm_tensor(grad.shape, grad.dtype, self.queue)
        return buf.copy_(grad)

    def fused_step(self, entry, group: dict[str, Any], state: dict, params: list[Tensor],
                   aux: list[Tensor | None], grads: list[Tensor]) -> None:
        """:func:`ipex_train.optim.fused.fused_step`'s arguments (``entry``: the registry entry), run on the queue."""
        grads = [self._usm_grad(p, g) for p, g in zip(params, grads)]
        _steps.fused_step(entry, group, state, params, aux, grads, self.queue)

    def place_params(self, masters, params: Iterable[Tensor]) -> None:
        """Move ``params`` and their residuals or masters (``masters``, the model's MasterWeights) into USM shared
        memory, keeping the Parameter objects. The copies are contiguous, as the SYCL kernels take them (a
        channels-last weight loses that layout); tensors already there are left alone."""
        masters.relocate(params, self._usm)

    def place_state(self, entry: dict) -> None:
        """Move one parameter's optimizer state tensors into USM, in place in ``entry``; the ``step`` counter stays
        where it is (the host reads it and passes its value to the kernels)."""
        for key, value in entry.items():
            if key != "step" and isinstance(value, Tensor) and value.numel():
                entry[key] = self._usm(value)
