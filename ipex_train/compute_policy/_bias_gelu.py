"""The native policy's routing of Hugging Face MLP up-projections + GELU to ``ipex_train.bias_gelu``: BERT-style
intermediate blocks (``BertIntermediate`` and every class with its very forward, ``intermediate_act_fn(dense(h))``)
and ViT-style MLPs (``ViTMLP`` and every class with its very forward: ``fc2(activation_fn(fc1(h)))``).

With the up-projection a plain ``nn.Linear`` with a bias and an exact (erf) GELU, the swapped forward (:mod:`._swap`,
on the instance; the class is untouched) computes ``F.linear(h, weight, bias.detach())`` and torch's GELU, the
class's forward bit for bit, through ``ipex_train.bias_gelu.gelu_with_bias_grad``, whose backward is one pass that
also returns the bias gradient (torch: gelu_backward, then a sum over the rows); a ViT-style MLP then calls ``fc2``
as a module. The bias stays in the GEMM because torch's GELU forward (oneDNN's eltwise kernel) beats the one-pass
bias + GELU kernel on Intel CPUs (docs/compute_policy.md). Since it skips calling
the up-projection and the activation as modules, any call with hooks on them, global module hooks, autocast,
another layer type or operands of other dtypes runs the class's own forward.

Which classes: those of ``transformers.models`` whose forward is at run time the very code checked here (its
docstring-free syntax tree hashed in :data:`_SHAPES`: transformers 5.24's BertIntermediate, shared by RoBERTa,
ELECTRA, XLM-R, DeBERTa, LayoutLM, VideoMAE, YOLOS and ~50 other classes of that release, and ViTMLP, shared by
DeiT, BEiT, Dinov2, ViTMAE and ~80 others, many of them over other activations, which the GELU check refuses).
Another release with other code there leaves the blocks unrouted. GELU's tanh approximation (``gelu_new``,
``gelu_pytorch_tanh``) and ``gelu_python`` are not taken: the kernel computes the erf form only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import bias_gelu as _fused
from .. import linear as _fused_linear
from ._source import digest
from ._swap import Swap, cast_as_pre_hooks, global_hooks, plain, plain_but_input_casts

# The digests (_source.digest) of the forwards this route reproduces, in transformers 5.24, and each one's
# (up-projection, activation, down-projection or None) attribute names. BertIntermediate: `hidden_states =
# self.dense(hidden_states); hidden_states = self.intermediate_act_fn(hidden_states); return ...`; ViTMLP: the same
# over fc1 and activation_fn, then `self.fc2(hidden_states)`.
_SHAPES = {
    "d60f3781ad76f95d": ("dense", "intermediate_act_fn", None),
    "2097f227af29a742": ("fc1", "activation_fn", "fc2"),
}

_DTYPES = (torch.bfloat16, torch.float32)


# class -> its _SHAPES entry or None, filled by routable(): a plain dict (not functools.cache) so that torch.compile
# traces the routed forward's lookup instead of the source hashing behind it.
_KNOWN: dict[type, tuple | None] = {}


def _shape(cls: type) -> tuple | None:
    """The attribute names of ``cls``'s forward where it is one this route reproduces (see :data:`_SHAPES`)."""
    if cls not in _KNOWN:
        _KNOWN[cls] = _SHAPES.get(digest(cls.forward))
    return _KNOWN[cls]


def _exact_gelu(act) -> bool:
    """transformers' GELUActivation over ``F.gelu`` (``ACT2FN["gelu"]``, not its ``use_gelu_python`` form) or
    ``nn.GELU(approximate="none")``, each with its class's own forward."""
    from transformers.activations import GELUActivation  # the route only sees modules of transformers.models

    if not isinstance(act, torch.nn.Module) or "forward" in vars(act):
        return False
    if type(act) is GELUActivation:
        return getattr(act, "act", None) is F.gelu
    return type(act) is torch.nn.GELU and act.approximate == "none"


def _linear(layer) -> bool:
    return type(layer) is torch.nn.Linear and isinstance(layer.bias, torch.Tensor)


def routable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face block whose class's forward is BertIntermediate's or ViTMLP's (checked by
    :data:`_SHAPES`), with its class's own forward, a plain ``nn.Linear`` with a bias as the up-projection and an exact
    GELU as the activation."""
    cls = type(module)
    if not (cls.__module__.startswith("transformers.models.") and "forward" not in vars(module)):
        return False
    shape = _shape(cls)
    return (shape is not None and _linear(getattr(module, shape[0], None))
            and _exact_gelu(getattr(module, shape[1], None)))


def _fusable(linear, act, x) -> bool:
    """Whether this call computes as the class does with the bias's gradient taken from the GELU: the submodules as at
    routing, without hooks (but optimize()'s input cast on the linear), no autocast (which would run the GEMM in its
    dtype), and x (as the linear would receive it), the weight and the bias CPU tensors of one dtype the kernel takes
    (F.linear with its bias would accept them, and its bf16 or fp32 output is what the kernel reads)."""
    if not (_linear(linear) and _exact_gelu(act) and plain_but_input_casts(linear) and plain(act)
            and not global_hooks() and not torch.is_autocast_enabled("cpu") and isinstance(x, torch.Tensor)):
        return False
    w, b = linear.weight, linear.bias
    return (x.dtype in _DTYPES and w.dtype == x.dtype and b.dtype == x.dtype and x.device.type == "cpu"
            and w.device.type == "cpu" and b.device.type == "cpu" and x.dim() >= 1 and x.numel() > 0)


def forward(self, hidden_states):
    """The routed forward: the up-projection and torch's GELU, the bias's gradient from the GELU's one-pass backward
    (then a ViT-style MLP's ``fc2`` as a module); every other call as the class computes it."""
    up, act, down = _shape(type(self))
    linear = getattr(self, up)
    x = cast_as_pre_hooks(linear, hidden_states) if isinstance(hidden_states, torch.Tensor) else hidden_states
    if not _fusable(linear, getattr(self, act), x):
        return type(self).forward(self, hidden_states)
    h = _fused.gelu_with_bias_grad(_fused_linear.linear(x, linear.weight, linear.bias.detach()), linear.bias)
    return h if down is None else getattr(self, down)(h)


def swap(module: torch.nn.Module) -> Swap:
    """Route ``module`` (see :func:`routable`) through the forward above; the handle's ``remove()`` undoes it."""
    return Swap(module, forward)
