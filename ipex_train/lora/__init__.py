"""A LoRA linear layer in one autograd node: ``x W^T + bias + scaling * (x A^T) B^T``.

Why
---
peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the three matmuls, an
elementwise multiply and an add over the whole (tokens x out_features) output forward, and again in backward (the
multiply's backward and the sum of the two gradients of ``x``). Here the adapter's product is accumulated into the
base output by the matmul itself (``addmm_`` with ``alpha=scaling``) and ``grad_x`` likewise, so the extra passes
touch only (tokens x rank) tensors: ~10 ms less per decoder layer of a 100M-parameter Llama at sequence 2048, a few
percent of its LoRA step (docs/compute_policy.md).

The ``bf16`` native compute policy of ``ipex_train.optimize`` routes peft's ``lora.Linear`` layers here when the
call computes exactly this formula (``ipex_train.compute_policy``).
"""
from __future__ import annotations

import torch

__all__ = ["lora_linear", "supports"]

_DTYPES = (torch.bfloat16, torch.float32)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
             lora_b: torch.Tensor) -> bool:
    """Whether :func:`lora_linear` takes these tensors: plain tensors (no subclass) on the CPU, all of one dtype,
    bf16 or fp32 (mixed dtypes are left to the caller: peft casts ``x`` to the adapter's dtype and promotes the sum),
    ``weight`` (out, in), ``lora_a`` (r, in), ``lora_b`` (out, r), ``bias`` None or (out,), and ``x`` of last
    dimension in."""
    tensors = (x, weight, lora_a, lora_b) if bias is None else (x, weight, lora_a, lora_b, bias)
    # Plain tensors only: a subclass (DTensor, a quantized or offloaded weight) has semantics of its own for the
    # in-place addmm_ and views used here, which peft's F.linear calls may not share.
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    dtype = x.dtype
    if dtype not in _DTYPES or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return False
    if weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2 or x.dim() < 1:
        return False
    out_features, in_features = weight.shape
    return (x.shape[-1] == in_features == lora_a.shape[1] and lora_b.shape == (out_features, lora_a.shape[0])
            and (bias is None or bias.shape == (out_features,)))


class _LoraLinear(torch.autograd.Function):
    """Forward ``y = x W^T + bias``, then ``y += scaling * h B^T`` with ``h = x A^T`` in the same matmul call;
    backward accumulates the adapter's term of ``grad_x`` into the base one the same way."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        x2 = x.reshape(-1, x.shape[-1])
        h = torch.mm(x2, lora_a.t())
        y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        y.addmm_(h, lora_b.t(), alpha=scaling)
        # Only what backward reads for the grads asked for.
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        ctx.save_for_backward(x2 if (need_w or need_a) else None, weight if need_x else None,
                              lora_a if need_x else None, lora_b if (need_x or need_a) else None,
                              h if need_b else None)
        ctx.scaling = scaling
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        s = ctx.scaling
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_x or need_a:
            # d/dh of scaling * h B^T: (tokens x r), small, so scaling is applied here once for grad_x and grad_a.
            gh = torch.mm(g2, lora_b).mul_(s)
            if need_x:
                grad_x = torch.mm(g2, weight).addmm_(gh, lora_a).view(ctx.x_shape)
            if need_a:
                grad_a = torch.mm(gh.t(), x2)
        if need_w:
            grad_w = torch.mm(g2.t(), x2)
        if need_bias:
            grad_bias = g2.sum(0)
        if need_b:
            grad_b = torch.mm(g2.t(), h).mul_(s)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """LoRA linear: ``y = x @ weight.T + bias + scaling * (x @ lora_a.T) @ lora_b.T`` over ``x``'s last dimension.

    ``weight`` (out, in), ``bias`` (out,) or None, ``lora_a`` (r, in), ``lora_b`` (out, r): what peft's
    ``lora.Linear`` holds in ``base_layer`` and ``lora_A``/``lora_B`` of one adapter (no dropout, no adapter bias).
    The base product and the adapter's are summed by the matmul (one rounding of ``y`` to the dtype after the base
    product, where peft rounds after each of ``lora_B``, ``* scaling`` and ``+``). Gradients for every tensor that
    requires one, in its dtype. Raises ValueError where :func:`supports` does not hold.
    """
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"scaling must be a float, got {type(scaling).__name__}")
    if not supports(x, weight, bias, lora_a, lora_b):
        shapes = {n: (tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else type(t).__name__
                  for n, t in (("x", x), ("weight", weight), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b))}
        raise ValueError("lora_linear takes CPU tensors of one dtype (bfloat16 or float32): x (..., in), weight "
                         f"(out, in), bias (out,) or None, lora_a (r, in), lora_b (out, r); got {shapes}")
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, float(scaling))
