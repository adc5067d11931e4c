"""An instance-level forward: how the native policy routes one module to a kernel of ours without touching its
class. ``remove()`` deletes the instance attribute again, so detaching leaves the module exactly as it was."""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch
from torch.nn.modules import module as _module_globals


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


def plain(module: torch.nn.Module) -> bool:
    """No hooks and no instance-level forward: calling ``module`` runs exactly its class's forward (what a route
    that skips calling a submodule, and computes its op itself, must check)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in vars(module))


def global_hooks() -> bool:
    """Whether module hooks registered for every module are present (a route skipping a submodule would skip them)."""
    g = _module_globals
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)
