"""The checks every option shares (environment variables are named and read in :mod:`ipex_train.base.envvars`).

Mistakes are reported one way everywhere: a value of the wrong type is an :class:`OptionTypeError` (a TypeError),
a value of the right type that is not accepted (an unknown name, a bad environment string) is a ValueError, and
both name the argument or the variable.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
AUTO = ("auto", "")


class OptionTypeError(TypeError, ValueError):
    """An option of the wrong type. A TypeError; also a ValueError because Lamb(fused=...) and the Accelerate
    plugin raised ValueError for it before, and code catching that must keep working."""


def parse_bool(value: Any, where: str) -> bool | None:
    """``value`` as a switch: a bool, None, or a string: 1/true/yes/on, 0/false/no/off (any case), or None for an
    empty string or ``auto``. Raises ValueError naming ``where`` for another string."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise OptionTypeError(f"{where} must be True, False or None, got {value!r}")
    text = value.strip().lower()
    if text in TRUE or text in FALSE or text in AUTO:
        return True if text in TRUE else False if text in FALSE else None
    raise ValueError(f"{where}={value!r} is not accepted; use one of {', '.join(TRUE + FALSE)} or auto")


def check_bool(value: Any, where: str) -> bool | None:
    """``value`` itself when it is True, False or None; :class:`OptionTypeError` naming ``where`` otherwise."""
    if value is not None and not isinstance(value, bool):
        raise OptionTypeError(f"{where} must be True, False or None, got {value!r}")
    return value


def parse_choice(value: Any, choices: Iterable[str], where: str, upper: bool = False) -> str | None:
    """``value`` (a string, any case, or None) as one of ``choices``; ``auto`` and an empty string give None.
    Raises :class:`OptionTypeError` for a non-string and ValueError for another string, naming ``where``."""
    if value is None:
        return None
    choices = tuple(choices)
    if not isinstance(value, str):
        raise OptionTypeError(f"{where} must be a string ({', '.join(choices)}) or None, got {value!r}")
    text = value.strip()
    if text.lower() in AUTO:
        return None
    text = text.upper() if upper else text.lower()
    if text not in choices:
        raise ValueError(f"{where}={value!r} is not accepted; use one of {', '.join(('auto',) + choices)}")
    return text


def check_model_and_optimizer(model: Any, optimizer: Any, where: str) -> None:
    """TypeError naming ``where`` unless ``model`` is a torch.nn.Module and ``optimizer`` a torch.optim.Optimizer or
    None (the one type check of every public function taking a model and an optimizer)."""
    import torch  # here: this module is read by the option parsers, which need no torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
