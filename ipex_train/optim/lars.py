"""Lars optimizer (You, Gitman and Ginsburg, 2017, "Large Batch Training of Convolutional Networks")."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from . import _reference
from ._base import FusableOptimizer, check_nonneg
from .registry import FusedOptimizer, Hyper, State, register


class Lars(FusableOptimizer):
    """Lars: SGD with momentum and a per-tensor local learning rate (Algorithm 1 of the paper).

    For each parameter ``w`` with grad ``g``::

        local_lr = eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)   (1 when ||w|| or ||g|| is zero)
        buf = momentum * buf + lr * local_lr * (g + weight_decay * w)
        w = w - buf

    The momentum buffer starts at zero. Args: ``lr``, ``momentum``, ``weight_decay``, ``eeta`` (trust
    coefficient), ``epsilon``, and ``fused`` and ``state_dtype`` as for :class:`ipex_train.optim.Lamb`.
    """

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eeta: float = 1e-3, epsilon: float = 0.0, *, fused: bool | None = None,
                 state_dtype=None):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay), ("eeta", eeta),
                            ("epsilon", epsilon)):
            check_nonneg(name, value)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eeta=eeta, epsilon=epsilon)
        super().__init__(params, defaults, fused, state_dtype)

    def _reference_step(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                        lists: dict[str, list]) -> None:
        _reference.lars(params, grads, lists["momentum_buffer"], lr=float(group["lr"]), momentum=group["momentum"],
                        weight_decay=group["weight_decay"], eeta=group["eeta"], epsilon=group["epsilon"])


Lars.FUSED = register(FusedOptimizer(
    "lars", Lars, (State("momentum_buffer", "momentum_buffers"),),
    (Hyper("lr"), Hyper("momentum"), Hyper("weight_decay"), Hyper("eeta"), Hyper("epsilon")),
    counts_steps=False, whole_tensor_norms=True))
