"""The optimizer :func:`ipex_train.optimize` returns.

It is an instance of a subclass of the user's optimizer class, created once per class (same ``__name__``), so
``isinstance(opt, torch.optim.AdamW)``, LR schedulers, ``add_param_group``, ``zero_grad``, hooks and
``state_dict`` are torch's own. Only three methods differ:

* ``step``: per parameter group, ONE fused C++ call (:func:`.optim.fused.fused_step`) over the params with dense grads,
  for the classes of :mod:`.optim.registry` (SGD / Adam / AdamW / Adagrad / Lamb / Lars) and subclasses that keep
  their step. Everything else (sparse
  grads, other optimizer classes, ``fuse_update_step=False``) runs the user's class's own step with each
  low-precision parameter temporarily holding its fp32 value and an fp32 grad, then stores the result back
  (re-split, or master copied down), so the residual or master never goes stale.
* ``load_state_dict``: torch casts floating state to the parameter dtype (bf16 would lose the fp32 state); the
  state is restored in fp32 from the checkpoint, and the group dicts keep their identity, so a scheduler created
  on the user's optimizer before optimize(inplace=True) keeps driving it. Each group keeps its own ``state_dtype``
  (not the checkpoint's) and the loaded state is re-encoded in it.
* ``add_param_group``: parameters that are already bf16/fp16 get an fp32 truth.

With ``optimize(sycl=True)`` the optimizer holds a step backend (:class:`ipex_train.xpu.SyclBackend`): the fused
call is its ``fused_step`` (the same step on a dpctl SYCL queue), and loaded state and added parameters go where
it places them (USM shared memory).

``set_step_in_backward(True)`` (``optimize(step_in_backward=True)``) moves the step into backward: a hook per
parameter steps it alone (same fused call, one parameter) and frees its grad; ``step()`` then steps nothing
(:mod:`._step_in_backward` says what follows).
"""
from __future__ import annotations

import copy
import weakref
from collections import defaultdict
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from ..optim import fused, loaded_state, registry, state_formats
from ..optim.registry import unhooked
from ..precision.master_weights import MasterWeights
from . import step_in_backward as _step_in_backward
from .guard import guard_for


def has_fused_step(optimizer_class: type) -> bool:
    """Whether a fused kernel steps ``optimizer_class``: a registered class, or a subclass that keeps its step."""
    return registry.for_class(optimizer_class) is not None


def _like_param(value: Tensor, p: Tensor, clone: bool) -> Tensor:
    """Optimizer state ``value`` of ``p`` in fp32 (fp64 for fp64 params) and, when shaped like ``p``, laid out
    like it (the kernels then need no copies)."""
    dtype = fused.state_dtype(p)
    if value.shape == p.shape and value.stride() != p.stride():
        return torch.empty_like(p, dtype=dtype).copy_(value)
    out = value.to(dtype=dtype, device=p.device)
    return out.clone() if clone and out is value else out


def _normalised(entry: dict, p: Tensor, clone: bool) -> dict:
    out = {}
    for key, value in entry.items():
        if key == "step":
            value = torch.as_tensor(value, dtype=torch.float32)
            out[key] = value.clone() if clone else value
        elif isinstance(value, Tensor) and value.is_floating_point():
            out[key] = _like_param(value, p, clone)
        else:
            out[key] = copy.deepcopy(value) if clone else value
    return out


class TrainingOptimizer(torch.optim.Optimizer):
    """Base of the classes :func:`training_optimizer` creates; see the module docstring.

    Instance attributes beyond torch's: ``_ipex_masters`` (the model's :class:`MasterWeights`), ``_ipex_fuse``
    (use the fused kernels), ``_ipex_source`` (weak reference to the user's optimizer when it shares this one's
    groups and state), ``_ipex_sycl`` (the step backend with optimize(sycl=True), else None: the CPU step),
    ``_ipex_in_backward`` (the hooks of step_in_backward, else None), ``_ipex_guard`` (the non-finite-gradient
    guard, :mod:`.guard`, else None).
    """

    _user_class: type = torch.optim.Optimizer
    _fused_entry: registry.FusedOptimizer | None = None

    def _step(self, closure=None):
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss.

        With step_in_backward on, backward has already stepped every parameter: this runs the closure and closes
        the step (see :mod:`._step_in_backward`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._ipex_in_backward is not None:
            self._ipex_in_backward.close_step()
        else:
            with torch.no_grad():
                stepping = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
                if self._ipex_guard is None or self._ipex_guard.allows(stepping, "optimizer.step()"):
                    self._step_params(stepping)
        source = self._ipex_source() if self._ipex_source is not None else None
        if source is not None:
            # LR schedulers created on the user's optimizer check that it was stepped.
            source._opt_called = True
        return loss

    def _step_params(self, stepping: list[Tensor]) -> None:
        """Step every parameter in ``stepping`` (those with grads): one fused call per group, then the rest."""
        self._ensure_truth(stepping)
        chosen = {id(p) for p in stepping}
        unfused = []
        for group in self.param_groups:
            unfused += self._fused_part(group, [p for p in group["params"] if id(p) in chosen])
        if unfused:
            self._unfused_step(unfused)

    def _fused_part(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        """One fused call for the dense ``params`` of ``group`` (all with grads); returns those it did not step
        (sparse grads, or no fused kernel), which :meth:`_unfused_step` takes."""
        entry = fused_entry(self)
        dense = [p for p in params if entry is not None and not p.grad.is_sparse]
        if dense:
            aux = self._ipex_masters.aux
            step = fused.fused_step if self._ipex_sycl is None else self._ipex_sycl.fused_step
            step(entry, group, self.state, dense, [aux.get(p) for p in dense], [p.grad for p in dense])
        return [p for p in params if entry is None or p.grad.is_sparse]

    def _ipex_step_params(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Step ``params`` of ``group`` alone (the step-in-backward hook); under no_grad. Nothing is stepped when the
        guard finds a gradient that is not finite."""
        if self._ipex_guard is not None and not self._ipex_guard.allows(params, "step_in_backward"):
            return
        self._ensure_truth(params)
        rest = self._fused_part(group, params)
        if rest:
            self._unfused_step(rest)

    def _ensure_truth(self, params: list[Tensor]) -> None:
        # Parameters frozen at optimize() have no fp32 truth; one unfrozen since gets it before its first step (or
        # the step raises, before anything is stepped, for one whose fp32 value was dropped).
        given = self._ipex_masters.ensure_truth(params)
        if given and self._ipex_sycl is not None:
            self._ipex_sycl.place_params(self._ipex_masters, given)

    step = torch.optim.Optimizer.profile_hook_step(_step)
    step.hooked = True

    @property
    def step_in_backward(self) -> bool:
        """Whether backward steps each parameter as its grad is ready (optimize(step_in_backward=True))."""
        return self._ipex_in_backward is not None

    def set_step_in_backward(self, enabled: bool) -> None:
        """Turn the step inside backward on (hooks on every parameter; see :mod:`._step_in_backward`) or off (hooks
        removed: backward leaves grads and step() steps them, as torch does)."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_step_in_backward(): enabled must be True or False, got {enabled!r}")
        if enabled and self._ipex_in_backward is None:
            _step_in_backward.check_supported(self._user_class, self._fused_entry is not None)
            self._ipex_in_backward = _step_in_backward.BackwardStepper(self)
        elif not enabled and self._ipex_in_backward is not None:
            self._ipex_in_backward.remove()
            self._ipex_in_backward = None

    def _unfused_step(self, params: list[Tensor]) -> None:
        """Run the user's class's step on ``params`` only, low-precision ones holding their fp32 value."""
        masters = self._ipex_masters
        chosen = {id(p) for p in params}
        hidden = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in chosen:
                    hidden[p], p.grad = p.grad, None
        swapped = []
        for p in params:
            if p in masters.aux:
                low, grad = p.data, p.grad
                p.grad = None
                p.data = masters.fp32(p)
                p.grad = grad.float()
                swapped.append((p, low, grad))
        try:
            unhooked(self._user_class.step)(self)
        finally:
            for p, low, grad in swapped:
                work = p.data
                p.grad = None
                p.data = low
                p.grad = grad
                masters.store(p, work)
            for p, grad in hidden.items():
                p.grad = grad

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group as torch does; bf16/fp16 parameters without an fp32 truth get one. A ``state_dtype``
        (the group's, or the default optimize() set) must be a format the step can keep (ValueError otherwise,
        before anything is added)."""
        if isinstance(param_group, dict):
            key = state_formats.GROUP_KEY
            fmt = state_formats.parse(param_group.get(key, self.defaults.get(key)),
                                       f"add_param_group(): param group key {key!r}")
            if fmt is not None and fused_entry(self) is None:
                raise ValueError(f"add_param_group(): param group key {key!r} is {param_group.get(key)!r}, but "
                                 f"reduced-byte state needs the fused step, which this {self._user_class.__name__} "
                                 "does not run (use state_dtype=torch.float32 or leave the key out)")
            if param_group.get("differentiable", self.defaults.get("differentiable", False)):
                raise ValueError("add_param_group(): param group key 'differentiable' is True, but this optimizer "
                                 "steps under torch.no_grad(); leave it False")
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        for p in params:
            self._ipex_masters.adopt(p)
        if self._ipex_sycl is not None:
            self._ipex_sycl.place_params(self._ipex_masters, params)
        if self._ipex_in_backward is not None:
            self._ipex_in_backward.add_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, keeping the optimizer state fp32 and the param group dicts the same objects.

        For the fused optimizers' classes the checkpoint's state is checked first (:mod:`.loaded_state`: a
        parameter's entry is empty or complete, ``step`` >= 0, state tensors shaped like their parameter); a load
        that raises leaves the optimizer as it was."""
        groups, state = self.param_groups, self.state
        if self._fused_entry is not None:
            loaded_state.check_checkpoint(self._fused_entry, state_dict, groups,
                                           f"{self._user_class.__name__}.load_state_dict()")
        settings = state_formats.own_settings(groups)
        super().load_state_dict(state_dict)
        # The new state is built aside and committed last, so that an error on the way changes nothing.
        new_groups, loaded = self.param_groups, self.state
        self.param_groups, self.state = groups, state
        state_formats.restore_settings(new_groups, settings)  # this optimizer's state_dtype, not the checkpoint's
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        id_map = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in groups)))
        for saved_id, entry in state_dict["state"].items():
            p = id_map.get(saved_id)
            if p is not None:
                loaded[p] = _normalised(entry, p, clone=False)
        if fused_entry(self) is not None:
            fused.store_state_formats(fused_entry(self), new_groups, loaded)
        if self._ipex_sycl is not None:  # after the re-encoding, which makes new tensors
            for entry in loaded.values():
                self._ipex_sycl.place_state(entry)
        for old, new in zip(groups, new_groups):
            if old is not new:
                old.clear()
                old.update(new)
        state.clear()
        state.update(loaded)

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict, with reduced-byte state (param group key ``state_dtype``) as fp32 tensors."""
        return state_formats.fp32_state_dict(self, super().state_dict())

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # A SYCL queue does not pickle, and the copy's tensors are not USM: the copy steps on the CPU. Hooks live
        # on the original parameters: the copy steps in step() (set_step_in_backward(True) hooks its own).
        state.update(_ipex_masters=self._ipex_masters, _ipex_fuse=self._ipex_fuse, _ipex_source=None,
                     _ipex_sycl=None, _ipex_in_backward=None, _ipex_guard=self._ipex_guard)
        return state

    def __reduce__(self):
        return _rebuild, (self._user_class,), self.__getstate__()


_CLASSES: dict[type, type] = {}


def training_class(user_class: type) -> type:
    """The TrainingOptimizer subclass of ``user_class`` (created once, named like it)."""
    cls = _CLASSES.get(user_class)
    if cls is None:
        cls = type(user_class.__name__, (TrainingOptimizer, user_class), {
            "__module__": __name__, "__qualname__": f"TrainingOptimizer[{user_class.__qualname__}]",
            "__doc__": user_class.__doc__, "_user_class": user_class, "_fused_entry": registry.for_class(user_class)})
        _CLASSES[user_class] = cls
    return cls


def _rebuild(user_class: type) -> TrainingOptimizer:
    cls = training_class(user_class)
    return cls.__new__(cls)


def fused_entry(optimizer: torch.optim.Optimizer):
    """The registry entry (:class:`ipex_train.optim.registry.FusedOptimizer`) whose kernel steps ``optimizer``, or
    None: not returned by optimize(), no fused step for its class, or ``fuse_update_step=False``."""
    if not isinstance(optimizer, TrainingOptimizer) or not optimizer._ipex_fuse:
        return None
    return optimizer._fused_entry


def sycl_backend(optimizer: torch.optim.Optimizer):
    """The step backend of an optimizer optimize(sycl=True) returned (:class:`ipex_train.xpu.SyclBackend`), else
    None (the CPU step)."""
    return optimizer._ipex_sycl if isinstance(optimizer, TrainingOptimizer) else None


def nonfinite_guard(optimizer: torch.optim.Optimizer):
    """The non-finite-gradient guard of an optimizer optimize() returned (:class:`.guard.NonFiniteGuard`), else
    None (off, or not an optimizer optimize() returned)."""
    return getattr(optimizer, "_ipex_guard", None) if isinstance(optimizer, TrainingOptimizer) else None


def set_nonfinite_guard(optimizer: TrainingOptimizer, mode: str | None, model) -> None:
    """Set the guard of ``optimize(nonfinite_grads=mode)``; an optimizer passed again with the same mode keeps its
    guard and counts."""
    current = optimizer._ipex_guard
    if current is not None and current.mode == (mode or "skip"):
        return
    optimizer._ipex_guard = guard_for(mode, model)


def user_class(optimizer: torch.optim.Optimizer) -> type:
    """The user's optimizer class behind ``optimizer`` (its own class unless optimize() returned it)."""
    return optimizer._user_class if isinstance(optimizer, TrainingOptimizer) else type(optimizer)


def training_optimizer(optimizer: torch.optim.Optimizer, masters: MasterWeights, fuse: bool,
                       param_map: dict[Tensor, Tensor] | None, sycl=None) -> TrainingOptimizer:
    """The optimizer optimize() returns for ``optimizer``.

    ``param_map`` None (inplace): the new optimizer shares the user's param group list and dicts, state and
    hooks, so schedulers and references made before stay valid; existing state is converted to fp32 in place.
    Otherwise its params are ``param_map[p]`` (the model copy's) in copied group dicts, with a copy of the
    state; the user's optimizer is not modified. ``sycl``: the step backend (ipex_train.xpu.SyclBackend, params
    already placed), which also places the state; None for the CPU step.
    """
    cls = training_class(user_class(optimizer))
    new = cls.__new__(cls)
    attrs = {k: v for k, v in vars(optimizer).items() if k not in ("step", "_opt_called")}
    if param_map is None:
        new.__dict__.update(attrs)
        for p, entry in list(optimizer.state.items()):
            if isinstance(p, Tensor):
                entry.update(_normalised(entry, p, clone=False))
        new._ipex_source = weakref.ref(optimizer) if not isinstance(optimizer, TrainingOptimizer) else None
    else:
        new.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in attrs.items()})
        new.param_groups = [dict(g, params=[param_map[p] for p in g["params"]]) for g in optimizer.param_groups]
        state = defaultdict(dict)
        for p, entry in optimizer.state.items():
            if isinstance(p, Tensor) and p in param_map:
                state[param_map[p]] = _normalised(entry, param_map[p], clone=True)
        new.state = state
        new._ipex_source = None
    new._ipex_masters = masters
    new._ipex_fuse = fuse
    new._ipex_sycl = sycl
    new._ipex_in_backward = None
    new._ipex_guard = None
    for group in new.param_groups:
        for p in group["params"]:
            masters.adopt(p)
    if sycl is not None:
        for entry in new.state.values():
            sycl.place_state(entry)
    return new
