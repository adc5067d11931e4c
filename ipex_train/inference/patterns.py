"""The FP32/BF16 oneDNN Graph fusion patterns IPEX documented, as tiny modules, and a survey of which of them this
torch build and CPU actually fuse (what it fuses depends on both, BF16 in particular on native bf16 support).

Each pattern is exported with ipex_train.inference.export and counted as fused when one fusion group holds all
of its expected ops. ``python -m benchmarks.studies.onednn_pattern_survey`` prints the survey as JSON.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .jit import _fusion_group_ops, export_torchscript, fused_groups

CONV_LIKE = ("conv1d", "conv2d", "conv3d", "linear", "convtranspose2d", "convtranspose3d")

# eltwise name -> (function applied to the layer output, op kind expected inside the fusion group)
ELTWISE = {
    "abs": (torch.abs, "aten::abs"),
    "clamp": (lambda y: torch.clamp(y, -0.5, 0.5), "aten::clamp"),
    "elu": (F.elu, "aten::elu"),
    "exp": (torch.exp, "aten::exp"),
    "gelu": (F.gelu, "aten::gelu"),
    "hardtanh": (F.hardtanh, "aten::hardtanh"),
    "hardswish": (F.hardswish, "aten::hardswish"),
    "log": (torch.log, "aten::log"),
    "mish": (F.mish, "aten::mish"),
    "sigmoid": (torch.sigmoid, "aten::sigmoid"),
    "pow": (lambda y: torch.pow(y, 2.0), "aten::pow"),
    "relu": (torch.relu, "aten::relu"),
    "round": (torch.round, "aten::round"),
    "sqrt": (torch.sqrt, "aten::sqrt"),
    "square": (torch.square, "aten::square"),
    "tanh": (torch.tanh, "aten::tanh"),
    "leaky_relu": (lambda y: F.leaky_relu(y, 0.1), "aten::leaky_relu"),
    # oneDNN Graph has no SiLU op: the bridge maps it to sigmoid * mul inside the group.
    "silu": (F.silu, ("aten::sigmoid", "aten::mul")),
}

_CHANNELS = 8


def _layer(kind):
    """A shape-preserving layer of the given kind (so its output can be added to its input)."""
    if kind == "linear":
        return nn.Linear(_CHANNELS, _CHANNELS)
    dims = int(kind[-2])
    cls = {"conv": (nn.Conv1d, nn.Conv2d, nn.Conv3d), "convtranspose": (None, nn.ConvTranspose2d,
                                                                      nn.ConvTranspose3d)}[kind[:-2]][dims - 1]
    return cls(_CHANNELS, _CHANNELS, 3, padding=1)


def _layer_input(kind):
    if kind == "linear":
        return torch.randn(4, _CHANNELS)
    dims = int(kind[-2])
    return torch.randn((2, _CHANNELS) + (6,) * dims)


class _Apply(nn.Module):
    def __init__(self, fn, **layers):
        super().__init__()
        self.fn = fn
        for name, layer in layers.items():
            self.add_module(name, layer)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


@dataclass
class Pattern:
    """One fusion pattern: a module factory, its inputs, and the op kinds one fusion group must hold."""

    name: str
    make: object
    inputs: object
    expected_ops: tuple

    def build(self, dtype=torch.float32):
        """(eval-mode module, example inputs) in dtype."""
        return self.make().eval().to(dtype), tuple(x.to(dtype) for x in self.inputs())


def _layer_op(kind):
    return "aten::linear" if kind == "linear" else "aten::_convolution"


def catalogue():
    """Every FP32/BF16 pattern of the IPEX graph-optimization list (seed 000), one Pattern each."""
    out = []
    for kind in CONV_LIKE:
        for name, (fn, ops) in ELTWISE.items():
            ops = ops if isinstance(ops, tuple) else (ops,)
            out.append(Pattern(f"{kind}+{name}", lambda k=kind, f=fn: _Apply(lambda s, x: f(s.layer(x)),
                                                                             layer=_layer(k)),
                               lambda k=kind: (_layer_input(k),), (_layer_op(kind),) + ops))
        out.append(Pattern(f"{kind}+sigmoid+mul",
                           lambda k=kind: _Apply(lambda s, x: s.layer(x) * torch.sigmoid(s.layer(x)),
                                                 layer=_layer(k)),
                           lambda k=kind: (_layer_input(k),), (_layer_op(kind), "aten::sigmoid", "aten::mul")))
    for kind in ("conv1d", "conv2d", "conv3d", "linear"):
        out.append(Pattern(f"{kind}+add", lambda k=kind: _Apply(lambda s, x: s.layer(x) + x, layer=_layer(k)),
                           lambda k=kind: (_layer_input(k),), (_layer_op(kind), "aten::add")))
    for kind in ("conv1d", "conv2d", "conv3d"):
        out.append(Pattern(f"{kind}+add+relu",
                           lambda k=kind: _Apply(lambda s, x: torch.relu(s.layer(x) + x), layer=_layer(k)),
                           lambda k=kind: (_layer_input(k),), (_layer_op(kind), "aten::add", "aten::relu")))
    out.append(Pattern("add+layernorm", lambda: _Apply(lambda s, a, b: s.norm(a + b), norm=nn.LayerNorm(16)),
                       lambda: (torch.randn(4, 16), torch.randn(4, 16)), ("aten::add", "aten::layer_norm")))
    out.append(Pattern("div+add+softmax", lambda: _Apply(lambda s, a, m: torch.softmax(a / 8.0 + m, -1)),
                       lambda: (torch.randn(2, 4, 16, 16), torch.randn(2, 1, 1, 16)),
                       ("aten::div", "aten::add", "aten::softmax")))
    # Three projections of one input (Q, K, V); freezing may already concatenate them into one linear.
    out.append(Pattern("linear+linear+linear",
                       lambda: _Apply(lambda s, x: (s.q(x), s.k(x), s.v(x)), q=nn.Linear(16, 16),
                                      k=nn.Linear(16, 16), v=nn.Linear(16, 16)),
                       lambda: (torch.randn(4, 16),), ("aten::linear", "aten::linear", "aten::linear")))
    out.append(Pattern("view+transpose+contiguous+view",
                       lambda: _Apply(lambda s, x: x.view(2, 16, 4, 16).transpose(1, 2).contiguous().view(8, 16, 16)),
                       lambda: (torch.randn(2, 16, 64),),
                       ("aten::view", "aten::transpose", "aten::contiguous", "aten::view")))
    return out


def check(pattern, dtype=torch.float32):
    """Export one pattern and classify it: returns {"status": "fused" | "partial" | "not fused", "groups": [...],
    "max_abs_err": float}. "partial" means fusion groups exist but none holds every expected op."""
    torch.manual_seed(0)
    model, inputs = pattern.build(dtype)
    with torch.no_grad():
        want = model(*inputs)
        scripted = export_torchscript(model, inputs, check_trace=False)
        got = scripted(*inputs)
    groups = fused_groups(scripted, inputs)
    ops = [_fusion_group_ops(g) for g in groups]
    if any(_holds(g, pattern.expected_ops) for g in ops):
        status = "fused"
    else:
        status = "partial" if groups else "not fused"
    err = max((w.float() - g.float()).abs().nan_to_num(0.0).max().item()
              for w, g in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)))
    return {"status": status, "groups": groups, "max_abs_err": err}


def _holds(group_ops, expected):
    remaining = list(group_ops)
    for op in expected:
        if op not in remaining:
            return False
        remaining.remove(op)
    return True


def survey(dtypes=(torch.float32, torch.bfloat16)):
    """Check every catalogue pattern in every dtype: {dtype name: {pattern name: check() result}}."""
    return {str(dtype).removeprefix("torch."): {p.name: check(p, dtype) for p in catalogue()} for dtype in dtypes}
