"""An instance-level forward: how the native policy routes one module to a kernel of ours without touching its
class. ``remove()`` deletes the instance attribute again, so detaching leaves the module exactly as it was."""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch


class Swap:
    """``forward`` (a module-level function named ``forward``: pickling a bound method stores
    ``getattr(module, "forward")``, which must then find it) set on one module; ``remove()`` restores the class's
    (idempotent)."""

    def __init__(self, module: torch.nn.Module, forward: Callable):
        module.forward = types.MethodType(forward, module)
        self._module = weakref.ref(module)
        self._forward = forward

    def remove(self) -> None:
        """Delete the instance-level forward, if it is still ours."""
        module = self._module()
        if module is None:
            return
        bound = vars(module).get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ is self._forward:
            del module.forward
