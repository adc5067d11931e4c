"""``F.linear`` with a bias, for bf16 training: the bias added in the GEMM's epilogue instead of copied into the
output first.

Why
---
On CPU, torch computes a bf16 ``F.linear(x, weight, bias)`` as ``addmm``: it copies the bias, broadcast, into the
whole (tokens, out_features) output, then runs the GEMM accumulating onto it (``aten::copy_`` of the output's size
per call, and the GEMM reads the output back). oneDNN's matmul can add the bias in its epilogue, in fp32 before the
one rounding, which torch exposes as ``torch.ops.mkldnn._linear_pointwise`` (what Inductor calls for CPU inference).
Here that op runs the forward and the backward is addmm's own (``g @ W``, ``g^T @ x``, ``g.sum(0)``), in one
torch.library op with a fake kernel (no graph break under ``torch.compile``).

Numerics: the output and the three gradients are torch's ``F.linear`` bit for bit where :func:`supports` holds: the
same products, and ``round(acc + bias)`` either way. Before the first call in a process a small probe compares the
op with ``F.linear`` on a few shapes; where it differs or fails (another torch or oneDNN build) :func:`linear` is
``F.linear``. Outputs under :data:`MIN_OUTPUT_ELEMENTS` elements stay on ``F.linear`` too (the op's fixed cost).

The ``bf16`` native compute policy of ``ipex_train.optimize`` routes ``nn.Linear`` modules with a bias here, and its
other routes call :func:`linear` where they compute a linear themselves (``ipex_train.compute_policy.routes_linear``;
docs/compute_policy.md).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _op

__all__ = ["linear", "supports", "available", "MIN_OUTPUT_ELEMENTS"]

# Smallest output (rows x out_features) :func:`linear` runs the op for: it saves the bias copy, ~0.17 ms at
# 1024 x 768 bf16 and ~0.9 ms at 1024 x 3072 on a 2-core AMX VM, and costs ~70 us more per call than F.linear in
# fixed overhead with autograd (oneDNN's primitive lookup, the Python autograd node), so small layers stay on F.linear.
MIN_OUTPUT_ELEMENTS = 1 << 19

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# (rows, in_features, out_features) the probe compares: reduction lengths from small heads to a BERT FFN's, row
# counts off oneDNN's blocks (~1 ms once per process).
_PROBE_SHAPES = ((3, 32, 16), (18, 48, 40), (37, 64, 96), (5, 128, 24), (11, 256, 72), (67, 768, 80),
                 (9, 3072, 48))


@functools.cache
def _probe() -> bool:
    """Whether oneDNN's bias-epilogue linear runs here and equals ``F.linear`` on a few small bf16 cases."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported()):
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for rows, k, n in _PROBE_SHAPES:
                x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
                w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)
                b = torch.randn(n, generator=gen).to(torch.bfloat16)
                if not torch.equal(_op.linear_bias(x, w, b), F.linear(x, w, b)):
                    return False
    except RuntimeError:
        return False
    return True


def available() -> bool:
    """Whether the bias-epilogue op runs here: oneDNN with bf16, and the probe's cases equal to ``F.linear``. The
    first call in a process runs the probe (~0.1 s); the native compute policy calls it when it attaches, so that the
    probe's own ops never run inside a model's forward."""
    return _probe()


@torch.compiler.assume_constant_result
def _available() -> bool:
    # A constant to torch.compile (decided once per process, outside the graph).
    return _probe()


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` runs the bias-epilogue op on these tensors (else ``F.linear``): plain bf16 CPU tensors
    (no subclass such as DTensor), ``x`` contiguous with 2 or 3 dimensions (the inputs ``F.linear`` computes as one
    addmm), ``weight`` 2-D contiguous, ``bias`` 1-D of ``weight``'s rows, not under autocast, and the probe passed."""
    if bias is None or not all(type(t) in _PLAIN for t in (x, weight, bias)):
        return False
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.layout != torch.strided for t in (x, weight, bias)):
        return False
    if x.dim() not in (2, 3) or weight.dim() != 2 or bias.dim() != 1 or x.numel() == 0:
        return False
    if x.shape[-1] != weight.shape[1] or bias.shape[0] != weight.shape[0] or weight.shape[0] == 0:
        return False
    if not (x.is_contiguous() and weight.is_contiguous()) or torch.is_autocast_enabled("cpu"):
        return False
    return _available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the bias-epilogue op where :func:`supports` says so and the output has
    at least :data:`MIN_OUTPUT_ELEMENTS` elements (the same result and gradients, bit for bit), else ``F.linear``
    itself (which raises for what it does not take)."""
    if (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)
            and supports(x, weight, bias) and x.numel() // x.shape[-1] * weight.shape[0] >= MIN_OUTPUT_ELEMENTS):
        return _op.linear_bias(x, weight, bias)
    return F.linear(x, weight, bias)
