"""The non-finite-gradient guard of the optimizer optimize() returns (``optimize(nonfinite_grads=...)``).

One bad batch (a NaN pixel, an overflowing loss) gives NaN or Inf gradients; stepped, they write NaN into the
weights and, with int8 optimizer state, into a whole 256-element block of state for the rest of the run. The guard
reads every gradient of a step once before anything is stepped (:func:`ipex_train.base.ops.first_nonfinite`: one
pass over the bits, parallel) and

* ``"skip"`` (default): steps nothing, so no weight and no optimizer state changes (the step counters included); the
  step is counted (:attr:`NonFiniteGuard.skipped_steps`, ``summary().nonfinite_skipped_steps``) and the first one is
  logged at WARNING with the parameter's name, as torch.amp's GradScaler skips a step whose grads are not finite;
* ``"raise"``: raises RuntimeError naming the parameter, before anything is stepped;
* ``"off"``: no check (the guard is not attached).

With ``step_in_backward=True`` each parameter is stepped alone as its gradient is ready, so the guard decides per
parameter: a parameter whose gradient is not finite is not stepped (counted in
:attr:`NonFiniteGuard.skipped_parameters`), while the parameters whose gradients were finite, and were stepped
earlier in the same backward, stay stepped. Under FSDP2 the ranks agree (one all_reduce per check), so every rank
skips the same steps.

Not covered: what the forward pass of a bad batch changes by itself (BatchNorm running statistics, for one), and
grads a user sets after the check.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..base import ops as _ops
from ..base.dtensor import is_dtensor, local

_log = logging.getLogger("ipex_train")


class NonFiniteGuard:
    """The check of one optimizer (see the module docstring): ``mode`` "skip" or "raise", parameter names by id
    (``names``, from the model at optimize()), and the counts of what it skipped."""

    def __init__(self, mode: str, names: dict[int, str]):
        self.mode = mode
        self.names = names
        self.skipped_steps = 0
        self.skipped_parameters = 0
        self._logged = False

    def allows(self, params: list[Tensor], where: str) -> bool:
        """Whether the gradients of ``params`` are all finite (every rank's shards, under FSDP2). Otherwise raise
        (mode "raise") or count and log (mode "skip") and return False: the caller steps none of ``params``."""
        grads = [local(p.grad) for p in params if p.grad is not None]
        dense = [g.coalesce().values() if g.is_sparse else g for g in grads]
        bad = _ops.first_nonfinite(dense) if dense else -1
        if any(is_dtensor(p) for p in params):
            bad = _agree(bad, next(p for p in params if is_dtensor(p)))
        if bad < 0:
            return True
        culprit = [p for p in params if p.grad is not None][bad] if bad < len(dense) else None
        name = self._name(culprit)
        if self.mode == "raise":
            raise RuntimeError(f"{where}: the gradient of {name} holds NaN or Inf; nothing was stepped "
                               "(optimize(nonfinite_grads='raise')). Use 'skip' to skip such steps and go on")
        return self._skip(name, where)

    def _name(self, p: Tensor | None) -> str:
        if p is None:
            return "a parameter of another rank"
        return repr(self.names[id(p)]) if id(p) in self.names else f"a parameter of shape {tuple(p.shape)}"

    def _skip(self, name: str, where: str) -> bool:
        if where == "step_in_backward":
            self.skipped_parameters += 1
        else:
            self.skipped_steps += 1
        if not self._logged:
            self._logged = True
            _log.warning("ipex_train: %s: the gradient of %s holds NaN or Inf: %s, so no weight and no optimizer "
                         "state changed (counted in summary(model, optimizer); logged once; "
                         "optimize(nonfinite_grads='raise') raises instead)", where, name,
                         "that parameter was not stepped" if where == "step_in_backward" else "this step was skipped")
        return False


def _agree(bad: int, p) -> int:
    """The ranks' verdict: -1 when every rank's shards were finite; else this rank's own index, or 1 << 30 when only
    another rank's shards were not finite."""
    flag = torch.tensor([0.0 if bad < 0 else 1.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=p.device_mesh.get_group())
    if flag.item() == 0.0:
        return -1
    return bad if bad >= 0 else 1 << 30


def guard_for(mode: str | None, model: torch.nn.Module) -> NonFiniteGuard | None:
    """The guard of ``optimize(nonfinite_grads=mode)`` (None: "skip") for an optimizer training ``model``; None for
    "off"."""
    if mode == "off":
        return None
    return NonFiniteGuard(mode or "skip", {id(p): name for name, p in model.named_parameters()})
