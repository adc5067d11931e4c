"""The optimizer :func:`ipex_train.optimize` returns.

It is an instance of a subclass of the user's optimizer class, created once per class (same ``__name__``), so
``isinstance(opt, torch.optim.AdamW)``, LR schedulers, ``add_param_group``, ``zero_grad``, hooks and
``state_dict`` are torch's own. Only three methods differ:

* ``step``: per parameter group, ONE fused C++ call (:func:`_fused.fused_step`) over the params with dense grads,
  for SGD / Adam / AdamW / Adagrad / Lamb / Lars and subclasses that keep their step. Everything else (sparse
  grads, other optimizer classes, ``fuse_update_step=False``) runs the user's class's own step with each
  low-precision parameter temporarily holding its fp32 value and an fp32 grad, then stores the result back
  (re-split, or master copied down), so the residual or master never goes stale.
* ``load_state_dict``: torch casts floating state to the parameter dtype (bf16 would lose the fp32 state); the
  state is restored in fp32 from the checkpoint, and the group dicts keep their identity, so a scheduler created
  on the user's optimizer before optimize(inplace=True) keeps driving it.
* ``add_param_group``: parameters that are already bf16/fp16 get an fp32 truth.

With ``optimize(sycl=True)`` the fused call is :meth:`SyclStep.fused_step` (the same step on a dpctl SYCL queue)
instead, and loaded state and added parameters are moved into USM shared memory.
"""
from __future__ import annotations

import copy
import weakref
from collections import defaultdict
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from .._master_weights import MasterWeights, in_usm
from . import _fused
from .lamb import Lamb
from .lars import Lars

# AdamW derives from Adam (decoupled_weight_decay=True in its defaults), so it resolves to "adam".
FUSED_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.Adagrad: "adagrad", Lamb: "lamb",
               Lars: "lars"}


def _unhooked(step):
    # Optimizer.__init__ wraps each class's step once with its step-hook runner (marked ``hooked``).
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def fused_kind(optimizer_class: type) -> str | None:
    """The fused_step kind for ``optimizer_class``: a supported class, or a subclass that keeps its step."""
    for base in optimizer_class.__mro__:
        if base in FUSED_KINDS:
            same_step = _unhooked(optimizer_class.step) is _unhooked(base.step)
            return FUSED_KINDS[base] if same_step else None
    return None


def _like_param(value: Tensor, p: Tensor, clone: bool) -> Tensor:
    """Optimizer state ``value`` of ``p`` in fp32 (fp64 for fp64 params) and, when shaped like ``p``, laid out
    like it (the kernels then need no copies)."""
    dtype = _fused.state_dtype(p)
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


class SyclStep:
    """The fused step on a dpctl SYCL queue (optimize(sycl=True)): :func:`ipex_train.xpu.fused_step`, which also
    moves new and loaded state into USM, over the USM-backed params and residuals/masters.

    The kernels refuse memory that is not USM, and autograd allocates new grads with torch's allocator (after
    ``zero_grad()``, which sets them to None by default). Such grads are copied into a USM staging buffer kept per
    parameter; grads already in USM (``ipex_train.xpu.usm_grads`` with ``zero_grad(set_to_none=False)``) are used
    as they are. ``p.grad`` itself is never replaced, so grad hooks, clipping and DDP's bucket views keep the
    tensors they hold.
    """

    def __init__(self, queue):
        self.queue = queue
        self._staging: dict[Tensor, Tensor] = {}

    def _usm_grad(self, p: Tensor, grad: Tensor) -> Tensor:
        if in_usm(grad, self.queue):
            return grad
        buf = self._staging.get(p)
        if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
            from .. import xpu

            buf = self._staging[p] = xpu.usm_tensor(grad.shape, grad.dtype, self.queue)
        return buf.copy_(grad)

    def fused_step(self, kind: str, group: dict[str, Any], state: dict, params: list[Tensor],
                   aux: list[Tensor | None], grads: list[Tensor]) -> None:
        """:func:`_fused.fused_step`'s arguments, run on the queue."""
        from .. import xpu

        grads = [self._usm_grad(p, g) for p, g in zip(params, grads)]
        xpu.fused_step(kind, group, state, params, aux, grads, self.queue)

    def state_to_usm(self, entry: dict) -> None:
        """Move one parameter's optimizer state tensors into USM, in place in ``entry``; the ``step`` counter stays
        where it is (the host reads it and passes its value to the kernels)."""
        from .. import xpu

        for key, value in entry.items():
            if key != "step" and isinstance(value, Tensor) and value.numel() and not in_usm(value, self.queue):
                entry[key] = xpu.to_usm(value, self.queue)


class TrainingOptimizer(torch.optim.Optimizer):
    """Base of the classes :func:`training_optimizer` creates; see the module docstring.

    Instance attributes beyond torch's: ``_ipex_masters`` (the model's :class:`MasterWeights`), ``_ipex_fuse``
    (use the fused kernels), ``_ipex_source`` (weak reference to the user's optimizer when it shares this one's
    groups and state), ``_ipex_sycl`` (the :class:`SyclStep` with optimize(sycl=True), else None).
    """

    _user_class: type = torch.optim.Optimizer
    _fused_kind: str | None = None

    def _step(self, closure=None):
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            kind = self._fused_kind if self._ipex_fuse else None
            aux = self._ipex_masters.aux
            unfused = []
            for group in self.param_groups:
                dense = []
                for p in group["params"]:
                    if p.grad is not None:
                        (unfused if kind is None or p.grad.is_sparse else dense).append(p)
                if dense:
                    step = _fused.fused_step if self._ipex_sycl is None else self._ipex_sycl.fused_step
                    step(kind, group, self.state, dense, [aux.get(p) for p in dense], [p.grad for p in dense])
            if unfused:
                self._unfused_step(unfused)
        source = self._ipex_source() if self._ipex_source is not None else None
        if source is not None:
            # LR schedulers created on the user's optimizer check that it was stepped.
            source._opt_called = True
        return loss

    step = torch.optim.Optimizer.profile_hook_step(_step)
    step.hooked = True

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
            _unhooked(self._user_class.step)(self)
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
        """Add a param group as torch does; bf16/fp16 parameters without an fp32 truth get one."""
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        for p in params:
            self._ipex_masters.adopt(p)
        if self._ipex_sycl is not None:
            self._ipex_masters.to_usm(params, self._ipex_sycl.queue)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, keeping the optimizer state fp32 and the param group dicts the same objects."""
        groups, state = self.param_groups, self.state
        super().load_state_dict(state_dict)
        for old, new in zip(groups, self.param_groups):
            if old is not new:
                old.clear()
                old.update(new)
        loaded, self.param_groups, self.state = self.state, groups, state
        state.clear()
        state.update(loaded)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        id_map = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in groups)))
        for saved_id, entry in state_dict["state"].items():
            p = id_map.get(saved_id)
            if p is not None:
                state[p] = _normalised(entry, p, clone=False)
                if self._ipex_sycl is not None:
                    self._ipex_sycl.state_to_usm(state[p])

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # A SYCL queue does not pickle, and the copy's tensors are not USM: the copy steps on the CPU.
        state.update(_ipex_masters=self._ipex_masters, _ipex_fuse=self._ipex_fuse, _ipex_source=None,
                     _ipex_sycl=None)
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
            "__doc__": user_class.__doc__, "_user_class": user_class, "_fused_kind": fused_kind(user_class)})
        _CLASSES[user_class] = cls
    return cls


def _rebuild(user_class: type) -> TrainingOptimizer:
    cls = training_class(user_class)
    return cls.__new__(cls)


def user_class(optimizer: torch.optim.Optimizer) -> type:
    """The user's optimizer class behind ``optimizer`` (its own class unless optimize() returned it)."""
    return optimizer._user_class if isinstance(optimizer, TrainingOptimizer) else type(optimizer)


def training_optimizer(optimizer: torch.optim.Optimizer, masters: MasterWeights, fuse: bool,
                       param_map: dict[Tensor, Tensor] | None, sycl: SyclStep | None = None) -> TrainingOptimizer:
    """The optimizer optimize() returns for ``optimizer``.

    ``param_map`` None (inplace): the new optimizer shares the user's param group list and dicts, state and
    hooks, so schedulers and references made before stay valid; existing state is converted to fp32 in place.
    Otherwise its params are ``param_map[p]`` (the model copy's) in copied group dicts, with a copy of the
    state; the user's optimizer is not modified. With ``sycl`` (params already in USM) the state moves into USM.
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
    for group in new.param_groups:
        for p in group["params"]:
            masters.adopt(p)
    if sycl is not None:
        for entry in new.state.values():
            sycl.state_to_usm(entry)
    return new
