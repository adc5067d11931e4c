"""The fused optimizers: one entry per optimizer, read by everything that steps, checks or lists them.

An entry says which torch.optim class the kernel implements, which state it keeps (torch.optim's key names and
how each tensor starts), and how a param group becomes the kernel's scalar arguments. The CPU step
(:mod:`.fused`), the SYCL step (:mod:`ipex_train.xpu`), the optimizer :func:`ipex_train.optimize` returns, the
typed functions of :mod:`ipex_train.optim.functional`, the fake (meta) ops, the tests and the benchmarks all read
this list; the C++ side has the same list once, in kernels_cpu/src/optimizers.h, and :data:`OPTIMIZERS` is checked
against it at import.

Kernel argument order (CPU op ``torch.ops.ipex_train.<name>_step``, SYCL ``Runtime.<name>``): params, aux, grads,
one list per :attr:`FusedOptimizer.state` entry, ``fresh_buffers`` (SGD), ``state_steps`` (when the optimizer counts
steps), then :attr:`FusedOptimizer.hyperparameters` in order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def _always(group: dict[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class State:
    """One optimizer state tensor per parameter, shaped like the parameter (fp32; fp64 for fp64 parameters).

    ``key``: torch.optim's state key. ``arg``: the kernel argument holding the list. ``fill``: the group key whose
    value the tensor starts at (zeros when None). ``present``: whether the group keeps this tensor at all (an empty
    list goes to the kernel otherwise). ``signed``: whether it can be negative (its int8 storage map).
    """

    key: str
    arg: str
    fill: str | None = None
    present: Callable[[dict[str, Any]], bool] = _always
    signed: bool = True  # may go negative (int8 state stores it as int8 codes, else as uint8)


@dataclass(frozen=True)
class Hyper:
    """One scalar kernel argument ``arg`` of type ``type`` (float or bool), read from a param group as
    ``group[key]`` (``group[key][index]`` for a pair such as betas; ``key`` defaults to ``arg``), or ``default``
    when the group lacks the key and a default is given (torch.optim flags that older checkpoints lack)."""

    arg: str
    key: str | None = None
    index: int | None = None
    type: type = float
    default: Any = None

    def read(self, group: dict[str, Any]) -> float | bool:
        """The value of this argument in ``group``, as the kernel's float or bool."""
        key = self.key or self.arg
        value = group[key] if self.default is None else group.get(key, self.default)
        return self.type(value if self.index is None else value[self.index])


def _flag(arg: str, default: bool | None = None) -> Hyper:
    return Hyper(arg, type=bool, default=default)


@dataclass(frozen=True)
class FusedOptimizer:
    """A fused optimizer: kernel ``name``, the torch.optim class whose step it is (subclasses that keep that step
    fuse too), its state, whether it counts steps (torch's ``step`` state), whether it takes SGD's fresh-buffer
    flags (torch creates a momentum buffer from the first grad), its scalar arguments, and whether its update is
    scaled by whole-tensor norms (Lamb's trust ratio, Lars' local learning rate: a shard of a parameter cannot step
    alone, :mod:`.sharded` sums the norms across the shard group)."""

    name: str
    optimizer_class: type
    state: tuple[State, ...]
    hyperparameters: tuple[Hyper, ...]
    counts_steps: bool = True
    fresh_flags: bool = False
    whole_tensor_norms: bool = False

    @property
    def op_name(self) -> str:
        """The qualified name of the CPU op."""
        return f"ipex_train::{self.name}_step"

    def kernel_args(self, group: dict[str, Any]) -> list[float | bool]:
        """The scalar kernel arguments of ``group``, in kernel order, as Python floats and bools."""
        return [h.read(group) for h in self.hyperparameters]


def _momentum(group: dict[str, Any]) -> bool:
    return float(group["momentum"]) != 0


def _amsgrad(group: dict[str, Any]) -> bool:
    return bool(group.get("amsgrad", False))


# torch.optim's classes are registered here; ipex_train's own optimizers (Lamb, Lars) register themselves where they
# are defined (:func:`register`), so this module imports none of them.
OPTIMIZERS: tuple[FusedOptimizer, ...] = (
    FusedOptimizer(
        "sgd", torch.optim.SGD, (State("momentum_buffer", "momentum_buffers", present=_momentum),),
        (Hyper("lr"), Hyper("momentum"), Hyper("dampening"), Hyper("weight_decay"), _flag("nesterov"),
         _flag("maximize", False)),
        counts_steps=False, fresh_flags=True),
    # AdamW derives from Adam (decoupled_weight_decay=True in its defaults), so it fuses through this entry.
    FusedOptimizer(
        "adam", torch.optim.Adam,
        (State("exp_avg", "exp_avgs"), State("exp_avg_sq", "exp_avg_sqs", signed=False),
         State("max_exp_avg_sq", "max_exp_avg_sqs", present=_amsgrad, signed=False)),
        (Hyper("lr"), Hyper("beta1", "betas", 0), Hyper("beta2", "betas", 1), Hyper("weight_decay"), Hyper("eps"),
         _flag("amsgrad", False), _flag("maximize", False),
         _flag("decoupled_weight_decay", False))),
    FusedOptimizer(
        "adagrad", torch.optim.Adagrad, (State("sum", "state_sums", fill="initial_accumulator_value", signed=False),),
        (Hyper("lr"), Hyper("lr_decay"), Hyper("weight_decay"), Hyper("eps"), _flag("maximize", False))),
)

BY_NAME: dict[str, FusedOptimizer] = {o.name: o for o in OPTIMIZERS}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def register(entry: FusedOptimizer) -> FusedOptimizer:
    """Add ``entry`` (a new kernel name) to :data:`OPTIMIZERS`, :data:`BY_NAME` and :data:`NAMES`; returns it.

    Called once per optimizer class at its definition; the list is checked against the C++ kernels when
    :mod:`ipex_train.optim` finishes importing."""
    global OPTIMIZERS, NAMES
    if entry.name in BY_NAME:
        raise ValueError(f"fused optimizer {entry.name!r} is registered already")
    OPTIMIZERS += (entry,)
    BY_NAME[entry.name] = entry
    NAMES = tuple(BY_NAME)
    return entry


def get(name: str) -> FusedOptimizer:
    """The entry of kernel ``name``; ValueError naming the accepted ones otherwise."""
    entry = BY_NAME.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"kind must be one of {NAMES}, got {name!r}")
    return entry


def unhooked(step):
    """A class's own ``step`` function: Optimizer.__init__ wraps it once with its step-hook runner (``hooked``)."""
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def for_class(optimizer_class: type) -> FusedOptimizer | None:
    """The entry whose kernel steps ``optimizer_class``: a registered class, or a subclass that keeps its step."""
    by_class = {o.optimizer_class: o for o in OPTIMIZERS}
    for base in optimizer_class.__mro__:
        if base in by_class:
            return by_class[base] if unhooked(optimizer_class.step) is unhooked(base.step) else None
    return None
