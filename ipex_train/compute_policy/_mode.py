"""The emulated policy's op table and the TorchFunctionMode that routes bf16 matmul-class calls through it."""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import attention
from ..base import ops as _ops
from . import _saved
from ._functions import (
    _AddMatmul,
    _Conv,
    _FlashAttention,
    _fp32_region,
    _Linear,
    _Matmul,
)


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


def _emulated_dtype(tensors, autocast_lowers: bool = True) -> torch.dtype | None:
    """The dtype an emulated op returns on these operands, or None when torch would not run it in bf16 on the CPU
    (``autocast_lowers``: whether CPU bf16 autocast runs this op in bf16; it leaves mv, dot, addmv and bilinear in
    fp32).

    bf16 when every floating operand is bf16, or under CPU bf16 autocast (which would lower fp32 operands);
    fp32 when bf16 and fp32 operands meet without autocast: bf16-stored weights applied to fp32 activations,
    which optimize() keeps under this policy (torch itself refuses the mix; the result is torch's promoted dtype).
    """
    floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats or any(t.device.type != "cpu" for t in floats):
        return None
    dtypes = {t.dtype for t in floats}
    if not dtypes <= {torch.bfloat16, torch.float32}:
        return None
    if autocast_lowers and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        return torch.bfloat16
    if torch.bfloat16 not in dtypes:
        return None
    return torch.bfloat16 if len(dtypes) == 1 else torch.float32


def _no_outer_saved_hooks() -> bool:
    # Activation checkpointing and offloading save through hooks of their own: an inner hook would take the saved
    # tensors from them (kept instead of recomputed). torch has no public query for the active hooks.
    return (torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


def _bf16_tensors(x, found: dict[int, torch.Tensor]) -> None:
    if isinstance(x, (list, tuple)):
        for v in x:
            _bf16_tensors(v, found)
    elif isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        found.setdefault(id(x), x)


def _upcast_call(func, args, kwargs, out_dtype, scratch: bool = False):
    """Generic path: call ``func`` on fp32 copies (autograd-tracked casts, so backward computes in fp32 too),
    return ``out_dtype``. Tensors inside list/tuple arguments (einsum operands, RNN weights and states) are cast as
    well, and every floating output of a tuple result (an RNN's output and states) comes back in ``out_dtype``.
    Autograd keeps the bf16 tensors, not the fp32 copies, for backward (``_saved``); ``scratch`` (ops whose outputs
    never alias their inputs: linear, convolution) lets large casts use reused buffers."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out", None)
    found: dict[int, torch.Tensor] = {}
    _bf16_tensors([*args, *kwargs.values()], found)
    sources = list(found.values())
    # Compiled graphs choose what to save themselves (saved-tensor hooks would break the graph).
    recast = (bool(sources) and torch.is_grad_enabled() and not torch.compiler.is_compiling()
              and _no_outer_saved_hooks() and any(s.requires_grad for s in sources))
    scratch = scratch and recast  # a scratch cast must never be saved as it is: only under recast_saved
    casts = dict(zip(found, _saved.cast_up(sources, scratch)))

    def up(x):
        if isinstance(x, (list, tuple)):
            return type(x)(up(v) for v in x)
        return casts.get(id(x), x) if isinstance(x, torch.Tensor) else x

    def down(x):
        if isinstance(x, (list, tuple)):
            return type(x)(down(v) for v in x)
        return x.to(out_dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

    saving = _saved.recast_saved(sources, list(casts.values()), scratch) if recast else contextlib.nullcontext()
    with _fp32_region(), saving:
        result = func(*up(args), **{key: up(value) for key, value in kwargs.items()})
        if out_dtype != torch.float32:
            result = down(result)
    return result if out is None else out.copy_(result)


def _weight_linear(args, kwargs):
    """F.linear of an fp32 input on a bf16 weight (and bf16 bias), the emulated policy's common case under
    optimize(), as one C++ autograd node (``emulated_linear``); None when the call is not of that form."""
    a = _bind(("input", "weight", "bias"), {"bias": None}, args, kwargs)
    if a is None or torch.compiler.is_compiling():
        return None  # compiled graphs take the generic path, whose casts the compiler sees
    x, w, b = a["input"], a["weight"], a["bias"]
    if (x.dtype != torch.float32 or w.dtype != torch.bfloat16 or w.dim() != 2
            or (b is not None and (b.dtype != torch.bfloat16 or b.dim() != 1))):
        return None
    return _ops.emulated_linear(x, w, b, _saved.scratch_for(w))


def _linear(func, args, kwargs, out_dtype):
    a = _bind(("input", "weight", "bias"), {"bias": None}, args, kwargs)
    if a is None:
        return _upcast_call(func, args, kwargs, out_dtype)
    return _Linear.apply(a["input"], a["weight"], a["bias"], out_dtype)


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

    def impl(func, args, kwargs, out_dtype):
        a = _bind(names, defaults, args, kwargs)
        if a is None or a["input"].dim() != n + 2:
            return _upcast_call(func, args, kwargs, out_dtype)
        padding = a["padding"]
        if padding == "valid":
            padding = 0
        elif padding == "same":
            padding = _same_padding(a["weight"], a["dilation"], n)
            if padding is None or any(s != 1 for s in _tuple(a["stride"], n)):
                # Asymmetric or (invalid) strided "same": torch's own implementation handles it.
                return _upcast_call(func, args, kwargs, out_dtype)
        return _Conv.apply(
            a["input"], a["weight"], a["bias"], _tuple(a["stride"], n), _tuple(padding, n),
            _tuple(a["dilation"], n), transposed, _tuple(a["output_padding"] if transposed else 0, n),
            a["groups"], out_dtype,
        )

    return impl


def _matmul(op, swap=False):
    def impl(func, args, kwargs, out_dtype):
        if kwargs or len(args) != 2:
            return _upcast_call(func, args, kwargs, out_dtype)
        a, b = (args[1], args[0]) if swap else args
        return _Matmul.apply(a, b, op, out_dtype)

    return impl


def _add_matmul(op):
    names = ("input", "mat1", "mat2") if op is torch.addmm else ("input", "batch1", "batch2")

    def impl(func, args, kwargs, out_dtype):
        a = _bind(names + ("beta", "alpha"), {"beta": 1, "alpha": 1}, args, kwargs)
        if a is None:
            return _upcast_call(func, args, kwargs, out_dtype)
        return _AddMatmul.apply(*(a[name] for name in names), a["beta"], a["alpha"], op, out_dtype)

    return impl


_FLASH = torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _sdpa(func, args, kwargs, out_dtype):
    a = _bind(_SDPA_NAMES, _SDPA_DEFAULTS, args, kwargs)
    if a is None:
        return _upcast_call(func, args, kwargs, out_dtype)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if out_dtype == torch.float32 and mask is not None and mask.dtype == torch.bfloat16:
        # A bf16 additive mask (built in the weights' dtype) beside fp32 activations: the kernel takes one dtype.
        mask = mask.float()
    fused = (
        # torch.compile cannot trace _fused_sdp_choice (it returns an int): compiled graphs take the generic fp32
        # upcast, whose fp32 saved operands the compiler may then rematerialise.
        not torch.compiler.is_compiling()
        and q.dim() == k.dim() == v.dim() == 4
        and a["dropout_p"] == 0.0
        and not a["enable_gqa"]
        and (mask is None or not mask.requires_grad)
        and torch._fused_sdp_choice(q, k, v, mask, 0.0, a["is_causal"], scale=a["scale"]) == _FLASH
    )
    if not fused:
        return _upcast_call(func, args, kwargs, out_dtype)
    return _FlashAttention.apply(q, k, v, mask, a["is_causal"], a["scale"], out_dtype)


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
# Ops whose outputs never alias their operands and whose backward nodes only read the saved weight: their large
# weight casts may live in reused scratch buffers (_saved).
_WEIGHT_OPS = frozenset({F.linear, torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
                         torch.conv_transpose2d, torch.conv_transpose3d})
# Ops CPU bf16 autocast leaves in fp32: emulated only when their operands are bf16.
_NOT_LOWERED_BY_AUTOCAST = frozenset({torch.mv, _T.mv, torch.addmv, _T.addmv, torch.dot, _T.dot, torch.vdot,
                                      _T.vdot, torch.bilinear})
_OVERRIDE_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _no_override(*args) -> bool:
    return False


_F_WITHOUT_OVERRIDE_CHECK = {**vars(F), **{name: _no_override for name in _OVERRIDE_CHECKS}}


def _transparent(func: types.FunctionType) -> types.FunctionType | None:
    """A copy of a torch.nn.functional composite without its ``__torch_function__`` check.

    A mode is popped while it handles a call, so F.multi_head_attention_forward would run its
    linears and attention unobserved; re-entering the mode around the original would only send
    the same call back to the mode. Limited to torch.nn.functional, whose composites call other
    ops through module globals (Tensor methods re-dispatch to themselves and must not be copied).
    """
    if func.__module__ != F.__name__ or not any(name in func.__code__.co_names for name in _OVERRIDE_CHECKS):
        return None
    copy = types.FunctionType(func.__code__, _F_WITHOUT_OVERRIDE_CHECK, func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names a code object (and the functions defined in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _reaching(targets) -> set[types.FunctionType]:
    """The torch.nn.functional functions that can call one of ``targets``: they name one (``linear``, ``bmm``,
    ``scaled_dot_product_attention``...), name another such function of the module, or run a function passed in
    (``distance_function``). Only these need a mode to see inside them; re-entering it around the rest (dropout,
    layer_norm, batch_norm, relu: 3-4 per block) cost a context switch and a second dispatch per call for nothing."""
    wanted = {getattr(func, "__name__", None) for func in targets} - {None}
    functions = {name: func for name, func in vars(F).items() if type(func) is types.FunctionType}
    names = {name: _names(func.__code__) for name, func in functions.items()}
    reaching = {name for name, func in functions.items()
                if names[name] & wanted or any("function" in arg for arg in func.__code__.co_varnames)}
    grown = True
    while grown:
        more = {name for name in functions if name not in reaching and names[name] & reaching}
        reaching |= more
        grown = bool(more)
    return {functions[name] for name in reaching}


# Built once at import, not on first call: torch.compile cannot trace the creation of a function object
# (type.__new__), and a lazily built copy broke the graph at every functional call inside a compiled forward.
_TRANSPARENT = {
    func: body
    for func in _reaching(_EMULATED)
    if (body := _transparent(func)) is not None
}
# The same for the native policy's attention routing (F.multi_head_attention_forward, used by nn.MultiheadAttention).
_TRANSPARENT_TO_ATTENTION = {
    func: body
    for func in _reaching({F.scaled_dot_product_attention})
    if (body := _transparent(func)) is not None
}


class _EmulationMode(TorchFunctionMode):
    """Routes the ops in _EMULATED to their fp32 implementations when torch would run them in bf16 (or refuse
    their mix of bf16 and fp32 operands)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _EMULATED.get(func)
        if impl is not None:
            out_dtype = _emulated_dtype(_operands(args, kwargs), func not in _NOT_LOWERED_BY_AUTOCAST)
            if out_dtype == torch.float32:
                if func is F.linear and (result := _weight_linear(args, kwargs)) is not None:
                    return result
                # bf16 weights on fp32 activations: casting the weights up (autograd-tracked) is all it takes. The
                # op and its backward then run in C++ on fp32 (autograd keeping the bf16 weight, recast_saved), and
                # the cast's backward rounds the weight grad to bf16; a Python Function per op would add overhead.
                return _upcast_call(func, args, kwargs, out_dtype, scratch=func in _WEIGHT_OPS)
            if out_dtype is not None:
                return impl(func, args, kwargs, out_dtype)
            return func(*args, **kwargs)
        body = _TRANSPARENT.get(func)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        return func(*args, **kwargs)


def _same_dtype_qkv(args):
    """query, key, value in bf16 when they mix bf16 and fp32 (a bf16 model whose rotary embedding is computed in fp32
    from fp32 inputs: Hugging Face Llama fed fp32 embeddings), which torch's attention refuses; as they are else."""
    qkv = args[:3]
    dtypes = {t.dtype for t in qkv if isinstance(t, torch.Tensor)}
    if len(qkv) == 3 and dtypes == {torch.bfloat16, torch.float32}:
        return tuple(t.to(torch.bfloat16) for t in qkv) + tuple(args[3:])
    return args


class _AttentionMode(TorchFunctionMode):
    """The native policy's routing: F.scaled_dot_product_attention goes to ipex_train.attention's bf16 attention
    (which calls torch's for what it does not cover); every other call runs as it would."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return attention.scaled_dot_product_attention(*_same_dtype_qkv(args), **kwargs)
        body = _TRANSPARENT_TO_ATTENTION.get(func)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        return func(*args, **kwargs)
