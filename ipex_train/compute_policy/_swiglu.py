"""The native policy's routing of Hugging Face Llama-family MLPs (``LlamaMLP`` and the classes with the very same
forward) to ``ipex_train.swiglu``.

Such a block computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. The swapped forward (:mod:`._swap`, on the
instance; the class is untouched) still calls ``self.gate_proj``, ``self.up_proj`` and ``self.down_proj`` as
modules (so their hooks, peft's LoRA layers and the policy's own routes of them still apply) and fuses only
``silu(gate) * up``; any call it would not compute as the class does runs the class's own forward, or, once the
projections have run, the class's remaining ops.
"""
from __future__ import annotations

import torch

from .. import swiglu as _fused
from ._swap import Swap, global_hooks, plain, shared_input_cast

# Hugging Face classes whose forward is exactly LlamaMLP's (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`), checked
# in the transformers 5.x source by an AST comparison of the forward bodies (tests/test_swiglu_route.py repeats it
# against the installed transformers). Many more classes share that forward (Gemma's too, over GELU, which the
# activation check below refuses); they are not listed until checked the same way.
LLAMA_MLP = frozenset({
    "LlamaMLP", "MistralMLP", "MinistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP", "Olmo2MLP",
    "SmolLM3MLP", "GraniteMLP",
})


def _silu(act) -> bool:
    """transformers' SiLU (``ACT2FN["silu"]``) or torch's, with its class's own forward."""
    from transformers.activations import SiLUActivation  # the route only sees modules of transformers.models

    return type(act) in (SiLUActivation, torch.nn.SiLU) and "forward" not in vars(act)


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face MLP of :data:`LLAMA_MLP` with its class's own forward, module
    projections and a SiLU activation."""
    cls = type(module)
    if not (cls.__name__ in LLAMA_MLP and cls.__module__.startswith("transformers.models.")
            and "forward" not in vars(module)):
        return False
    projections = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    return all(isinstance(p, torch.nn.Module) for p in projections) and _silu(getattr(module, "act_fn", None))


def _fusable(self) -> bool:
    """What can be checked before the projections run: the activation as at routing, without hooks, and no
    autocast (under which the projections' outputs, and so silu's and the product's dtypes, are autocast's)."""
    return _silu(self.act_fn) and plain(self.act_fn) and not global_hooks() and not torch.is_autocast_enabled("cpu")


def forward(self, x):
    """The routed forward: the projections as before, ``silu(gate) * up`` fused where both are bf16 or fp32 CPU
    tensors of one dtype and shape; every other call as the class computes it."""
    if not _fusable(self):
        return type(self).forward(self, x)
    x = shared_input_cast((self.gate_proj, self.up_proj), x)  # an fp32 norm output cast once for both
    gate = self.gate_proj(x)
    up = self.up_proj(x)
    if not _fused.supports(gate, up):
        return self.down_proj(self.act_fn(gate) * up)  # the class's remaining ops
    return self.down_proj(_fused.silu_mul(gate, up))


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
