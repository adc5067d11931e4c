"""The step inside backward (gradient release): ``optimize(..., step_in_backward=True)``.

Each parameter of the optimizer gets a ``register_post_accumulate_grad_hook``: as soon as backward has summed its
gradient, the hook runs the optimizer's step for that one parameter (the fused kernel, or the user's class's own
step for optimizers without one) and sets ``p.grad = None``. Full-model gradients therefore never exist at once:
at most the grads of the parameters backward is finishing at that moment.

What follows from stepping during backward:

* ``optimizer.step()`` steps nothing (it runs a closure and returns its loss, and closes the step: see below);
  ``zero_grad()`` is harmless. LR schedulers work: the hook reads ``group["lr"]`` when it runs.
* One backward is one optimizer step. A second backward reaching a parameter already stepped since the last
  ``optimizer.step()`` raises RuntimeError: gradient accumulation over several backwards is not possible.
* Clipping by the global grad norm is not possible: every grad is gone by the time backward returns, so
  ``torch.nn.utils.clip_grad_norm_`` would see no grads and return 0. While any parameter is stepped inside
  backward, ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` raise RuntimeError when given one of them
  (they are wrapped once, the first time the mode is turned on; other parameters pass through unchanged; the
  Accelerate and HF Trainer clipping calls go through them; docs/step_in_backward.md says why nothing narrower
  catches those calls). Grads found on parameters at ``step()`` (set by
  hand) raise RuntimeError instead of being silently ignored.
* Gradients summed across processes (DistributedDataParallel) are not supported: the hook would step before the
  all-reduce.
"""
from __future__ import annotations

import functools
import logging
import math
import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

# Optimizer classes whose step cannot run one parameter at a time.
_PER_PARAM_IMPOSSIBLE = {torch.optim.LBFGS: "it re-evaluates the closure and steps all parameters together"}


def check_supported(optimizer_class: type) -> None:
    """Raise ValueError when ``optimizer_class`` cannot step one parameter at a time (torch.optim.LBFGS)."""
    for base in optimizer_class.__mro__:
        if base in _PER_PARAM_IMPOSSIBLE:
            raise ValueError(f"optimize(step_in_backward=True): {optimizer_class.__name__} cannot step inside "
                             f"backward: {_PER_PARAM_IMPOSSIBLE[base]}; use step_in_backward=False")


# Parameter -> weak reference to the optimizer stepping it inside backward (weak keys: a parameter freed with its
# model leaves by itself).
_released = WeakIdKeyDictionary()


def _stepped_in_backward(p: Tensor) -> bool:
    ref = _released.get(p)
    optimizer = None if ref is None else ref()
    return optimizer is not None and optimizer._ipex_release is not None


def _refuse_released(clip):
    """``clip`` (torch.nn.utils.clip_grad_norm_ / clip_grad_value_) raising for parameters stepped in backward."""

    @functools.wraps(clip)
    def checked(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        if any(_stepped_in_backward(p) for p in params):
            limit = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
            if clip.__name__ == "clip_grad_norm_" and limit == math.inf:
                # A norm query that clips nothing (the HF Trainer logs grad_norm this way every step): allowed, so
                # that such loops run; it sees no grads.
                _warn_norm_query()
                return clip(params, *args, **kwargs)
            raise RuntimeError(f"{clip.__name__}: these parameters are stepped inside backward "
                               "(optimize(step_in_backward=True)), which frees each grad as soon as it is summed, so "
                               "there are no grads left to clip and clipping by the global norm is not possible. "
                               "Turn the mode off (optimizer.set_step_in_backward(False), or step_in_backward=False) "
                               "to clip, or drop the clipping call (HF Trainer: max_grad_norm=0)")
        return clip(params, *args, **kwargs)

    checked._ipex_train_original = clip
    return checked


@functools.cache
def _warn_norm_query() -> None:
    logging.getLogger("ipex_train").warning(
        "clip_grad_norm_(max_norm=inf) on parameters stepped inside backward: their grads are already freed, so the "
        "norm it returns (and any grad_norm a trainer logs) is 0, not the gradient's norm")


def _wrap_clipping() -> None:
    # Patched where user code and libraries look them up at call time: torch.nn.utils.<name> (Accelerate, the HF
    # Trainer, most loops) and torch.nn.utils.clip_grad.<name>.
    import torch.nn.utils.clip_grad as clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        for module in (torch.nn.utils, clip_grad):
            current = getattr(module, name)
            if not hasattr(current, "_ipex_train_original"):
                setattr(module, name, _refuse_released(current))


def _hook(ref: weakref.ref, group: dict, p: Tensor) -> None:
    optimizer = ref()
    release = None if optimizer is None else optimizer._ipex_release
    if release is None:  # the optimizer is gone or turned the mode off: the grad stays, as without hooks
        return
    if id(p) in release.stepped:
        raise RuntimeError("step_in_backward: a second backward reached a parameter already stepped since the last "
                           "optimizer.step(); each backward is one optimizer step in this mode, so gradient "
                           "accumulation over several backwards is not possible. Call optimizer.step() after each "
                           "backward, sum the losses before one backward, or use step_in_backward=False")
    release.stepped.add(id(p))
    with torch.no_grad():
        optimizer._ipex_step_params(group, [p])
    p.grad = None


class GradientRelease:
    """The hooks of one optimizer in step-in-backward mode, and the parameters stepped since its last step()."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._ref = weakref.ref(optimizer)
        self._handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self.stepped: set[int] = set()
        _wrap_clipping()
        for group in optimizer.param_groups:
            self.add_group(group)

    def add_group(self, group: dict) -> None:
        """Hook the parameters of ``group`` (a param group dict of the optimizer) that are not hooked yet."""
        for p in group["params"]:
            if id(p) not in self._handles and p.requires_grad:
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(functools.partial(_hook, self._ref, group))
                _released[p] = self._ref

    def close_step(self, params) -> None:
        """optimizer.step(): raise for grads left on ``params`` (nothing steps them), then start the next step."""
        stray = [p for p in params if p.grad is not None]
        if stray:
            raise RuntimeError(f"step_in_backward: {len(stray)} parameter(s) have a .grad at optimizer.step(), but in "
                               "this mode backward steps each parameter and frees its grad, and step() steps nothing "
                               "(grads set by hand, or left from before the mode was turned on, are not used; "
                               "clipping by global norm is not possible). Set them to None, or turn the mode off "
                               "with optimizer.set_step_in_backward(False)")
        self.stepped.clear()

    def remove(self) -> None:
        """Remove every hook."""
        optimizer = self._ref()
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    _released.pop(p, None)
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
