"""Automatic channels-last for convolutions: the process-wide switch and which weights it applies to.

oneDNN's CPU convolutions run fastest, forward and backward, on channels-last (NHWC / NDHWC) tensors; a conv
whose weight is channels-last makes its output channels-last too, so the layout spreads through the network
without touching the user's inputs.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

_enabled: bool | None = None  # None: follow the optimize() level


def enable_auto_channels_last() -> None:
    """Make optimize() lay Conv2d/Conv3d weights out channels-last unless its ``auto_channels_last`` says no."""
    global _enabled
    _enabled = True


def disable_auto_channels_last() -> None:
    """Make optimize() leave memory formats alone unless its ``auto_channels_last`` asks for channels-last."""
    global _enabled
    _enabled = False


def resolve(flag: bool | None, level_default: bool) -> bool:
    """Whether optimize() applies channels-last: its explicit flag, else the global switch, else the level."""
    if flag is not None:
        return flag
    return level_default if _enabled is None else _enabled


def memory_formats(model: nn.Module) -> dict[Tensor, torch.memory_format]:
    """The channels-last format of every Conv2d/Conv3d weight of ``model``."""
    formats = {}
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)) and m.weight is not None:
            formats[m.weight] = torch.channels_last if m.weight.dim() == 4 else torch.channels_last_3d
    return formats
