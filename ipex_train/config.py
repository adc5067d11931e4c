""":class:`OptimizeConfig`: every option of :func:`ipex_train.optimize` in one frozen object.

``optimize(model, opt, dtype=torch.bfloat16, level="O1", ...)`` is shorthand for
``optimize(model, opt, config=OptimizeConfig(dtype=torch.bfloat16, level="O1", ...))``. A config can also be read
from the environment (:meth:`OptimizeConfig.from_env`: one variable per field, ``IPEX_TRAIN_<FIELD>``, which is how
the Accelerate plugin configures launched jobs) and written out with :meth:`OptimizeConfig.to_dict`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from . import _options
from ._options import OptionTypeError
from .optim import _state_formats

DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
LEVELS = ("O0", "O1")
BF16_COMPUTE = ("native", "emulated")
FROZEN_WEIGHTS = ("lossless", "low_precision")
_DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
                "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
_WHERE = "optimize()"


def _check_dtype(value: Any) -> torch.dtype | None:
    if value not in DTYPES:
        raise ValueError(f"{_WHERE}: dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                         f"got {value!r}")
    return value


def _parse_dtype(value: Any, where: str) -> torch.dtype | None:
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _options.AUTO:
            return None
        if text in _DTYPE_NAMES:
            return _DTYPE_NAMES[text]
    elif value in DTYPES:
        return value
    raise ValueError(f"{where}={value!r} is not accepted; use torch.bfloat16 / 'bf16', torch.float32 / 'fp32', "
                     "torch.float16 / 'fp16', or None / 'auto'")


@dataclasses.dataclass(frozen=True)
class OptimizeConfig:
    """What :func:`ipex_train.optimize` does; each field is the optimize() keyword argument of the same name (see
    its docstring for the meaning). Flags left None take the level's default.

    Args:
        dtype: None/torch.float32 (fp32 training), torch.bfloat16 or torch.float16.
        level: "O0" (dtype handling only) or "O1" (every optimization).
        conv_bn_folding, linear_bn_folding, replace_dropout_with_identity: inference passes.
        split_master_weight_for_bf16: bf16 weights as bf16 top + int16 residual (else + fp32 master copies).
        fuse_update_step: the fused C++ optimizer step for the optimizers that have one.
        auto_channels_last: channels-last Conv2d/Conv3d weights.
        bf16_compute: None ("auto"), "native" or "emulated" (stored lower case; "auto" is stored as None).
        sycl: run the fused step on a SYCL queue (None defers to IPEX_TRAIN_SYCL when optimize() runs).
        step_in_backward: step each parameter inside backward and free its grad (None: off).
        optimizer_state_dtype: None/torch.float32 (fp32 optimizer state), torch.bfloat16 or "int8" (reduced-byte
            state; stored as None, torch.bfloat16 or "int8").
        frozen_weights: None/"lossless" (frozen fp32 weights keep their fp32 truth) or "low_precision" (frozen fp32
            weights are held in the low-precision dtype only); stored lower case, "lossless" as None.

    Raises :class:`TypeError` for a value of the wrong type (a non-bool flag) and ValueError for a value that is
    not accepted, naming the field.
    """

    dtype: torch.dtype | None = None
    level: str = "O1"
    conv_bn_folding: bool | None = None
    linear_bn_folding: bool | None = None
    replace_dropout_with_identity: bool | None = None
    split_master_weight_for_bf16: bool | None = None
    fuse_update_step: bool | None = None
    auto_channels_last: bool | None = None
    bf16_compute: str | None = None
    sycl: bool | None = None
    step_in_backward: bool | None = None
    optimizer_state_dtype: torch.dtype | str | None = None
    frozen_weights: str | None = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        object.__setattr__(self, "optimizer_state_dtype",
                           _state_formats.public(_state_formats.parse(self.optimizer_state_dtype,
                                                                      f"{_WHERE}: optimizer_state_dtype")))
        if self.level not in LEVELS:
            raise ValueError(f"{_WHERE}: level must be 'O0' or 'O1', got {self.level!r}")
        for name in FLAGS:
            _options.check_bool(getattr(self, name), f"{_WHERE}: {name}")
        if self.bf16_compute is not None:
            if not isinstance(self.bf16_compute, str):
                raise OptionTypeError(f"{_WHERE}: bf16_compute must be a string or None, got {self.bf16_compute!r}")
            text = self.bf16_compute.strip().lower()
            if text not in (*_options.AUTO, *BF16_COMPUTE):
                raise ValueError(f"{_WHERE}: bf16_compute must be None, 'auto', 'native' or 'emulated', got "
                                 f"{self.bf16_compute!r}")
            object.__setattr__(self, "bf16_compute", None if text in _options.AUTO else text)
        frozen = _options.parse_choice(self.frozen_weights, FROZEN_WEIGHTS, f"{_WHERE}: frozen_weights")
        object.__setattr__(self, "frozen_weights", None if frozen == "lossless" else frozen)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: Any) -> OptimizeConfig:
        """A config from ``options`` (field values; strings are also accepted as the environment spells them), each
        field not given or None read from ``IPEX_TRAIN_<FIELD>`` (e.g. ``IPEX_TRAIN_DTYPE=bf16``,
        ``IPEX_TRAIN_LEVEL=O0``, ``IPEX_TRAIN_FUSE_UPDATE_STEP=0``) in ``environ`` (default: the process
        environment), else the field's default.

        Environment spellings: dtype bf16/bfloat16, fp32/float32, fp16/float16 or auto; level O0/O1 (any case);
        flags 1/0, true/false, yes/no, on/off or auto; bf16_compute auto/native/emulated; frozen_weights
        lossless/low_precision. Raises ValueError naming
        the option or the variable for a value it does not accept (TypeError for an option of the wrong type).
        """
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"OptimizeConfig.from_env: unknown option(s) {', '.join(unknown)}; "
                            f"the options are {', '.join(FIELDS)}")
        values = {}
        for name in FIELDS:
            value = _parse(name, options.get(name), name)
            var = env_var(name)
            raw = _options.env(var) if environ is None else environ.get(var)
            if value is None and raw is not None:
                value = _parse(name, raw, var)
            if value is not None:
                values[name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (dtype as its name, e.g. "bfloat16"), JSON-serialisable;
        ``OptimizeConfig.from_env({}, **config.to_dict()) == config``."""
        out = dataclasses.asdict(self)
        if self.dtype is not None:
            out["dtype"] = str(self.dtype).removeprefix("torch.")
        if self.optimizer_state_dtype is torch.bfloat16:
            out["optimizer_state_dtype"] = "bfloat16"
        return out

    def merged(self, **shorthand: Any) -> OptimizeConfig:
        """This config, checked against optimize()'s keyword arguments given next to it: each one must be left at
        its default or agree with the config (ValueError naming it otherwise)."""
        given = OptimizeConfig(**shorthand)
        for f in dataclasses.fields(self):
            value = getattr(given, f.name)
            if value != f.default and value != getattr(self, f.name):
                raise ValueError(f"{_WHERE}: {f.name}={value!r} conflicts with config.{f.name}="
                                 f"{getattr(self, f.name)!r}; pass the option in the config or as a keyword "
                                 "argument, not both")
        return self


FIELDS = tuple(f.name for f in dataclasses.fields(OptimizeConfig))
FLAGS = ("conv_bn_folding", "linear_bn_folding", "replace_dropout_with_identity", "split_master_weight_for_bf16",
         "fuse_update_step", "auto_channels_last", "sycl",
         "step_in_backward")


def env_var(field: str) -> str:
    """The environment variable of config field ``field``."""
    return _options.PREFIX + field.upper()


def _parse(name: str, value: Any, where: str) -> Any:
    if value is None:
        return None
    if name == "dtype":
        return _parse_dtype(value, where)
    if name == "level":
        return _options.parse_choice(value, LEVELS, where, upper=True)
    if name == "bf16_compute":
        return _options.parse_choice(value, BF16_COMPUTE, where)
    if name == "frozen_weights":
        return _options.parse_choice(value, FROZEN_WEIGHTS, where)
    if name == "optimizer_state_dtype":
        return _state_formats.public(_state_formats.parse(value, where))
    return _options.parse_bool(value, where)
