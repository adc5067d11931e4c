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


def same_as_class(forward: Callable) -> Callable:
    """Mark a route's ``forward`` as computing exactly what its class's forward computes, bit for bit (the linear
    route: ``F.linear`` with the bias in the GEMM's epilogue): a module holding it still counts as :func:`plain` for
    the routes that skip calling it and compute its op themselves."""
    forward.same_as_class = True
    return forward


def _class_forward(module: torch.nn.Module) -> bool:
    """No instance-level forward on ``module``, or one marked :func:`same_as_class`."""
    bound = vars(module).get("forward")
    return bound is None or getattr(getattr(bound, "__func__", None), "same_as_class", False)


def plain(module: torch.nn.Module) -> bool:
    """No hooks and no instance-level forward (but one :func:`same_as_class`): calling ``module`` runs exactly its
    class's forward (what a route that skips calling a submodule, and computes its op itself, must check)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks) and _class_forward(module)


def global_hooks() -> bool:
    """Whether module hooks registered for every module are present (a route skipping a submodule would skip them)."""
    g = _module_globals
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)


# optimize()'s forward pre-hooks on converted layers (ipex_train.precision.casts): they cast floating inputs to the
# layer's parameter dtype, or low-precision inputs to fp32 on a layer with fp32 matrices. A route that skips calling
# such a layer computes only on inputs already of the layer's one dtype, where both return the input unchanged.
# Named, not imported: compute_policy sits below precision in the layers.
_INPUT_CAST_HOOKS = frozenset({("ipex_train.precision.casts", "cast_inputs"),
                               ("ipex_train.precision.casts", "upcast_inputs")})


def plain_but_input_casts(module: torch.nn.Module) -> bool:
    """As :func:`plain`, except that optimize()'s input casts may be registered: calling ``module`` on an input of
    its parameters' dtype is exactly its class's forward on that input (the caller checks the dtype)."""
    if not _class_forward(module) or module._backward_hooks or module._backward_pre_hooks or module._forward_hooks:
        return False
    return all((getattr(h, "__module__", None), getattr(h, "__name__", None)) in _INPUT_CAST_HOOKS
               for h in module._forward_pre_hooks.values())


def _input_cast_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The dtype ``module``'s only pre-hook, optimize()'s ``cast_inputs``, casts floating inputs to (its weight's);
    None where it has other hooks or none."""
    hooks = [(getattr(h, "__module__", None), getattr(h, "__name__", None)) for h in module._forward_pre_hooks.values()]
    weight = getattr(module, "weight", None)
    if hooks == [("ipex_train.precision.casts", "cast_inputs")] and isinstance(weight, torch.Tensor):
        return weight.dtype
    return None


def cast_as_pre_hooks(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``module``'s forward would receive it where its only pre-hook is optimize()'s ``cast_inputs`` (a
    floating input cast to the parameters' dtype; ``module`` has a ``weight``); otherwise ``x`` as it is."""
    dtype = _input_cast_dtype(module)
    return x.to(dtype) if dtype is not None and x.is_floating_point() else x


def shared_input_cast(modules, x: torch.Tensor) -> torch.Tensor:
    """``x`` cast once for all of ``modules`` (projections of one input) where each would cast it alike by
    optimize()'s ``cast_inputs`` (:func:`cast_as_pre_hooks`); otherwise ``x`` as it is, for each module to take as
    before. Each module then receives the very tensor its hook would have made (the forward is unchanged) and its hook
    passes it through; backward, their input gradients add in the cast's dtype before one cast back, as they do where
    the input already had it (a bf16 stream), instead of each cast back and added in fp32."""
    dtypes = {_input_cast_dtype(m) for m in modules}
    if len(dtypes) != 1 or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    dtype = dtypes.pop()
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def checkpointing(module: torch.nn.Module) -> bool:
    """Whether the class's forward would checkpoint this call of ``module``: transformers'
    ``GradientCheckpointingLayer`` wraps the class's forward so, and an instance-level forward replaces that wrapper,
    so a routed forward of such a layer checkpoints itself when this holds."""
    return bool(getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled())


def drops_cache(module: torch.nn.Module, kwargs: dict) -> bool:
    """Whether ``GradientCheckpointingLayer``'s wrapper, checkpointing this call, would rewrite (and warn of) one of
    its cache arguments: ``use_cache`` true, or a ``cache`` / ``layer_past`` given to a layer that may not keep it
    (``_can_checkpoint_with_cache``). A routed forward leaves such calls to the class's forward, which does so."""
    if kwargs.get("use_cache"):
        return True
    return (not getattr(module, "_can_checkpoint_with_cache", False)
            and any(kwargs.get(k) is not None for k in ("cache", "layer_past")))
