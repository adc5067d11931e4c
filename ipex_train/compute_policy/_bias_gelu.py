"""The native policy's routing of Hugging Face BERT-style intermediate blocks (``BertIntermediate`` and every class
with the very same forward) to ``ipex_train.bias_gelu``.

Such a block computes ``intermediate_act_fn(dense(h))``. With ``dense`` a plain ``nn.Linear`` and an exact (erf)
GELU, the swapped forward (:mod:`._swap`, on the instance; the class is untouched) computes ``F.linear(h,
dense.weight)`` without the bias (under the native policy a plain bf16 GEMM, as ``dense`` would run with its bias
in it) and then the bias add and the GELU as one fused op, whose backward also reduces the bias gradient. Since it
skips calling ``dense`` and the activation as modules, any call with hooks on them, global module hooks, autocast,
another layer type or operands of other dtypes runs the class's own forward.

Which classes: those of ``transformers.models`` whose forward is at run time the very code checked here (its
docstring-free syntax tree hashed in :data:`_CHECKED`: transformers 5.24's BertIntermediate, shared by RoBERTa,
ELECTRA, XLM-R, DeBERTa, LayoutLM, VideoMAE, YOLOS and ~50 other classes of that release). Another release with other
code there leaves the blocks unrouted. GELU's tanh approximation (``gelu_new``, ``gelu_pytorch_tanh``) and
``gelu_python`` are not taken: the kernel computes the erf form only.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import bias_gelu as _fused
from ._source import digest
from ._swap import Swap, cast_as_pre_hooks, global_hooks, plain, plain_but_input_casts

# The digest (_source.digest) of BertIntermediate.forward in transformers 5.24:
# `hidden_states = self.dense(hidden_states); hidden_states = self.intermediate_act_fn(hidden_states); return ...`.
_CHECKED = "d60f3781ad76f95d"

_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def _checked(cls: type) -> bool:
    return digest(cls.forward) == _CHECKED


def _exact_gelu(act) -> bool:
    """transformers' GELUActivation over ``F.gelu`` (``ACT2FN["gelu"]``, not its ``use_gelu_python`` form) or
    ``nn.GELU(approximate="none")``, each with its class's own forward."""
    from transformers.activations import GELUActivation  # the route only sees modules of transformers.models

    if not isinstance(act, torch.nn.Module) or "forward" in vars(act):
        return False
    if type(act) is GELUActivation:
        return getattr(act, "act", None) is F.gelu
    return type(act) is torch.nn.GELU and act.approximate == "none"


def _linear(dense) -> bool:
    return type(dense) is torch.nn.Linear and isinstance(dense.bias, torch.Tensor)


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face block whose class's forward is BertIntermediate's (checked by
    :data:`_CHECKED`), with its class's own forward, a plain ``nn.Linear`` with a bias as ``dense`` and an exact GELU
    as ``intermediate_act_fn``."""
    cls = type(module)
    return (cls.__module__.startswith("transformers.models.") and "forward" not in vars(module)
            and _linear(getattr(module, "dense", None)) and _exact_gelu(getattr(module, "intermediate_act_fn", None))
            and _checked(cls))


def _fusable(self, x) -> bool:
    """Whether this call computes as the class does with the bias moved out of the GEMM: the submodules as at
    routing, without hooks (but optimize()'s input cast on ``dense``), no autocast (which would run the GEMM in its
    dtype), and x (as ``dense`` would receive it), the weight and the bias CPU tensors of one dtype the kernel takes
    (F.linear with its bias would accept them, and its bf16 or fp32 output is what the kernel reads)."""
    dense, act = self.dense, self.intermediate_act_fn
    if not (_linear(dense) and _exact_gelu(act) and plain_but_input_casts(dense) and plain(act) and not global_hooks()
            and not torch.is_autocast_enabled("cpu") and isinstance(x, torch.Tensor)):
        return False
    w, b = dense.weight, dense.bias
    return (x.dtype in _DTYPES and w.dtype == x.dtype and b.dtype == x.dtype and x.device.type == "cpu"
            and w.device.type == "cpu" and b.device.type == "cpu" and x.dim() >= 1 and x.numel() > 0)


def forward(self, hidden_states):
    """The routed forward: the GEMM without its bias, then bias + GELU fused; every other call as the class
    computes it."""
    x = cast_as_pre_hooks(self.dense, hidden_states) if isinstance(hidden_states, torch.Tensor) else hidden_states
    if not _fusable(self, x):
        return type(self).forward(self, hidden_states)
    h = F.linear(x, self.dense.weight)
    return _fused.bias_gelu(h, self.dense.bias)


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
