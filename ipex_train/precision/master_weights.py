"""Where the fp32 truth of low-precision parameters lives, and the model hooks that keep it visible.

A low-precision parameter keeps its Parameter object; only ``param.data`` changes. Its exact fp32 value is held
by :class:`MasterWeights` as either

* an int16 *residual* (split bf16: ``param.data`` is the bf16 top, fp32 bits == (top << 16) + residual), or
* an fp32 *master* copy (bf16 without splitting, and every float16 parameter).

Frozen parameters (``requires_grad=False`` at optimize()) hold only what their values need: one already in bf16/fp16
is its own exact value and gets no residual or master; an fp32 one is converted with its truth (lossless, the
default) or, with ``frozen_weights="low_precision"``, to the low-precision dtype alone (its fp32 bits are dropped:
such a parameter cannot be trained later, see :meth:`MasterWeights.ensure_truth`). A frozen low-precision parameter
that is unfrozen later gets its truth when it is first stepped.

The same object serves the optimizer (``aux`` for the fused kernels, fp32 working copies for the non-fused path)
and the model's state_dict hooks (fp32 out, re-split in). The hooks are ``functools.partial`` objects over
module-level functions, so ``copy.deepcopy(model)`` copies the MasterWeights with the model and the copy's hooks
point at the copy's parameters.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ..base.choices import LOW_PRECISION
from ..base.ops import combine_bf16, split_bf16


def _set_data(p: Tensor, data: Tensor) -> None:
    # A grad left from before optimize() must follow the new dtype and layout, or the next backward cannot
    # accumulate into it.
    grad = p.grad
    if grad is not None:
        p.grad = None
    p.data = data
    if grad is not None:
        p.grad = torch.empty_like(data).copy_(grad)


def set_memory_format(p: Tensor, memory_format: torch.memory_format) -> None:
    """Re-lay ``p`` (an fp32/fp64 parameter without a MasterWeights entry) in ``memory_format``."""
    if not p.is_contiguous(memory_format=memory_format):
        _set_data(p, p.data.contiguous(memory_format=memory_format))


class MasterWeights:
    """The fp32 truth of a model's low-precision parameters (see the module docstring).

    ``split``: keep bf16 parameters as top + int16 residual (else bf16 + fp32 master). ``dtype``: the dtype
    optimize() converted to (None when it converted nothing). ``frozen_low_precision``: frozen fp32 parameters
    convert without their truth (optimize(frozen_weights="low_precision")). ``aux`` maps each low-precision
    Parameter to its residual or master; ``rounded`` maps each parameter converted without its truth to its name
    (filled by :meth:`register_hooks`); ``tied`` lists the state_dict key groups that name one parameter.
    """

    def __init__(self, dtype: torch.dtype | None, split: bool, frozen_low_precision: bool = False):
        self.dtype = dtype
        self.split = split
        self.frozen_low_precision = frozen_low_precision
        self.aux: dict[Tensor, Tensor] = {}
        self.rounded: dict[Tensor, str] = {}
        self.tied: list[list[str]] = []
        self._pending: dict[Tensor, Tensor] = {}

    def is_split(self, p: Tensor) -> bool:
        """Whether ``p`` is held as bf16 top + residual."""
        return p in self.aux and self.aux[p].dtype == torch.int16

    def convert(self, p: Tensor, dtype: torch.dtype, memory_format: torch.memory_format) -> None:
        """Turn fp32 parameter ``p`` into ``dtype`` (bf16/fp16) laid out in ``memory_format``, keeping its value
        (rounding it, without a truth, when ``p`` is frozen and ``frozen_low_precision`` is set)."""
        value = p.data.contiguous(memory_format=memory_format)
        if self.frozen_low_precision and not p.requires_grad:
            self.rounded[p] = ""
            _set_data(p, value.to(dtype))
        elif dtype == torch.bfloat16 and self.split:
            top, self.aux[p] = split_bf16(value)
            _set_data(p, top)
        else:
            self.aux[p] = value
            _set_data(p, value.to(dtype))

    def adopt(self, p: Tensor) -> None:
        """Give a trainable parameter that is already bf16/fp16 (a pure low-precision model, a param added later)
        an fp32 truth equal to its current value; no-op for other parameters, ones already held and frozen ones
        (their value is exact as it is; :meth:`ensure_truth` gives them one if they are ever stepped)."""
        if p.requires_grad:
            self._give_truth(p)

    def _give_truth(self, p: Tensor) -> bool:
        if p.dtype not in LOW_PRECISION or p in self.aux:
            return False
        if p.dtype == torch.bfloat16 and self.split:
            self.aux[p] = torch.zeros_like(p, dtype=torch.int16)
        else:
            self.aux[p] = p.data.float()
        return True

    def ensure_truth(self, params: Iterable[Tensor]) -> list[Tensor]:
        """Before stepping ``params``: give low-precision ones without a truth (frozen at optimize(), unfrozen
        since) their exact current value as truth; returns those. Raises RuntimeError, before giving any, for a
        parameter converted without its truth (frozen_weights="low_precision"): its fp32 bits are gone."""
        params = list(params)
        lost = [self.rounded[p] or tuple(p.shape) for p in params if p in self.rounded]
        if lost:
            raise RuntimeError(
                f"ipex_train: {len(lost)} parameter(s) being stepped ({', '.join(map(str, lost[:3]))}"
                f"{', ...' if len(lost) > 3 else ''}) were frozen at optimize(frozen_weights='low_precision'), "
                "which kept them in low precision without their fp32 value, so they cannot be trained; set "
                "requires_grad=True before optimize(), or use frozen_weights='lossless' (the default)")
        return [p for p in params if self._give_truth(p)]

    def fp32(self, p: Tensor) -> Tensor:
        """The exact fp32 value of ``p`` (the live master itself when there is one)."""
        if self.is_split(p):
            return combine_bf16(p.data, self.aux[p])
        return self.aux[p] if p in self.aux else p.data

    def store(self, p: Tensor, value: Tensor) -> None:
        """Set ``p`` (and its residual or master) to the fp32 ``value``; ``value`` may be the master itself."""
        if self.is_split(p):
            top, residual = split_bf16(value.to(torch.float32))
            p.data.copy_(top)
            self.aux[p].copy_(residual)
        elif p in self.aux:
            master = self.aux[p]
            if value is not master:
                master.copy_(value)
            p.data.copy_(master)
        else:
            p.data.copy_(value)

    def relocate(self, params: Iterable[Tensor], move: Callable[[Tensor], Tensor]) -> None:
        """Give ``params`` and their residuals or masters the storage ``move`` returns for each tensor (the tensor
        itself when it is already where it belongs), keeping the Parameter objects; a step backend's placement
        (ipex_train.xpu's SYCL backend moves them into USM shared memory)."""
        for p in params:
            old = p.data
            new = move(old)
            if new is not old:
                _set_data(p, new)
            if p in self.aux:
                self.aux[p] = move(self.aux[p])

    def register_hooks(self, model: nn.Module) -> None:
        """Hook every module of ``model`` that registers a held (or low-precision: it may get a truth when
        unfrozen) parameter: state_dict in fp32, load_state_dict re-splitting; make tied weights share one tensor
        in state_dict; name the parameters converted without their truth."""
        def held(p: Tensor | None) -> bool:
            return p is not None and (p in self.aux or p.dtype in LOW_PRECISION)

        for m in model.modules():
            if not any(held(p) for p in m._parameters.values()):
                continue
            m.register_state_dict_post_hook(functools.partial(_state_dict_post_hook, self))
            m.register_load_state_dict_pre_hook(functools.partial(_load_pre_hook, self))
            m.register_load_state_dict_post_hook(functools.partial(_load_post_hook, self))
        names: dict[Tensor, list[str]] = defaultdict(list)
        for name, p in model.named_parameters(remove_duplicate=False):
            if held(p):
                names[p].append(name)
            if p in self.rounded and not self.rounded[p]:
                self.rounded[p] = name
        self.tied = [keys for keys in names.values() if len(keys) > 1]
        if self.tied:
            model.register_state_dict_post_hook(functools.partial(_share_tied_post_hook, self))


def _state_dict_post_hook(masters: MasterWeights, module: nn.Module, state_dict: dict, prefix: str,
                          local_metadata: dict) -> None:
    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and p in masters.aux and key in state_dict:
            state_dict[key] = masters.fp32(p).detach()


def _share_tied_post_hook(masters: MasterWeights, module: nn.Module, state_dict: dict, prefix: str,
                          local_metadata: dict) -> None:
    # Each owner converted its own copy; tied weights must stay one tensor, as in a plain model's state_dict.
    for keys in masters.tied:
        present = [prefix + k for k in keys if prefix + k in state_dict]
        for key in present[1:]:
            state_dict[key] = state_dict[present[0]]


def _load_pre_hook(masters: MasterWeights, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                   strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    # torch copies the incoming fp32 value into the bf16 top (rounded) and cannot reach the residual; remember the
    # full value and store it after the load. Shape errors are left to torch's own checks.
    if local_metadata.get("assign_to_params_buffers", False):
        error_msgs.append(f"{prefix or 'model'}: load_state_dict(assign=True) would replace parameters that "
                          "ipex_train.optimize() keeps in low precision; load with assign=False")
        return
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        if p is not None and p in masters.aux and isinstance(value, Tensor) and value.shape == p.shape:
            masters._pending[p] = value


def _load_post_hook(masters: MasterWeights, module: nn.Module, incompatible_keys) -> None:
    with torch.no_grad():
        for p in module._parameters.values():
            value = masters._pending.pop(p, None) if p is not None else None
            if value is not None:
                masters.store(p, value.to(device=p.device))
