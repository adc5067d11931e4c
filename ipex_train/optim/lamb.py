"""Lamb optimizer (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes")."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from . import _reference
from ._base import FusableOptimizer, check_betas, check_nonneg
from .registry import FusedOptimizer, Hyper, State, register


class Lamb(FusableOptimizer):
    """Lamb: Adam's moments with a per-tensor trust ratio.

    For each parameter ``w`` with grad ``g`` at step ``t``::

        m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
        w = w - lr * trust * u,   trust = ||w|| / ||u||  (1 when either norm is zero)

    Args:
        params: parameters or parameter groups, as for any torch.optim optimizer.
        lr: learning rate.
        betas: decay rates of the first and second moment.
        eps: added to the denominator for stability.
        weight_decay: decoupled weight decay folded into the update direction (so it is trust-scaled too).
        bias_correction: divide the moments by ``1 - beta^t`` (off in some BERT recipes).
        fused: True for the C++ kernel, False for the plain PyTorch reference, None (default) for the kernel
            whenever the parameters are dense CPU float32/float64.
        state_dtype: None (fp32 state), torch.bfloat16 or "int8": reduced-byte optimizer state (the group key
            ``state_dtype``, see ipex_train.optimize's optimizer_state_dtype); needs the fused kernel.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, *, fused: bool | None = None,
                 state_dtype=None):
        check_nonneg("lr", lr)
        check_nonneg("eps", eps)
        check_nonneg("weight_decay", weight_decay)
        check_betas(betas)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, fused, state_dtype)

    def _reference_step(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                        lists: dict[str, list]) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        _reference.lamb(params, grads, lists["exp_avg"], lists["exp_avg_sq"], lists["step"], lr=float(group["lr"]),
                        beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                        bias_correction=group["bias_correction"])


Lamb.FUSED = register(FusedOptimizer(
    "lamb", Lamb, (State("exp_avg", "exp_avgs"), State("exp_avg_sq", "exp_avg_sqs", signed=False)),
    (Hyper("lr"), Hyper("beta1", "betas", 0), Hyper("beta2", "betas", 1), Hyper("weight_decay"), Hyper("eps"),
     Hyper("bias_correction", type=bool)), whole_tensor_norms=True))
