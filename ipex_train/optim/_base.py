"""What Lamb and Lars share: argument checks, and the choice between the fused kernel and the reference code."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..base.options import OptionTypeError
from . import fused, loaded_state, state_formats
from .registry import FusedOptimizer


def check_nonneg(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a real number >= 0 (the message names ``name``)."""
    if isinstance(value, Tensor):
        value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def check_betas(betas: Any) -> None:
    """Raise ValueError unless ``betas`` is a pair of numbers in [0, 1)."""
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2
    if ok:
        for b in betas:
            b = float(b) if isinstance(b, Tensor) else b
            ok = ok and isinstance(b, (int, float)) and 0.0 <= b < 1.0
    if not ok:
        raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")


def can_fuse(params: list[Tensor]) -> bool:
    """Whether the fused kernel takes these parameters as they are (dense CPU float32/float64 with dense grads)."""
    return all(
        p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and not p.grad.is_sparse for p in params
    )


class FusableOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step runs either the fused C++ kernel or the plain PyTorch reference.

    Subclasses set ``FUSED`` (their entry, registered with :func:`.registry.register`) and define
    ``_reference_step(group, params, grads, state_lists)``, which runs their rule from ``_reference``.
    """

    FUSED: FusedOptimizer | None = None

    def __init__(self, params, defaults: dict[str, Any], fused: bool | None, state_dtype=None):
        if fused is not None and not isinstance(fused, bool):
            raise OptionTypeError(f"fused must be None, True or False, got {fused!r}")
        state_formats.parse(state_dtype, "state_dtype")
        defaults = dict(defaults, fused=fused)
        if state_dtype is not None:  # a group key only when asked for: checkpoints stay as they were otherwise
            defaults[state_formats.GROUP_KEY] = state_dtype
        super().__init__(params, defaults)

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict, with reduced-byte state (``state_dtype``) as fp32 tensors."""
        return state_formats.fp32_state_dict(self, super().state_dict())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group as torch does; its ``state_dtype`` key, when it has one, must be a valid format."""
        if isinstance(param_group, dict):
            state_formats.parse(param_group.get(state_formats.GROUP_KEY),
                                 f"{type(self).__name__}: param group key {state_formats.GROUP_KEY!r}")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, then store the state in each group's own ``state_dtype`` (the one this optimizer
        was created with, not the checkpoint's: see :func:`.state_formats.restore_settings`). The checkpoint's state
        is checked first (:mod:`.loaded_state`); a load that raises changes nothing."""
        loaded_state.check_checkpoint(self.FUSED, state_dict, self.param_groups,
                                       f"{type(self).__name__}.load_state_dict()")
        settings = state_formats.own_settings(self.param_groups)
        super().load_state_dict(state_dict)
        state_formats.restore_settings(self.param_groups, settings)
        fused.store_state_formats(self.FUSED, self.param_groups, self.state)

    def _use_fused(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        fused = group.get("fused")
        if state_formats.parse(group.get(state_formats.GROUP_KEY), "state_dtype") is not None:
            if fused is False or not can_fuse(params):
                raise RuntimeError(f"{type(self).__name__}(state_dtype={group[state_formats.GROUP_KEY]!r}) keeps "
                                   "reduced-byte state, which only the fused kernel steps: use fused=None/True with "
                                   "dense CPU float32 parameters (ipex_train.optimize() for bfloat16 models)")
            return True
        if fused is None:
            return can_fuse(params)
        if fused and not can_fuse(params):
            raise RuntimeError(
                f"{type(self).__name__}(fused=True) takes dense CPU float32/float64 parameters with dense grads; "
                "use fused=None to fall back to the reference implementation, or ipex_train.optimize() for "
                "bfloat16/float16 models"
            )
        return bool(fused)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if self._use_fused(group, params):
                fused.fused_step(self.FUSED, group, self.state, params, [None] * len(params), grads)
            else:
                self._reference_step(group, params, grads, fused.state_lists(self.FUSED, group, self.state, params))
        return loss
