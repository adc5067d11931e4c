"""The emulated policy's fp32 autograd Functions: bf16 operands in, fp32 math forward and backward, bf16 out.

Each Function saves its inputs as they come (not fp32 copies of bf16 ones), so saved memory stays that of the
inputs' dtype, and casts them again in backward. Gradients come back in each input's dtype. (``_saved`` does the
same for ops autograd runs in C++ on fp32 casts of bf16 tensors: bf16 weights on fp32 activations.)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _fp32_region():
    # Autocast would cast the fp32 operands straight back to bf16.
    if torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    # Contiguous, so that matmul folds batch dims into one mm: under no_grad (inside a Function)
    # it would otherwise run a strided 3-D input as a bmm against an expanded weight. to() skips
    # the copy for a strided fp32 tensor (autocast operands), hence the contiguous() after it.
    return None if t is None else t.to(torch.float32, memory_format=torch.contiguous_format).contiguous()


def _rows32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous fp32 (rows, last dim) matrix."""
    return _f32(t).view(-1, t.shape[-1])


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, out_dtype):
        ctx.save_for_backward(x, w)
        ctx.dtypes = (w.dtype, None if b is None else b.dtype)
        with _fp32_region():
            y = F.linear(_rows32(x), _f32(w), _f32(b))
        return y.view(*x.shape[:-1], w.shape[0]).to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        w_dtype, b_dtype = ctx.dtypes
        gx = gw = gb = None
        with _fp32_region():
            g2 = _rows32(g)
            if need_x:
                gx = (g2 @ _f32(w)).view(x.shape).to(x.dtype)
            if need_w:
                gw = (g2.T @ _rows32(x)).to(w_dtype)
            if need_b:
                gb = g2.sum(0).to(b_dtype)
        return gx, gw, gb, None


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, transposed, output_padding, groups, out_dtype):
        ctx.save_for_backward(x, w)
        ctx.w_dtype = w.dtype
        ctx.bias = None if b is None else (b.shape, b.dtype)
        ctx.params = (stride, padding, dilation, transposed, output_padding, groups)
        with _fp32_region():
            y = torch.ops.aten.convolution(x.float(), w.float(), _f32(b), *ctx.params)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        bias_sizes = None if ctx.bias is None else list(ctx.bias[0])
        with _fp32_region():
            gx, gw, gb = torch.ops.aten.convolution_backward(
                g.float(), x.float(), w.float(), bias_sizes, *ctx.params, [need[0], need[1], need[2]]
            )
        return (
            _cast(gx, x.dtype) if need[0] else None,
            _cast(gw, ctx.w_dtype) if need[1] else None,
            _cast(gb, ctx.bias[1]) if need[2] else None,
        ) + (None,) * 7


def _matmul_grads(a, b, g, need_a, need_b):
    """fp32 grads of matmul(a, b) with torch.matmul's 1-D and broadcasting rules."""
    a2 = _f32(a) if a.dim() > 1 else _f32(a).unsqueeze(0)
    b2 = _f32(b) if b.dim() > 1 else _f32(b).unsqueeze(-1)
    g2 = _f32(g)
    if b.dim() == 1:
        g2 = g2.unsqueeze(-1)
    if a.dim() == 1:
        g2 = g2.unsqueeze(-2)
    ga = gb = None
    if need_a:
        ga = (g2 @ b2.mT).sum_to_size(a2.shape).reshape(a.shape)
    if need_b:
        if b2.dim() == 2 and g2.dim() > 2:
            # Weight-like b shared across a batch: one large mm instead of a batched product + sum.
            gb = a2.view(-1, a2.shape[-1]).mT @ g2.view(-1, g2.shape[-1])
        else:
            gb = (a2.mT @ g2).sum_to_size(b2.shape)
        gb = gb.reshape(b.shape)
    return ga, gb


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, op, out_dtype):
        ctx.save_for_backward(a, b)
        with _fp32_region():
            return op(_f32(a), _f32(b)).to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        with _fp32_region():
            ga, gb = _matmul_grads(a, b, g, *ctx.needs_input_grad[:2])
        return _cast(ga, a.dtype), _cast(gb, b.dtype), None, None


class _AddMatmul(torch.autograd.Function):
    """addmm / baddbmm: beta * input + alpha * (m1 @ m2)."""

    @staticmethod
    def forward(ctx, inp, m1, m2, beta, alpha, op, out_dtype):
        ctx.save_for_backward(m1, m2)
        ctx.inp = (inp.shape, inp.dtype)
        ctx.beta, ctx.alpha = beta, alpha
        with _fp32_region():
            return op(inp.float(), m1.float(), m2.float(), beta=beta, alpha=alpha).to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        m1, m2 = ctx.saved_tensors
        need_inp, need_m1, need_m2 = ctx.needs_input_grad[:3]
        g_inp = g1 = g2 = None
        with _fp32_region():
            g32 = g.float()
            if need_inp:
                g_inp = (g32 * ctx.beta).sum_to_size(ctx.inp[0]).to(ctx.inp[1])
            if need_m1:
                g1 = ((g32 @ m2.float().mT) * ctx.alpha).to(m1.dtype)
            if need_m2:
                g2 = ((m1.float().mT @ g32) * ctx.alpha).to(m2.dtype)
        return g_inp, g1, g2, None, None, None, None


class _FlashAttention(torch.autograd.Function):
    """Dropout-free attention through torch's fused CPU kernels, run in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, out_dtype):
        with _fp32_region():
            if mask is not None and mask.dtype == torch.bool:
                # The fused kernel takes an additive mask, as torch's own dispatcher converts it.
                mask = torch.zeros_like(mask, dtype=torch.float32).masked_fill_(mask.logical_not(), float("-inf"))
            mask = None if mask is None else mask.float()
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.float(), k.float(), v.float(), 0.0, is_causal, attn_mask=mask, scale=scale
            )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        q, k, v, out, lse, mask = ctx.saved_tensors
        with _fp32_region():
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g.float().contiguous(), q.float(), k.float(), v.float(), out, lse, 0.0, ctx.is_causal,
                attn_mask=mask, scale=ctx.scale,
            )
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None, None
