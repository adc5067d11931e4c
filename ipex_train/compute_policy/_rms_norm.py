"""The native policy's routing of Hugging Face Llama-family RMSNorm modules to ``ipex_train.rms_norm``.

The module's forward is swapped on the instance (the class is untouched) and the swap's ``remove()`` deletes the
instance attribute again, so detaching leaves the module exactly as it was.
"""
from __future__ import annotations

import types
import weakref

import torch

from .. import rms_norm as _fused

# Hugging Face RMSNorm classes whose forward is exactly LlamaRMSNorm's (fp32 normalization, cast back to the input
# dtype, then `self.weight * ...`), checked in the transformers 5.x source. Not Gemma's (`1 + weight`, computed in
# fp32) nor OLMo-2's (`(weight * h).to(dtype)`), which round differently.
LLAMA_FORMULA = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm", "Phi3RMSNorm",
})


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face RMSNorm of :data:`LLAMA_FORMULA` with its class's own forward."""
    cls = type(module)
    return (cls.__name__ in LLAMA_FORMULA and cls.__module__.startswith("transformers.models.")
            and "forward" not in vars(module) and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


# Named `forward`: pickling a bound method stores getattr(module, "forward"), which then finds a name.
def forward(self, hidden_states):
    """The routed forward: bf16 or fp32 CPU input through the fused kernel, any other through the class's own
    forward."""
    if not _fused.supports(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)
    return _fused.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class Swap:
    """The routed forward set on one module; ``remove()`` restores the class's (idempotent). Other module routes
    subclass it with their own ``_function`` (a module-level function named ``forward``)."""

    _function = staticmethod(forward)

    def __init__(self, module: torch.nn.Module):
        module.forward = types.MethodType(self._function, module)
        self._module = weakref.ref(module)

    def remove(self) -> None:
        """Delete the instance-level forward, if it is still ours."""
        module = self._module()
        if module is None:
            return
        bound = vars(module).get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ is self._function:
            del module.forward
