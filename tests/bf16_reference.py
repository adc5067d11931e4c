"""Plain-torch references for model-level tests: an independent emulation of optimize(dtype=torch.bfloat16)
training.

The emulated arithmetic: every parameter of a Linear/Conv*/Embedding module (the layers the tests' models convert)
has an fp32 master stepped by a plain torch.optim optimizer; the forward uses that master rounded to bf16 by the
split-storage rule (fp32 bits + 0x8000, top 16 bits: round to nearest, ties away from zero); its gradient is rounded
to bf16 as it arrives and again after each accumulation (a bf16 .grad sums in bf16). The activations follow the
compute policy: bf16 into and out of each converted layer under "native", fp32 throughout under "emulated" (the
bf16 weight is computed as its exact fp32 value). Under "native", attention without mask or dropout rounds as
ipex_train's bf16 attention does (bf16 products, fp32 softmax, probabilities and dS rounded to bf16 once each),
written out in torch ops. Nothing here imports ipex_train.

Also: clipping by the global grad norm written out (the reference for torch.nn.utils.clip_grad_norm_ after
optimize(), which ipex_train wraps), and the check that every parameter moved well past a comparison's tolerance.
"""
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

BF16 = torch.bfloat16
CONVERTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def split_top(master):
    """The bf16 value split storage keeps for fp32 ``master``: its bits plus half a bf16 ulp, truncated."""
    bits = master.detach().contiguous().view(torch.int32)
    return ((bits + 0x8000) & -0x10000).view(torch.float32).view_as(master)  # exact in bf16: low half is zero


def clip_grad_norm(params, max_norm, low=()):
    """Scale the grads of ``params`` so that their global 2-norm is at most ``max_norm``; returns that norm before
    clipping. As torch computes it: each grad's norm in the grad's dtype (bf16 for the parameters in ``low``, whose
    grads the emulated policy's reference holds in fp32), their norm in fp32, the factor max_norm / (norm + 1e-6)
    capped at 1; the grads of ``low`` parameters are rounded to bf16 again after scaling."""
    params = [p for p in dict.fromkeys(params) if p.grad is not None]
    norms = [torch.linalg.vector_norm(p.grad.to(BF16) if p in low else p.grad).float() for p in params]
    total = torch.linalg.vector_norm(torch.stack(norms))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(factor)
        if p in low:
            p.grad.copy_(p.grad.to(BF16))
    return total


def assert_moved(values, initial, tol, moves=10):
    """Every tensor of ``initial`` moved in ``values`` by more than ``moves`` x ``tol`` on average: a comparison at
    ``tol`` then sees the optimizer's steps, not just the initial values."""
    for k, v in initial.items():
        move = (values[k].float() - v.detach().float()).abs().mean().item()
        assert move > moves * tol, f"{k} moved {move:.2e} on average, not beyond {moves} x {tol}"


def _cast_to_bf16(module, args):
    return tuple(a.to(BF16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _round_grad(p):
    p.grad.copy_(p.grad.to(BF16))


class _Bf16Attention(torch.autograd.Function):
    """softmax(q k^T * scale) v for bf16 q, k, v with ipex_train's attention rounding, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        p = torch.softmax((q @ k.transpose(-1, -2)).float() * scale, dim=-1).to(BF16)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return p @ v

    @staticmethod
    def backward(ctx, grad):
        q, k, v, p = ctx.saved_tensors
        grad = grad.to(BF16)
        dp = (grad @ v.transpose(-1, -2)).float()
        pf = p.float()
        ds = (pf * (dp - (dp * pf).sum(-1, keepdim=True)) * ctx.scale).to(BF16)
        return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ grad, None


class _Bf16AttentionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = (len(args) == 3 and set(kwargs) <= {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"}
                 and kwargs.get("attn_mask") is None and not kwargs.get("dropout_p") and not kwargs.get("is_causal")
                 and not kwargs.get("enable_gqa"))
        if func is F.scaled_dot_product_attention and plain and all(t.dtype == BF16 for t in args):
            scale = kwargs.get("scale") or args[0].shape[-1] ** -0.5
            return _Bf16Attention.apply(*args, scale)
        return func(*args, **kwargs)


class Bf16Emulation:
    """``model`` (deep-copied) trained the way optimize(model, opt, dtype=bf16) trains it, in plain torch.

    ``make_optimizer(params)`` builds the torch.optim optimizer over the fp32 values, in ``model.parameters()``
    order (the masters of converted parameters, the parameters themselves otherwise). Use ``model`` for forward and
    backward, then ``step()`` instead of the optimizer's step, ``zero_grad()`` instead of its zero_grad.
    ``state_dict()`` gives the fp32 values, keyed as the model's state_dict.
    """

    def __init__(self, model, make_optimizer, policy):
        assert policy in ("native", "emulated"), policy
        self.model = copy.deepcopy(model)
        self.native = policy == "native"
        self.masters = {}  # converted parameter -> its fp32 master
        for m in self.model.modules():
            if not isinstance(m, CONVERTED):
                continue
            if self.native:
                m.register_forward_pre_hook(_cast_to_bf16)
            for p in m.parameters(recurse=False):
                if p in self.masters:  # tied
                    continue
                self.masters[p] = nn.Parameter(p.detach().clone())
                if not self.native:  # a bf16 .grad: each contribution and each sum rounded to bf16
                    p.register_hook(lambda g: g.to(BF16).to(g.dtype))
                    p.register_post_accumulate_grad_hook(_round_grad)
        if self.native:  # attention as ipex_train's native policy computes it, for the model's forward
            mode = _Bf16AttentionMode()

            def enter(module, args):
                mode.__enter__()

            def leave(module, args, out):
                mode.__exit__(None, None, None)

            self.model.register_forward_pre_hook(enter)
            self.model.register_forward_hook(leave, always_call=True)
        self.optimizer = make_optimizer([self.masters.get(p, p) for p in self.model.parameters()])
        self._publish()

    def _publish(self):
        with torch.no_grad():
            for p, master in self.masters.items():
                p.data = split_top(master).to(BF16 if self.native else torch.float32)

    def step(self):
        for p, master in self.masters.items():
            master.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        self._publish()

    def clip_grad_norm_(self, max_norm):
        """clip_grad_norm (above) over the model's parameters, with the arithmetic of bf16 grads."""
        return clip_grad_norm(self.model.parameters(), max_norm, self.masters)

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
        for master in self.masters.values():
            master.grad = None

    def state_dict(self):
        values = {k: v.float().clone() for k, v in self.model.state_dict().items()}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if p in self.masters:
                values[name] = self.masters[p].detach().clone()
        return values
