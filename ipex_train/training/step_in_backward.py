"""The step inside backward (gradient release): ``optimize(..., step_in_backward=True)``.

Each parameter of the optimizer gets a ``register_post_accumulate_grad_hook``: as soon as backward has summed its
gradient, the hook runs the optimizer's step for that one parameter (the fused kernel, or the user's class's own
step for optimizers without one) and sets ``p.grad = None``. Full-model gradients therefore never exist at once:
at most the grads of the parameters backward is finishing at that moment.

What follows from stepping during backward:

* ``optimizer.step()`` steps nothing (it runs a closure and returns its loss, and closes the step: see below);
  ``zero_grad()`` is harmless. LR schedulers work: the hook reads ``group["lr"]`` when it runs.
* One backward is one optimizer step. A second backward reaching a parameter already stepped since the last
  ``optimizer.step()`` raises RuntimeError (and drops that grad): gradient accumulation over several backwards is
  not possible. A backward that raised part way (a tensor hook, an error in the graph) has stepped the parameters
  it reached; retrying it steps the others and skips those (every parameter is stepped once per optimizer step),
  and ``optimizer.step()`` instead ends the step as it stands, with a warning (:class:`BackwardStepper`).
* Parameters frozen (``requires_grad=False``) when the mode was turned on cannot be hooked: once unfrozen, the
  next ``optimizer.step()`` steps them from the grads backward left (as the normal step does) and hooks them.
* Only optimizers whose step updates each parameter from its own grad and state can step one parameter at a time:
  the fused optimizers, torch.optim's per-parameter classes and subclasses that keep their step, and classes that
  declare ``per_parameter_step = True``. Any other (its step may use a global grad norm) is refused with
  ValueError, as is torch.optim.LBFGS.
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
import inspect
import logging
import math
import weakref

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.utils.weak import WeakIdKeyDictionary

from ..base import heap as _heap

# Optimizer classes whose step cannot run one parameter at a time.
_PER_PARAM_IMPOSSIBLE = {torch.optim.LBFGS: "it re-evaluates the closure and steps all parameters together"}
# torch.optim classes whose step updates each parameter from its own grad and state only (their subclasses keeping
# that step too); the fused optimizers of the registry are per parameter as well.
_PER_PARAM_TORCH = tuple(cls for cls in (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.SparseAdam, getattr(torch.optim, "Adafactor", None),
    getattr(torch.optim, "Muon", None)) if cls is not None)
# The class attribute by which a custom optimizer declares that its step reads each parameter's own grad and state
# only (no global grad norm, no statistics over all parameters), so stepping one parameter at a time is its step.
PER_PARAMETER_ATTR = "per_parameter_step"


def _keeps_step(optimizer_class: type, base: type) -> bool:
    # Optimizer.__init__ wraps a class's step once with its hook runner (functools.wraps): compare the functions.
    return inspect.unwrap(optimizer_class.step) is inspect.unwrap(base.step)


def check_supported(optimizer_class: type, fused: bool) -> None:
    """Raise ValueError unless ``optimizer_class``'s step can run one parameter at a time: refused for
    torch.optim.LBFGS; accepted for the fused optimizers (``fused``: a fused kernel steps the class), the
    per-parameter torch.optim classes (and subclasses that keep their step), and classes that set
    ``per_parameter_step = True``. Any other step may read every parameter at once (a global grad norm, a trust
    ratio over all layers), which stepping inside backward would silently change."""
    for base in optimizer_class.__mro__:
        if base in _PER_PARAM_IMPOSSIBLE:
            raise ValueError(f"optimize(step_in_backward=True): {optimizer_class.__name__} cannot step inside "
                             f"backward: {_PER_PARAM_IMPOSSIBLE[base]}; use step_in_backward=False")
    if fused or getattr(optimizer_class, PER_PARAMETER_ATTR, False) is True:
        return
    if any(base in _PER_PARAM_TORCH and _keeps_step(optimizer_class, base) for base in optimizer_class.__mro__):
        return
    raise ValueError(f"optimize(step_in_backward=True): {optimizer_class.__name__} has its own step, which may read "
                     "several parameters' grads at once (a global grad norm, statistics over all parameters); inside "
                     "backward each parameter is stepped alone, as soon as its grad is ready, which would change "
                     f"that step silently. Accepted: the fused optimizers, torch.optim's per-parameter classes "
                     f"({', '.join(c.__name__ for c in _PER_PARAM_TORCH)}) and subclasses keeping their step, or a "
                     f"class declaring {PER_PARAMETER_ATTR} = True when its step reads each parameter's own grad and "
                     "state only; else use step_in_backward=False")


# Parameter -> weak reference to the optimizer stepping it inside backward (weak keys: a parameter freed with its
# model leaves by itself).
_released = WeakIdKeyDictionary()


def _stepped_in_backward(p: Tensor) -> bool:
    ref = _released.get(p)
    optimizer = None if ref is None else ref()
    return optimizer is not None and optimizer._ipex_in_backward is not None


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
    release = None if optimizer is None else optimizer._ipex_in_backward
    if release is None:  # the optimizer is gone or turned the mode off: the grad stays, as without hooks
        return
    release.enter_backward()
    if id(p) in release.stepped:
        p.grad = None  # not used: leaving it would make step() blame grads set by hand
        if not release.completed:
            return  # the retry of an interrupted backward: that backward already stepped p in this step
        raise RuntimeError("step_in_backward: a second backward reached a parameter already stepped since the last "
                           "optimizer.step(); each backward is one optimizer step in this mode, so gradient "
                           "accumulation over several backwards is not possible. Call optimizer.step() after each "
                           "backward, sum the losses before one backward, or use step_in_backward=False")
    first = not optimizer.state.get(p)
    try:
        with torch.no_grad():
            optimizer._ipex_step_params(group, [p])
    finally:
        p.grad = None  # stepped; or not, and a retried backward must not add its grad to this one
    release.stepped.add(id(p))
    if first:
        # p's state was just created among grads freed at once: give their holes back (see ipex_train.base.heap).
        _heap.release_free_memory()


def _finished(ref: weakref.ref) -> None:
    release = ref()
    if release is not None:
        release.completed = True


class BackwardStepper:
    """The hooks of one optimizer in step-in-backward mode, and where its current step stands: the parameters
    stepped since its last step(), and whether a backward that stepped them ran to its end.

    A backward that raises part way (a tensor hook, an error in the loss's graph) has stepped the parameters whose
    grads were ready before the error and not the others. The step is then completed by the next backward (the
    retry): it steps the parameters not stepped yet and drops the grads of those already stepped, so every
    parameter is stepped once per optimizer step. optimizer.step() called instead ends the step as it stands (a
    warning says how many parameters the interrupted backward stepped).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._ref = weakref.ref(optimizer)
        self._handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self.stepped: set[int] = set()
        self.completed = False  # a backward that stepped parameters ran to its end since the last step()
        self._task: int | None = None  # the autograd graph task of the latest backward that reached a hook
        _wrap_clipping()
        for group in optimizer.param_groups:
            self.add_group(group)

    def enter_backward(self) -> None:
        """Called by each hook: at the first hook of a backward, ask autograd to mark its end (its final callbacks
        run only when the whole backward succeeds)."""
        task = torch._C._current_graph_task_id()
        if task < 0:  # not run by the autograd engine: its end cannot be seen, so a further backward is refused
            self.completed = True
        elif task != self._task:
            self._task = task
            Variable._execution_engine.queue_callback(functools.partial(_finished, weakref.ref(self)))

    def add_group(self, group: dict) -> None:
        """Hook the parameters of ``group`` (a param group dict of the optimizer) that are not hooked yet and
        require grad (a frozen parameter cannot be hooked: step() hooks it once it requires grad)."""
        for p in group["params"]:
            if id(p) not in self._handles and p.requires_grad:
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(functools.partial(_hook, self._ref, group))
                _released[p] = self._ref

    def close_step(self) -> None:
        """optimizer.step(): raise for grads left on hooked parameters (nothing steps them); step the parameters
        that had no hook (frozen when the mode was turned on, unfrozen since: their grads come from this backward)
        and hook them; then start the next step."""
        optimizer = self._ref()
        groups = optimizer.param_groups
        late = {id(p) for g in groups for p in g["params"] if id(p) not in self._handles and p.requires_grad}
        stray = [p for g in groups for p in g["params"] if p.grad is not None and id(p) not in late]
        if stray:
            raise RuntimeError(f"step_in_backward: {len(stray)} parameter(s) have a .grad at optimizer.step(), but in "
                               "this mode backward steps each parameter and frees its grad, and step() steps nothing "
                               "(grads set by hand, or left from before the mode was turned on, are not used; "
                               "clipping by global norm is not possible). Set them to None, or turn the mode off "
                               "with optimizer.set_step_in_backward(False)")
        if self.stepped and not self.completed:
            logging.getLogger("ipex_train").warning(
                "step_in_backward: optimizer.step() after a backward that raised: it had stepped %d parameter(s), the "
                "others are not stepped in this step (retrying the backward before step() would have stepped them)",
                len(self.stepped))
        for group in groups:
            ready = [p for p in group["params"] if id(p) in late and p.grad is not None]
            if ready:
                with torch.no_grad():
                    optimizer._ipex_step_params(group, ready)
                for p in ready:
                    p.grad = None
            if any(id(p) in late for p in group["params"]):
                self.add_group(group)
        self.stepped.clear()
        self.completed = False

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
