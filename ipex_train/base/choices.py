"""Every choice list of the library, each defined once, with its one parser.

optimize()'s keyword arguments, :class:`ipex_train.OptimizeConfig`, the ``IPEX_TRAIN_*`` variables
(:mod:`.envvars`), :mod:`ipex_train.compute_policy` and the optimizer state formats all read these; nothing here
imports anything of ipex_train above :mod:`.options`.
"""
from __future__ import annotations

import enum
from typing import Any

import torch

from .options import AUTO, parse_choice

LEVELS = ("O0", "O1")
BF16_COMPUTE = ("native", "emulated")  # how bf16 matmuls are computed (ipex_train.compute_policy)
KERNEL_VARIANTS = ("avx512", "avx2", "scalar")
FROZEN_WEIGHTS = ("lossless", "low_precision")
NONFINITE_GRADS = ("skip", "raise", "off")  # what a training step does with NaN/Inf gradients
LOW_PRECISION = (torch.bfloat16, torch.float16)  # the dtypes optimize() stores weights in, with an fp32 truth
DTYPES = (None, torch.float32, *LOW_PRECISION)  # optimize()'s dtype
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
               "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(value: Any, where: str) -> torch.dtype | None:
    """optimize()'s ``dtype`` from a torch dtype or its name (bf16/bfloat16, fp32/float32, fp16/float16, auto)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in AUTO:
            return None
        if text in DTYPE_NAMES:
            return DTYPE_NAMES[text]
    elif value is None or value in DTYPE_NAMES.values():
        return value
    raise ValueError(f"{where}={value!r} is not accepted; use torch.bfloat16 / 'bf16', torch.float32 / 'fp32', "
                     "torch.float16 / 'fp16', or None / 'auto'")


def parse_bf16_compute(value: Any, where: str) -> str | None:
    """A bf16 compute policy ("native"/"emulated", any case) or None for None/"auto"/""."""
    return parse_choice(value, BF16_COMPUTE, where)


def parse_level(value: Any, where: str) -> str | None:
    """An optimization level ("O0"/"O1", any case) or None for None/"auto"/""."""
    return parse_choice(value, LEVELS, where, upper=True)


def parse_frozen_weights(value: Any, where: str) -> str | None:
    """How frozen weights are held ("lossless"/"low_precision", any case) or None for None/"auto"/""."""
    return parse_choice(value, FROZEN_WEIGHTS, where)


def parse_nonfinite_grads(value: Any, where: str) -> str | None:
    """The non-finite-gradient guard ("skip"/"raise"/"off", any case) or None for None/"auto"/""."""
    return parse_choice(value, NONFINITE_GRADS, where)


def parse_kernel_variant(value: Any, where: str) -> str | None:
    """A kernel variant ("avx512"/"avx2"/"scalar", any case) or None for None/"auto"/""."""
    return parse_choice(value, KERNEL_VARIANTS, where)


class StateFormat(enum.Enum):
    """A reduced-byte optimizer state format; its value is how the public options spell it (fp32 state is None)."""

    BF16 = torch.bfloat16
    INT8 = "int8"


StateFormatOrNone = StateFormat | None
STATE_FORMAT_NAMES = {"int8": StateFormat.INT8, "bf16": StateFormat.BF16, "bfloat16": StateFormat.BF16, "fp32": None,
                      "float32": None}
STATE_FORMATS_ACCEPTED = "None or torch.float32 (fp32 state), torch.bfloat16 / 'bf16', or 'int8'"


def parse_state_format(value: Any, name: str) -> StateFormatOrNone:
    """The state format named by ``value`` (None for fp32); ValueError naming ``name`` for anything else."""
    if value is None or value is torch.float32:
        return None
    if value is torch.bfloat16:
        return StateFormat.BF16
    if isinstance(value, StateFormat):
        return value
    if isinstance(value, str) and value.strip().lower() in STATE_FORMAT_NAMES:
        return STATE_FORMAT_NAMES[value.strip().lower()]
    raise ValueError(f"{name} must be {STATE_FORMATS_ACCEPTED}, got {value!r}")


def public_state_format(fmt: StateFormatOrNone) -> torch.dtype | str | None:
    """``fmt`` as the options spell it: None, torch.bfloat16 or "int8"."""
    return None if fmt is None else fmt.value


def parse_state_dtype(value: Any, where: str) -> torch.dtype | str | None:
    """optimize()'s ``optimizer_state_dtype`` in its public spelling (None, torch.bfloat16 or "int8")."""
    if not isinstance(value, str):
        return public_state_format(parse_state_format(value, where))
    if value.strip().lower() in AUTO:
        return None
    try:
        return public_state_format(parse_state_format(value, where))
    except ValueError:
        raise ValueError(f"{where}={value!r} is not accepted; use one of bf16, bfloat16, int8, fp32, float32, "
                         "auto") from None
