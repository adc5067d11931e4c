"""Plain PyTorch implementations of the six update rules, one tensor at a time.

They are the specification the fused kernels are tested against, and the ``fused=False`` path of
:class:`~ipex_train.optim.Lamb` and :class:`~ipex_train.optim.Lars`. Each function updates ``params`` and the
state lists in place; ``state_steps`` hold the step count *already incremented* for this step (the callers
increment it, as torch.optim's fused path does). Params are the working (fp32 or fp64) values.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def sgd(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor | None], *, lr: float,
        momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool) -> None:
    """torch.optim.SGD's rule. A None entry of ``momentum_buffers`` is replaced by the new buffer."""
    for i, (p, g) in enumerate(zip(params, grads)):
        g = -g if maximize else g
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            buf = momentum_buffers[i]
            if buf is None:
                buf = torch.clone(g).detach()
                momentum_buffers[i] = buf
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)


def adam(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
         max_exp_avg_sqs: list[Tensor], state_steps: list[Tensor], *, lr: float, beta1: float, beta2: float,
         weight_decay: float, eps: float, amsgrad: bool, maximize: bool, decoupled_weight_decay: bool) -> None:
    """torch.optim.Adam's rule (AdamW is ``decoupled_weight_decay=True``)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        g = -g if maximize else g
        step = float(state_steps[i])
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        exp_avgs[i].lerp_(g, 1 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        bc2_sqrt = math.sqrt(1 - beta2**step)
        second = exp_avg_sqs[i]
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sqs[i], out=max_exp_avg_sqs[i])
            second = max_exp_avg_sqs[i]
        denom = (second.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(exp_avgs[i], denom, value=-step_size)


def adagrad(params: list[Tensor], grads: list[Tensor], state_sums: list[Tensor], state_steps: list[Tensor], *,
            lr: float, lr_decay: float, weight_decay: float, eps: float, maximize: bool) -> None:
    """torch.optim.Adagrad's rule for dense grads."""
    for i, (p, g) in enumerate(zip(params, grads)):
        g = -g if maximize else g
        step = float(state_steps[i])
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        clr = lr / (1 + (step - 1) * lr_decay)
        state_sums[i].addcmul_(g, g, value=1)
        std = state_sums[i].sqrt().add_(eps)
        p.addcdiv_(g, std, value=-clr)


def lamb(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
         state_steps: list[Tensor], *, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
         bias_correction: bool) -> None:
    """Lamb: Adam moments, update u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w, then
    w -= lr * trust * u with trust = ||w|| / ||u||, or 1 when either norm is zero."""
    for i, (p, g) in enumerate(zip(params, grads)):
        step = float(state_steps[i])
        m, v = exp_avgs[i], exp_avg_sqs[i]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = 1 - beta1**step if bias_correction else 1.0
        bc2 = 1 - beta2**step if bias_correction else 1.0
        u = (m / bc1) / ((v / bc2).sqrt() + eps) + weight_decay * p
        w_norm = float(p.double().norm())
        u_norm = float(u.double().norm())
        trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        p.add_(u, alpha=-lr * trust)


def lars(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *, lr: float, momentum: float,
         weight_decay: float, eeta: float, epsilon: float) -> None:
    """Lars (You et al. 2017, Algorithm 1): local_lr = eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)
    (1 when either norm is zero); buf = momentum * buf + lr * local_lr * (g + weight_decay * w); w -= buf.
    Buffers start at zero."""
    for i, (p, g) in enumerate(zip(params, grads)):
        w_norm = float(p.double().norm())
        g_norm = float(g.double().norm())
        local_lr = eeta * w_norm / (g_norm + weight_decay * w_norm + epsilon) if w_norm > 0 and g_norm > 0 else 1.0
        buf = momentum_buffers[i]
        buf.mul_(momentum).add_(g.add(p, alpha=weight_decay), alpha=lr * local_lr)
        p.sub_(buf)
