""":class:`OptimizeConfig`: every option of :func:`ipex_train.optimize` in one frozen object.

``optimize(model, opt, dtype=torch.bfloat16, level="O1", ...)`` is shorthand for
``optimize(model, opt, config=OptimizeConfig(dtype=torch.bfloat16, level="O1", ...))``. Each field has an
environment variable, ``IPEX_TRAIN_<FIELD>`` (:mod:`ipex_train.base.envvars`, docs/environment.md), read for the options
left unset (:func:`resolve`, when optimize() starts; :meth:`OptimizeConfig.from_env`, which is how the Accelerate
plugin configures launched jobs). Precedence: a keyword argument or a config field > the environment > the default;
a keyword argument and a config field that set one option to different values are a ValueError. A config is written
out with :meth:`OptimizeConfig.to_dict`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from .base import envvars as _envvars
from .base import options as _options
from .base.choices import DTYPES, LEVELS, parse_bf16_compute, parse_frozen_weights, parse_nonfinite_grads

_WHERE = "optimize()"


def _check_dtype(value: Any) -> torch.dtype | None:
    if value not in DTYPES:
        raise ValueError(f"{_WHERE}: dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                         f"got {value!r}")
    return value


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
        nonfinite_grads: None/"skip" (a step whose gradients hold NaN or Inf changes no weight and no optimizer state,
            and is counted), "raise" (RuntimeError naming the parameter, nothing changed) or "off" (no check);
            stored lower case, "skip" as None.

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
    nonfinite_grads: str | None = None

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        object.__setattr__(self, "optimizer_state_dtype", _envvars.OPTIONS["optimizer_state_dtype"].parse(
            self.optimizer_state_dtype, f"{_WHERE}: optimizer_state_dtype"))
        if self.level not in LEVELS:
            raise ValueError(f"{_WHERE}: level must be 'O0' or 'O1', got {self.level!r}")
        for name in FLAGS:
            _options.check_bool(getattr(self, name), f"{_WHERE}: {name}")
        object.__setattr__(self, "bf16_compute", parse_bf16_compute(self.bf16_compute, f"{_WHERE}: bf16_compute"))
        frozen = parse_frozen_weights(self.frozen_weights, f"{_WHERE}: frozen_weights")
        object.__setattr__(self, "frozen_weights", None if frozen == "lossless" else frozen)
        guard = parse_nonfinite_grads(self.nonfinite_grads, f"{_WHERE}: nonfinite_grads")
        object.__setattr__(self, "nonfinite_grads", None if guard == "skip" else guard)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: Any) -> OptimizeConfig:
        """A config from ``options`` (field values; strings are also accepted as the environment spells them), each
        field not given or None read from ``IPEX_TRAIN_<FIELD>`` (e.g. ``IPEX_TRAIN_DTYPE=bf16``,
        ``IPEX_TRAIN_LEVEL=O0``, ``IPEX_TRAIN_FUSE_UPDATE_STEP=0``) in ``environ`` (default: the process
        environment), else the field's default.

        Environment spellings (any case): dtype bf16/bfloat16, fp32/float32, fp16/float16 or auto; level O0/O1;
        flags 1/0, true/false, yes/no, on/off or auto; bf16_compute auto/native/emulated; optimizer_state_dtype
        bf16/bfloat16, int8, fp32/float32 or auto; frozen_weights lossless/low_precision or auto; nonfinite_grads
        skip/raise/off or auto. Raises
        ValueError naming the option or the variable for a value
        it does not accept (TypeError for an option of the wrong type).
        """
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"OptimizeConfig.from_env: unknown option(s) {', '.join(unknown)}; "
                            f"the options are {', '.join(FIELDS)}")
        values = {}
        for name in FIELDS:
            value = _parse(name, options.get(name), name)
            if value is None:
                value = _envvars.OPTIONS[name].read(environ)
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

    def merged(self, **options: Any) -> OptimizeConfig:
        """This config, checked against keyword arguments given next to it (values or strings as the environment
        spells them; None: not given): each one given must agree with the config's field (ValueError naming both
        otherwise, also where the field holds its default); the config is returned unchanged."""
        unknown = sorted(set(options) - set(FIELDS))
        if unknown:
            raise TypeError(f"{_WHERE}: unknown option(s) {', '.join(unknown)}; the options are {', '.join(FIELDS)}")
        given = {name: _parse(name, value, name) if isinstance(value, str) else value
                 for name, value in options.items() if value is not None}
        checked = OptimizeConfig(**given)  # validates each keyword as a field
        for name in given:
            value, mine = getattr(checked, name), getattr(self, name)
            if value != mine:
                raise ValueError(f"{_WHERE}: {name}={value!r} conflicts with config.{name}={mine!r}; pass the option "
                                 "in the config or as a keyword argument, not both (or the same value in both)")
        return self


FIELDS = tuple(f.name for f in dataclasses.fields(OptimizeConfig))
TRAINING_ONLY = ("sycl", "step_in_backward", "optimizer_state_dtype", "frozen_weights", "nonfinite_grads")
FLAGS = ("conv_bn_folding", "linear_bn_folding", "replace_dropout_with_identity", "split_master_weight_for_bf16",
         "fuse_update_step", "auto_channels_last", "sycl",
         "step_in_backward")


def env_var(field: str) -> str:
    """The environment variable of config field ``field``."""
    return _envvars.OPTIONS[field].name


def resolve(config: OptimizeConfig | None = None, environ: Mapping[str, str] | None = None, training: bool = True,
            **keywords: Any) -> OptimizeConfig:
    """The configuration optimize() runs with: each option from its keyword argument (None: not given) or from
    ``config``'s field (None: not set; ``level`` is always set in a config), else from its ``IPEX_TRAIN_<FIELD>``
    variable in ``environ`` (default: the process environment, read here, once), else its default. With
    ``training=False`` the variables of the training-only options (:data:`TRAINING_ONLY`) are not read: a job's
    environment configures its training, and an inference optimize() in the same process ignores them.

    Raises TypeError for a ``config`` that is not an OptimizeConfig, ValueError naming both for a keyword argument
    and a config field that differ, and TypeError/ValueError naming the argument or the variable for a bad value.
    """
    given = {name: value for name, value in keywords.items() if value is not None}
    checked = OptimizeConfig(**given)  # keyword arguments take typed values only (strings are the environment's)
    given = {name: getattr(checked, name) for name in given}
    if not training:
        environ = _envvars.without(TRAINING_ONLY, environ)
    if config is None:
        return OptimizeConfig.from_env(environ, **given)
    if not isinstance(config, OptimizeConfig):
        raise TypeError(f"{_WHERE}: config must be an ipex_train.OptimizeConfig or None, got {type(config).__name__}")
    config.merged(**given)
    return OptimizeConfig.from_env(environ, **{name: getattr(config, name) for name in FIELDS})


def _parse(name: str, value: Any, where: str) -> Any:
    return None if value is None else _envvars.OPTIONS[name].parse(value, where)
