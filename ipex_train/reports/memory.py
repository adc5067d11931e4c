"""Memory accounting of a training configuration: :func:`memory_report`, the bytes each parameter costs.

Four parts per parameter: the weight as stored (fp32, or the bf16/fp16 top), its fp32 truth (the int16 residual of
a split bf16 weight or an fp32 master copy), its grad (in the weight's dtype, while the model's grads are alive
between backward and step; none with step_in_backward) and the optimizer state. Everything that exists is measured
from the tensors themselves; optimizer state that does not exist yet (before the first step) is predicted from the
fused optimizer's entry in :mod:`ipex_train.optim.registry` and :func:`state_bytes_per_element`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..base.dtensor import local
from ..base.options import check_model_and_optimizer
from ..optim import fused, registry, state_formats
from ..precision import record as _record
from ..training.optimizer import TrainingOptimizer, user_class


def state_bytes_per_element(p: Tensor, group: dict) -> float:
    """Bytes per element of one optimizer state tensor of parameter ``p`` in param group ``group``: the one place
    a state storage format states its size (fp32 state, fp64 for fp64 parameters, or the group's reduced-byte
    ``state_dtype``: bf16 2, int8 one code per element plus one fp32 scale per block)."""
    fmt = state_formats.wanted(group, p)
    if fmt is None:
        return fused.state_dtype(p).itemsize
    return state_formats.bytes_per_element(fmt, p.numel())


def _nbytes(t: Tensor) -> int:
    # A sharded (FSDP2) tensor counts this rank's shard.
    t = local(t)
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of a model's parameters and everything training keeps per parameter. ``str()`` gives the line
    optimize() logs at INFO.

    parameters: elements of the model's parameters. weights / truth / grads: bytes of the stored weights, of their
    fp32 truth (residuals or masters), and of the grads between backward and step (measured where a grad exists,
    else the weight's element size; 0 with step_in_backward). state_measured: bytes of existing optimizer state
    tensors; state_predicted: the fused optimizer's state not created yet; state_unknown_elements: parameter
    elements whose optimizer has no fused step and no state yet (its size is known after the first step).
    step_in_backward: grads are freed inside backward; largest_grad is then the biggest single grad (the most
    one parameter holds at a time). On a model sharded with FSDP2 the bytes are this rank's (its shards) and
    ``parameters`` counts the whole model, so :meth:`per_parameter` is bytes per parameter per rank.
    frozen_parameters / frozen_weights / frozen_truth: the elements, stored bytes
    and truth bytes of the parameters with requires_grad=False (included in the totals above; frozen parameters
    have no grads and no optimizer state), so that :meth:`per_trainable` and :meth:`per_frozen` can tell a LoRA
    base model's cost from its adapters'.
    """

    parameters: int
    weights: int
    truth: int
    grads: int
    state_measured: int
    state_predicted: int
    state_unknown_elements: int
    step_in_backward: bool
    largest_grad: int
    frozen_parameters: int = 0
    frozen_weights: int = 0
    frozen_truth: int = 0

    @property
    def state(self) -> int:
        """Optimizer state bytes, measured plus predicted."""
        return self.state_measured + self.state_predicted

    @property
    def total(self) -> int:
        """Weights + truth + grads + optimizer state, in bytes."""
        return self.weights + self.truth + self.grads + self.state

    def per_parameter(self) -> dict[str, float]:
        """Each part (and the total) in bytes per parameter element."""
        n = max(1, self.parameters)
        return {"weights": self.weights / n, "truth": self.truth / n, "grads": self.grads / n,
                "state": self.state / n, "total": self.total / n}

    def per_trainable(self) -> float:
        """Bytes per trainable parameter element: its weight, truth, grad and optimizer state."""
        frozen = self.frozen_weights + self.frozen_truth
        return (self.total - frozen) / max(1, self.parameters - self.frozen_parameters)

    def per_frozen(self) -> dict[str, float]:
        """Bytes per frozen parameter element: weights, truth and their total."""
        n = max(1, self.frozen_parameters)
        return {"weights": self.frozen_weights / n, "truth": self.frozen_truth / n,
                "total": (self.frozen_weights + self.frozen_truth) / n}

    def to_dict(self) -> dict:
        """The fields, the state and total bytes, :meth:`per_parameter`, :meth:`per_trainable` and
        :meth:`per_frozen`, as plain values (JSON-ready)."""
        return dict(asdict(self), state=self.state, total=self.total, bytes_per_parameter=self.per_parameter(),
                    bytes_per_trainable_parameter=self.per_trainable(),
                    bytes_per_frozen_parameter=self.per_frozen())

    def __str__(self) -> str:
        per = self.per_parameter()
        grads = "0 (stepped in backward)" if self.step_in_backward else f"{per['grads']:.2f}"
        basis = "predicted" if self.state_predicted and not self.state_measured else \
            "measured" if not self.state_predicted else "measured + predicted"
        line = (f"ipex_train memory: {per['total']:.2f} bytes/param ({self.total / 2 ** 20:.1f} MiB for "
                f"{self.parameters / 1e6:.2f}M params) = weights {per['weights']:.2f} + fp32 truth "
                f"{per['truth']:.2f} + grads {grads} + optimizer state {per['state']:.2f} ({basis})")
        if self.frozen_parameters:
            frozen = self.per_frozen()
            line += (f"; {(self.parameters - self.frozen_parameters) / 1e6:.3g}M trainable at "
                     f"{self.per_trainable():.2f} bytes/param, {self.frozen_parameters / 1e6:.3g}M frozen at "
                     f"{frozen['total']:.2f} bytes/param (weights {frozen['weights']:.2f} + fp32 truth "
                     f"{frozen['truth']:.2f})")
        if self.state_unknown_elements:
            line += f"; state of {self.state_unknown_elements} elements known after the first step"
        return line


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """The bytes per parameter of training ``model`` with ``optimizer`` as configured (pass what
    ipex_train.optimize() returned; a plain model and torch optimizer work too). See :class:`MemoryReport`."""

    check_model_and_optimizer(model, optimizer, "memory_report()")
    params = list(model.parameters())
    masters = _record.masters(model)
    aux = masters.aux if masters is not None else {}
    release = isinstance(optimizer, TrainingOptimizer) and optimizer.step_in_backward
    trained = [p for p in params if p.requires_grad]
    grad_sizes = [_nbytes(p.grad if p.grad is not None else p) for p in trained]
    measured = predicted = unknown = 0
    if optimizer is not None:
        entry = registry.for_class(user_class(optimizer))  # the state is torch's, fused or not
        for group in optimizer.param_groups:
            states = [s for s in entry.state if s.present(group)] if entry is not None else []
            for p in group["params"]:
                found = [v for v in optimizer.state.get(p, {}).values() if isinstance(v, Tensor)]
                if found:
                    measured += sum(_nbytes(v) for v in found)
                elif not p.requires_grad:  # torch makes no state for a parameter that never has a grad
                    continue
                elif entry is not None:
                    predicted += int(len(states) * local(p).numel() * state_bytes_per_element(local(p), group))
                else:
                    unknown += p.numel()
    frozen = [p for p in params if not p.requires_grad]
    return MemoryReport(
        parameters=sum(p.numel() for p in params), weights=sum(_nbytes(p) for p in params),
        truth=sum(_nbytes(aux[p]) for p in params if p in aux), grads=0 if release else sum(grad_sizes),
        state_measured=measured, state_predicted=predicted, state_unknown_elements=unknown,
        step_in_backward=release, largest_grad=max(grad_sizes, default=0) if release else 0,
        frozen_parameters=sum(p.numel() for p in frozen), frozen_weights=sum(_nbytes(p) for p in frozen),
        frozen_truth=sum(_nbytes(aux[p]) for p in frozen if p in aux))
