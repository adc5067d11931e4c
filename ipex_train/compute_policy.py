"""How bf16 matmul-class work is computed on this CPU: natively, or emulated in fp32.

Why
---
On CPUs without bf16 arithmetic (no avx512_bf16, amx_bf16 or avx_ne_convert) torch and oneDNN
fall back to reference kernels for bf16 matmuls and convolutions, which run one to two orders
of magnitude slower than fp32: a bf16 train step under ``torch.autocast("cpu", torch.bfloat16)``
is 20-60x slower than fp32 there. Upcasting the bf16-stored operands and doing the math in fp32
costs a few percent over fp32, and bf16 values are exactly representable in fp32, so the result
equals an fp32 computation on the bf16 operands.

Policies
--------
``"native"``
    The CPU has bf16 arithmetic: nothing is changed.
``"emulated"``
    linear, conv1d/2d/3d, conv_transpose1d/2d/3d, matmul (also ``@``), mm, bmm, addmm, baddbmm,
    scaled_dot_product_attention, einsum, tensordot, inner, chain_matmul, linalg.multi_dot,
    linalg.matmul, addbmm, mv, addmv, dot, vdot, bilinear and the RNNs (LSTM, GRU, RNN) are
    computed in fp32 when torch would run them in bf16 (bf16 operands, or fp32 operands under
    CPU bf16 autocast for the ops autocast lowers) and return bf16. Every other op runs as it
    would anyway.

:func:`resolve` picks the policy (argument > ``IPEX_TRAIN_BF16_COMPUTE`` > CPU features) and logs
it once on the ``"ipex_train"`` logger.

Mechanism
---------
*Forward*: a :class:`torch.overrides.TorchFunctionMode` is active only while an attached model's
forward runs (:func:`attach` registers a forward pre-hook that enters it and an ``always_call``
forward hook that leaves it), so nothing outside that forward is touched and no global switch is
flipped. The mode sees every torch call made from Python, so functional code (``torch.matmul``,
``x @ w``, ``F.scaled_dot_product_attention``) is covered as well as ``nn.Linear``/``nn.Conv*``.
The Python composites of torch.nn.functional (``F.multi_head_attention_forward``, used by
nn.MultiheadAttention and nn.TransformerEncoderLayer) run with the mode still active, so the
linears and attention inside them are seen too.

*Backward*: the autograd engine runs backward kernels below the Python layer and outside the
forward's scope, where no torch-function mode sees them. Each emulated op is therefore a custom
:class:`torch.autograd.Function` whose backward also computes in fp32 and returns gradients in
each input's dtype (bf16 for bf16 weights, fp32 for fp32 weights under autocast). The Functions
save the bf16 inputs, not fp32 copies, and upcast them again in backward: activation memory
stays that of bf16 training. Attention saves its fp32 output and log-sum-exp, which the fused
attention backward needs; that is what fp32 training saves for it.

Unusual argument forms (``out=``, ``padding="same"`` with an even kernel, attention with dropout
or a differentiable mask) are upcast at the autograd level instead (fp32 compute, autograd saves
the fp32 copies): still no bf16 matmul, at the memory cost of fp32 for that op.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _options

__all__ = [
    "POLICIES",
    "ENV_VAR",
    "cpu_has_native_bf16",
    "resolve",
    "info",
    "attach",
    "emulated_bf16",
    "ComputePolicyHandle",
]

POLICIES = ("native", "emulated")
ENV_VAR = "IPEX_TRAIN_BF16_COMPUTE"
_REQUESTABLE = ("auto",) + POLICIES
_NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16", "avx_ne_convert")

_log = logging.getLogger("ipex_train")
_logged: set[tuple[str, str]] = set()


# --------------------------------------------------------------------------- policy selection


def _features() -> dict[str, bool]:
    """CPU features as name -> bool, parsed from the extension's ``"avx2=1,fma=1,..."`` string."""
    import ipex_train._C  # noqa: F401  (registers torch.ops.ipex_train)

    pairs = (item.split("=") for item in torch.ops.ipex_train.cpu_features().split(","))
    return {name: value == "1" for name, value in pairs}


def cpu_has_native_bf16(features: dict[str, bool] | None = None) -> bool:
    """True when the CPU has bf16 arithmetic (avx512_bf16, amx_bf16 or avx_ne_convert).

    ``features`` maps feature names to bools; by default they are read from the CPU.
    """
    if features is None:
        features = _features()
    return any(features.get(name, False) for name in _NATIVE_BF16_FEATURES)


def _check_value(value: str, where: str) -> str:
    normalized = value.strip().lower()
    if normalized not in _REQUESTABLE:
        raise ValueError(f"{where}={value!r} is not a bf16 compute policy; accepted values: {', '.join(_REQUESTABLE)}")
    return normalized


def _resolve_with_source(requested: str | None) -> tuple[str, str]:
    if requested is not None and _check_value(requested, "requested") != "auto":
        return requested.strip().lower(), "argument"
    env = _options.env(ENV_VAR)
    if env is not None and _check_value(env, ENV_VAR) != "auto":
        return env.strip().lower(), f"environment variable {ENV_VAR}"
    native = cpu_has_native_bf16()
    return ("native" if native else "emulated"), "CPU features"


def resolve(requested: str | None = None) -> str:
    """The bf16 compute policy to use: ``"native"`` or ``"emulated"``.

    ``requested`` wins when it is ``"native"`` or ``"emulated"``; ``None`` or ``"auto"`` defers to
    the environment variable ``IPEX_TRAIN_BF16_COMPUTE`` (same values), and when that is unset or
    ``"auto"`` the CPU decides: ``"native"`` iff it has bf16 arithmetic. Values are
    case-insensitive; anything else raises ValueError. Each distinct choice is logged once.
    """
    policy, source = _resolve_with_source(requested)
    if (policy, source) not in _logged:
        _logged.add((policy, source))
        why = (
            "bf16 matmul/conv run on the CPU's bf16 units"
            if policy == "native"
            else "bf16 matmul/conv/attention are computed in fp32 from bf16 operands"
        )
        _log.info("bf16 compute policy: %s (chosen by %s): %s", policy, source, why)
    return policy


def info() -> dict[str, object]:
    """What the policy resolves to here: ``{"bf16_compute", "chosen_by", "cpu_native_bf16"}``."""
    policy, source = _resolve_with_source(None)
    return {"bf16_compute": policy, "chosen_by": source, "cpu_native_bf16": cpu_has_native_bf16()}


# --------------------------------------------------------------------------- fp32 compute helpers


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
        ctx.bias_dtype = None if b is None else b.dtype
        with _fp32_region():
            y = F.linear(_rows32(x), _f32(w), _f32(b))
        return y.view(*x.shape[:-1], w.shape[0]).to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        gx = gw = gb = None
        with _fp32_region():
            g2 = _rows32(g)
            if need_x:
                gx = (g2 @ _f32(w)).view(x.shape).to(x.dtype)
            if need_w:
                gw = (g2.T @ _rows32(x)).to(w.dtype)
            if need_b:
                gb = g2.sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, transposed, output_padding, groups, out_dtype):
        ctx.save_for_backward(x, w)
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
            _cast(gw, w.dtype) if need[1] else None,
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


# --------------------------------------------------------------------------- op table


def _bind(names, defaults, args, kwargs):
    """Positional + keyword arguments by name; None when a keyword is not in ``names``."""
    if len(args) > len(names) or any(key not in names for key in kwargs):
        return None
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    if any(name not in bound for name in names):
        return None
    return bound


def _runs_in_bf16(tensors, autocast_lowers: bool = True) -> bool:
    """Whether torch would run an op on these operands in bf16 on the CPU (``autocast_lowers``: whether CPU bf16
    autocast runs this op in bf16; it leaves mv, dot, addmv and bilinear in fp32)."""
    floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats or any(t.device.type != "cpu" for t in floats):
        return False
    if autocast_lowers and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        allowed = (torch.bfloat16, torch.float32)
    else:
        # Mixed dtypes without autocast are an error in torch; let torch raise it.
        allowed = (torch.bfloat16,)
    return all(t.dtype in allowed for t in floats)


def _upcast_call(func, args, kwargs):
    """Generic path: call ``func`` on fp32 copies (autograd-tracked casts, so backward computes in fp32 too),
    return bf16. Tensors inside list/tuple arguments (einsum operands, RNN weights and states) are cast as well,
    and every floating output of a tuple result (an RNN's output and states) comes back bf16."""

    def up(x):
        if isinstance(x, (list, tuple)):
            return type(x)(up(v) for v in x)
        return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x

    def down(x):
        if isinstance(x, (list, tuple)):
            return type(x)(down(v) for v in x)
        return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

    kwargs = dict(kwargs)
    out = kwargs.pop("out", None)
    with _fp32_region():
        result = down(func(*map(up, args), **{key: up(value) for key, value in kwargs.items()}))
    return result if out is None else out.copy_(result)


def _linear(func, args, kwargs):
    a = _bind(("input", "weight", "bias"), {"bias": None}, args, kwargs)
    if a is None:
        return _upcast_call(func, args, kwargs)
    return _Linear.apply(a["input"], a["weight"], a["bias"], torch.bfloat16)


def _tuple(value, n):
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return value * n if len(value) == 1 else value


def _same_padding(weight, dilation, n):
    """Symmetric padding for ``padding="same"``; None when it would be asymmetric (even kernel)."""
    total = [d * (k - 1) for d, k in zip(_tuple(dilation, n), weight.shape[2:])]
    return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)


def _conv(n, transposed):
    names = ("input", "weight", "bias", "stride", "padding") + (
        ("output_padding", "groups", "dilation") if transposed else ("dilation", "groups")
    )
    defaults = {"bias": None, "stride": 1, "padding": 0, "output_padding": 0, "dilation": 1, "groups": 1}

    def impl(func, args, kwargs):
        a = _bind(names, defaults, args, kwargs)
        if a is None or a["input"].dim() != n + 2:
            return _upcast_call(func, args, kwargs)
        padding = a["padding"]
        if padding == "valid":
            padding = 0
        elif padding == "same":
            padding = _same_padding(a["weight"], a["dilation"], n)
            if padding is None or any(s != 1 for s in _tuple(a["stride"], n)):
                # Asymmetric or (invalid) strided "same": torch's own implementation handles it.
                return _upcast_call(func, args, kwargs)
        return _Conv.apply(
            a["input"], a["weight"], a["bias"], _tuple(a["stride"], n), _tuple(padding, n),
            _tuple(a["dilation"], n), transposed, _tuple(a["output_padding"] if transposed else 0, n),
            a["groups"], torch.bfloat16,
        )

    return impl


def _matmul(op, swap=False):
    def impl(func, args, kwargs):
        if kwargs or len(args) != 2:
            return _upcast_call(func, args, kwargs)
        a, b = (args[1], args[0]) if swap else args
        return _Matmul.apply(a, b, op, torch.bfloat16)

    return impl


def _add_matmul(op):
    names = ("input", "mat1", "mat2") if op is torch.addmm else ("input", "batch1", "batch2")

    def impl(func, args, kwargs):
        a = _bind(names + ("beta", "alpha"), {"beta": 1, "alpha": 1}, args, kwargs)
        if a is None:
            return _upcast_call(func, args, kwargs)
        return _AddMatmul.apply(*(a[name] for name in names), a["beta"], a["alpha"], op, torch.bfloat16)

    return impl


_FLASH = torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _sdpa(func, args, kwargs):
    a = _bind(_SDPA_NAMES, _SDPA_DEFAULTS, args, kwargs)
    if a is None:
        return _upcast_call(func, args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    fused = (
        q.dim() == k.dim() == v.dim() == 4
        and a["dropout_p"] == 0.0
        and not a["enable_gqa"]
        and (mask is None or not mask.requires_grad)
        and torch._fused_sdp_choice(q, k, v, mask, 0.0, a["is_causal"], scale=a["scale"]) == _FLASH
    )
    if not fused:
        return _upcast_call(func, args, kwargs)
    return _FlashAttention.apply(q, k, v, mask, a["is_causal"], a["scale"], torch.bfloat16)


def _operands(args, kwargs):
    """The arguments an op computes on, with list/tuple arguments (einsum operands, RNN weights) unpacked."""
    flat = []
    for value in list(args) + [value for key, value in kwargs.items() if key != "out"]:
        flat.extend(value if isinstance(value, (list, tuple)) else (value,))
    return flat


_T = torch.Tensor
_EMULATED = {
    F.linear: _linear,
    torch.conv1d: _conv(1, False),
    torch.conv2d: _conv(2, False),
    torch.conv3d: _conv(3, False),
    torch.conv_transpose1d: _conv(1, True),
    torch.conv_transpose2d: _conv(2, True),
    torch.conv_transpose3d: _conv(3, True),
    torch.matmul: _matmul(torch.matmul),
    _T.matmul: _matmul(torch.matmul),
    _T.__rmatmul__: _matmul(torch.matmul, swap=True),
    torch.mm: _matmul(torch.mm),
    _T.mm: _matmul(torch.mm),
    torch.bmm: _matmul(torch.bmm),
    _T.bmm: _matmul(torch.bmm),
    torch.addmm: _add_matmul(torch.addmm),
    _T.addmm: _add_matmul(torch.addmm),
    torch.baddbmm: _add_matmul(torch.baddbmm),
    _T.baddbmm: _add_matmul(torch.baddbmm),
    F.scaled_dot_product_attention: _sdpa,
}
# Matmul-class ops without a dedicated Function above: computed through _upcast_call (autograd saves fp32 copies
# of their operands). RNNs run their gate matmuls inside one C++ op; bf16 einsum and LSTM training steps measured
# 59x and 20x slower than fp32 on this project's AVX2 machine, and CPU autocast's bf16 LSTM does not run there.
_GENERIC = (
    torch.einsum, torch.tensordot, torch.inner, torch.chain_matmul, torch.linalg.multi_dot, torch.linalg.matmul,
    torch.addbmm, _T.addbmm, torch.mv, _T.mv, torch.addmv, _T.addmv, torch.dot, _T.dot, torch.vdot, _T.vdot,
    torch.bilinear, torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu,
)
_EMULATED.update({func: _upcast_call for func in _GENERIC})
# Ops CPU bf16 autocast leaves in fp32: emulated only when their operands are bf16.
_NOT_LOWERED_BY_AUTOCAST = frozenset({torch.mv, _T.mv, torch.addmv, _T.addmv, torch.dot, _T.dot, torch.vdot,
                                      _T.vdot, torch.bilinear})
_OVERRIDE_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _no_override(*args) -> bool:
    return False


_F_WITHOUT_OVERRIDE_CHECK = {**vars(F), **{name: _no_override for name in _OVERRIDE_CHECKS}}


@functools.cache
def _transparent(func: types.FunctionType) -> types.FunctionType | None:
    """A copy of a torch.nn.functional composite without its ``__torch_function__`` check.

    A mode is popped while it handles a call, so F.multi_head_attention_forward would run its
    linears and attention unobserved; re-entering the mode around the original would only send
    the same call back to the mode. Limited to torch.nn.functional, whose composites call other
    ops through module globals (Tensor methods re-dispatch to themselves and must not be copied).
    """
    if func.__module__ != F.__name__ or not any(name in func.__code__.co_names for name in _OVERRIDE_CHECKS):
        return None
    copy = types.FunctionType(func.__code__, _F_WITHOUT_OVERRIDE_CHECK, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


class _EmulationMode(TorchFunctionMode):
    """Routes the ops in _EMULATED to their fp32 implementations when torch would run them in bf16."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _EMULATED.get(func)
        if impl is not None:
            if _runs_in_bf16(_operands(args, kwargs), func not in _NOT_LOWERED_BY_AUTOCAST):
                return impl(func, args, kwargs)
            return func(*args, **kwargs)
        if type(func) is types.FunctionType:
            body = _transparent(func)
            if body is not None:
                with self:
                    return body(*args, **kwargs)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- scoping


_tls = threading.local()


def _enter() -> None:
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        _tls.mode = _EmulationMode()
        _tls.mode.__enter__()
    _tls.depth = depth + 1


def _leave() -> None:
    _tls.depth -= 1
    if _tls.depth == 0:
        _tls.mode.__exit__(None, None, None)
        _tls.mode = None


@contextlib.contextmanager
def emulated_bf16():
    """Context manager: bf16 matmul-class ops called inside run in fp32 (the "emulated" policy).

    Re-entrant and per-thread. Backward of ops run inside is emulated too, wherever backward is
    called, because each emulated op carries its own fp32 backward.
    """
    _enter()
    try:
        yield
    finally:
        _leave()


class ComputePolicyHandle:
    """What :func:`attach` returns: ``policy``, ``active`` and ``remove()`` (idempotent)."""

    def __init__(self, model: torch.nn.Module, policy: str, hooks: tuple = ()):
        self.policy = policy
        # Weak: the registry below maps model -> handle and must not keep the model alive.
        self._model = weakref.ref(model)
        self._hooks = hooks

    @property
    def active(self) -> bool:
        """True while the hooks are registered (always False for "native")."""
        return bool(self._hooks)

    def remove(self) -> None:
        """Detach: the model runs exactly as before :func:`attach`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = ()
        model = self._model()
        if model is not None and _attached.get(model) is self:
            del _attached[model]


_attached: weakref.WeakKeyDictionary[torch.nn.Module, ComputePolicyHandle] = weakref.WeakKeyDictionary()


# Module-level (not lambdas) so a model with the policy attached can still be pickled (torch.save(model)).
def _enter_hook(module, args):
    _enter()


def _leave_hook(module, args, output):
    _leave()


def attach(model: torch.nn.Module, policy: str) -> ComputePolicyHandle:
    """Apply ``policy`` ("native" or "emulated", see :func:`resolve`) to ``model``'s forward.

    "emulated" enters :func:`emulated_bf16` for the duration of each ``model(...)`` call; the
    backward of the graph built there is emulated too. "native" changes nothing. Attaching again
    returns the existing handle for the same policy, or replaces a different one.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {', '.join(POLICIES)} (use resolve() to pick one)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    existing = _attached.get(model)
    if existing is not None:
        if existing.policy == policy:
            return existing
        existing.remove()
    if policy == "native":
        handle = ComputePolicyHandle(model, policy)
    else:
        pre = model.register_forward_pre_hook(_enter_hook)
        post = model.register_forward_hook(_leave_hook, always_call=True)
        handle = ComputePolicyHandle(model, policy, (pre, post))
    _attached[model] = handle
    return handle
