"""Every ``IPEX_TRAIN_*`` environment variable: its name, the values it accepts, its default, and who reads it when.

The one place the library names and parses these variables (docs/environment.md is the user's list). Every value
is case-insensitive and surrounding spaces are ignored; ``auto`` and an empty value mean "not set". A value that is
not accepted is a ValueError naming the variable and the accepted values, raised by the reader that needs it
(optimize(), the kernel call, ...), never by ``import ipex_train``.

Two regimes, by what a variable configures:

* :data:`OPTIONS`, one variable per field of :class:`ipex_train.OptimizeConfig` (``IPEX_TRAIN_<FIELD>``): read once,
  when optimize() starts, for each option that neither a keyword argument nor the ``config=`` argument sets
  (precedence: keyword or config field > environment > default); also by ``OptimizeConfig.from_env`` and the
  Accelerate plugin. ``IPEX_TRAIN_BF16_COMPUTE`` and ``IPEX_TRAIN_SYCL`` are also read by
  ``compute_policy.resolve()`` / ``xpu.enabled()`` when those are called without a choice.
* Process settings: :data:`KERNEL` (applied at import, a bad value reported at the first kernel call or
  optimize()), :data:`ONEDNN_FUSION`, :data:`SYCL_DEVICE`, :data:`XPU_VERBOSE_BUILD` (read when used).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from . import ops as _ops
from .choices import (
    parse_bf16_compute,
    parse_dtype,
    parse_frozen_weights,
    parse_kernel_variant,
    parse_level,
    parse_nonfinite_grads,
    parse_state_dtype,
)
from .options import parse_bool

PREFIX = "IPEX_TRAIN_"
_SWITCH = "1/0, true/false, yes/no, on/off, auto"


def _parse_text(value: str, where: str) -> str | None:
    text = value.strip().lower()
    return text or None


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: ``name``, the ``values`` it accepts and its ``default`` (as the docs list them),
    ``read_by`` (what reads it, and when) and ``parse`` (``parse(value, where)``: the value as the reader uses it,
    None for "not set"; ValueError naming ``where`` otherwise)."""

    name: str
    values: str
    default: str
    read_by: str
    parse: Callable[[Any, str], Any]

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text in ``environ`` (default: the process environment), or None when it is unset."""
        return (os.environ if environ is None else environ).get(self.name)

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value in ``environ`` (default: the process environment); None when unset, empty or auto."""
        raw = self.raw(environ)
        return None if raw is None else self.parse(raw, self.name)


_AT_OPTIMIZE = "optimize() when it starts, if no keyword argument or config field sets the option"


def _option(field: str, values: str, default: str, parse: Callable[[Any, str], Any], also: str = "") -> Variable:
    return Variable(PREFIX + field.upper(), values, default, _AT_OPTIMIZE + also, parse)


BF16_COMPUTE = _option("bf16_compute", "auto, native, emulated", "auto (native iff the CPU has bf16 units)",
                       parse_bf16_compute, "; compute_policy.resolve() called without a policy, each call")
SYCL = _option("sycl", _SWITCH, "off", parse_bool, "; ipex_train.xpu.enabled() called without a flag")

# One variable per OptimizeConfig field, in the order of the fields.
OPTIONS: dict[str, Variable] = {v.name.removeprefix(PREFIX).lower(): v for v in (
    _option("dtype", "bf16/bfloat16, fp32/float32, fp16/float16, auto", "auto (fp32 training)", parse_dtype),
    _option("level", "O0, O1", "O1", parse_level),
    _option("conv_bn_folding", _SWITCH, "the level's (on at O1, inference only)", parse_bool),
    _option("linear_bn_folding", _SWITCH, "the level's (on at O1, inference only)", parse_bool),
    _option("replace_dropout_with_identity", _SWITCH, "the level's (on at O1, inference only)", parse_bool),
    _option("split_master_weight_for_bf16", _SWITCH, "the level's (on at O1)", parse_bool),
    _option("fuse_update_step", _SWITCH, "the level's (on at O1)", parse_bool),
    _option("auto_channels_last", _SWITCH, "enable_/disable_auto_channels_last(), else the level's", parse_bool),
    BF16_COMPUTE,
    SYCL,
    _option("step_in_backward", _SWITCH, "off", parse_bool),
    _option("optimizer_state_dtype", "bf16/bfloat16, int8, fp32/float32, auto", "auto (fp32 state)",
            parse_state_dtype),
    _option("frozen_weights", "lossless, low_precision, auto", "auto (lossless)",
            parse_frozen_weights),
    _option("nonfinite_grads", "skip, raise, off, auto", "auto (skip)", parse_nonfinite_grads),
)}

KERNEL = Variable(PREFIX + "KERNEL", "auto, avx512, avx2, scalar", "auto (the best variant this CPU runs)",
                  "import ipex_train (applied then); a value that cannot be honoured is raised by optimize() and "
                  "by every kernel call until ipex_train.set_kernel_variant() chooses one",
                  parse_kernel_variant)
ONEDNN_FUSION = Variable(PREFIX + "ONEDNN_FUSION", _SWITCH, "on",
                         "optimize() for inference (when it starts), inference.export() and inference.load(), each "
                         "call, unless enable_onednn_fusion() was called", parse_bool)
SYCL_DEVICE = Variable(PREFIX + "SYCL_DEVICE", "a dpctl filter string, e.g. opencl:cpu", "auto (first GPU with USM "
                       "shared allocations, else the first such device)",
                       "ipex_train.xpu when it creates the default SYCL queue (the first optimize(sycl=True)), and "
                       "ipex_train.info()", _parse_text)
XPU_VERBOSE_BUILD = Variable(PREFIX + "XPU_VERBOSE_BUILD", _SWITCH, "off",
                             "ipex_train.xpu when it first builds its SYCL host extension (compiler output shown)",
                             parse_bool)

VARIABLES: tuple[Variable, ...] = (*OPTIONS.values(), KERNEL, ONEDNN_FUSION, SYCL_DEVICE, XPU_VERBOSE_BUILD)


def without(options, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: the process environment) less the variables of the OptimizeConfig fields ``options``."""
    names = {OPTIONS[name].name for name in options}
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k not in names}


def apply_kernel_variable() -> None:
    """Apply :data:`KERNEL` to the kernels (at ``import ipex_train``). A value that cannot be honoured (unknown, or
    a variant this CPU lacks) does not raise here: it is recorded, and optimize() and every kernel call raise it
    (ValueError naming the variable and the accepted values) until a variant is set explicitly."""
    raw = KERNEL.raw()
    try:
        name = KERNEL.parse(raw, KERNEL.name) if raw is not None else None
    except ValueError as e:
        _ops.ops.set_kernel_variant_error(str(e))
        return
    if name is None:
        return
    try:
        _ops.set_kernel_variant(name)
    except RuntimeError as e:  # a variant this CPU cannot run
        _ops.ops.set_kernel_variant_error(
            f"{KERNEL.name}={raw!r} is not accepted on this CPU ({e}); use one of auto, "
            f"{', '.join(_ops.supported_kernel_variants())}")
