"""The native policy's routing of peft ``lora.Linear`` layers to ``ipex_train.lora``.

As for RMSNorm (``_rms_norm``), the forward is swapped on the instance and the swap's ``remove()`` deletes it. The
routed forward takes the fused path only where it computes peft's formula ``base(x) + lora_B(lora_A(x)) * scaling``
with nothing else in the call; every other call runs the class's own forward. peft stays optional: it is looked up
in ``sys.modules`` only (a ``lora.Linear`` exists only once peft is imported).
"""
from __future__ import annotations

import sys

import torch

from .. import lora as _fused
from ._mode import _EmulationMode
from ._swap import Swap, global_hooks
from ._swap import plain_but_input_casts as _plain


def _peft_linear():
    layer = sys.modules.get("peft.tuners.lora.layer")
    cls = getattr(layer, "Linear", None)
    return cls if isinstance(cls, type) else None


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft ``lora.Linear`` (not a subclass with its own forward) over a plain
    ``nn.Linear``, with its class's forward."""
    cls = _peft_linear()
    return (cls is not None and isinstance(module, cls) and type(module).forward is cls.forward
            and "forward" not in vars(module) and type(getattr(module, "base_layer", None)) is torch.nn.Linear
            and hasattr(module, "lora_variant"))


def _identity(dropout: torch.nn.Module) -> bool:
    """peft's ``nn.Identity`` (lora_dropout=0), or an ``nn.Dropout`` that returns its input (eval mode, or p=0)."""
    if type(dropout) is torch.nn.Identity:
        return _plain(dropout)
    return type(dropout) is torch.nn.Dropout and (dropout.p == 0 or not dropout.training) and _plain(dropout)


def _plain_context() -> bool:
    """No autocast (it would recast the matmuls' operands), no emulated scope (bf16 matmuls would be computed in
    fp32 forward but not in our backward), no global module hooks (the layers' calls would skip them)."""
    if torch.is_autocast_enabled("cpu") or global_hooks():
        return False
    return not any(isinstance(mode, _EmulationMode) for mode in torch.overrides._get_current_function_mode_stack())


def _adapter(layer) -> str | None:
    """The one adapter peft's forward would apply, when it applies plain LoRA through plain layers; else None."""
    if layer.disable_adapters or layer.merged or getattr(layer, "fan_in_fan_out", False):
        return None
    present = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(present) != 1:
        return None
    name = present[0]
    if name in layer.lora_variant or name not in layer.lora_B or name not in layer.lora_dropout:
        return None
    a, b = layer.lora_A[name], layer.lora_B[name]
    if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None or b.bias is not None:
        return None
    if not (_plain(layer.base_layer) and _plain(a) and _plain(b) and _identity(layer.lora_dropout[name])):
        return None
    scaling = layer.scaling.get(name)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        return None
    return name


# Named `forward`: pickling a bound method stores getattr(module, "forward"), which then finds a name.
def forward(self, x, *args, **kwargs):
    """The routed forward: one fused LoRA linear (``ipex_train.lora``) when the call is plain LoRA on inputs it
    supports, else the class's own forward (extra arguments such as ``adapter_names``, adapters disabled or
    merged, several or no active adapters, DoRA and other variants, dropout, an adapter bias, mixed dtypes)."""
    name = None if (args or kwargs or not isinstance(x, torch.Tensor) or not _plain_context()) else _adapter(self)
    if name is not None:
        base, a, b = self.base_layer, self.lora_A[name].weight, self.lora_B[name].weight
        if _fused.supports(x, base.weight, base.bias, a, b):
            return _fused.lora_linear(x, base.weight, base.bias, a, b, self.scaling[name])
    return type(self).forward(self, x, *args, **kwargs)


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
