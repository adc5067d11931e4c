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
    The CPU has bf16 arithmetic: bf16 ops run on it, with two exceptions. In models that call
    attention (:func:`calls_attention`), ``F.scaled_dot_product_attention`` goes to
    ``ipex_train.attention`` (bf16 matmuls around fused softmax rows; torch's for what it does not
    cover), 3.5x faster than torch's bf16 attention at sequence 128. Depthwise ``nn.Conv2d``
    layers (``groups == in_channels > 1``) with a stride above 1 or a kernel above 3 are computed
    in fp32 as under "emulated" (bf16 in, bf16 out): for them oneDNN's bf16 backward runs general
    grouped-conv kernels instead of its depthwise ones. Forward + backward in bf16 took 2.4-5.4x
    the fp32 path's time at stride 2 and 1.1-1.7x at 5x5/7x7 stride 1 (median over shapes;
    ``python -m benchmarks.studies.depthwise_bf16``, Zen 4 with avx512_bf16, 2 threads), which made
    optimize(bf16) slower than fp32 on EfficientNet/MobileNetV3. 3x3 stride-1 ones stay bf16
    (0.56-0.64x the fp32 path's time). Not measured on AMX CPUs. Only while grad is enabled: the
    bf16 forward of these convs is the faster one, so no_grad/inference_mode forwards keep it.
    Hugging Face RMSNorm modules with exactly Llama's formula (:func:`routes_rms_norm`) run
    ``ipex_train.rms_norm`` on bf16 and fp32 CPU inputs: one fused pass per row forward and backward, the
    forward bit-identical to the module's own (docs/compute_policy.md). Hugging Face post-norm output blocks
    (``BertSelfOutput``/``BertOutput`` and the like, :func:`routes_add_norm`) run their dropout + residual add +
    LayerNorm as ``ipex_train.add_norm``, one fused pass per row each way; pre-norm encoder layers (ViT's and those
    with its forward, :func:`routes_prenorm_add_norm`) the residual add after the attention and the LayerNorm after
    it, the sum kept as the residual stream. Hugging Face Llama-family attention
    layers (:func:`routes_rope`) rotate their query and key by ``ipex_train.rope``, one pass each way that writes
    the attention's contiguous layout. Patch embeddings (a plain ``nn.Conv2d``
    whose stride equals its kernel, :func:`routes_patch_embedding`) run as one bf16 GEMM over the unfolded patches.
    ``nn.MultiheadAttention`` self-attention calls (:func:`routes_multihead_attention`) run on the batch-first layout
    through ``ipex_train.attention``, without torch's transposes, copies and split selects around the attention.
    peft ``lora.Linear`` layers (:func:`routes_lora`) run plain LoRA calls through ``ipex_train.lora``, one
    autograd node that sums the adapter's product into the base output in the matmul; any other call runs peft's own
    forward. Hugging Face Llama-family MLPs over SiLU (:func:`routes_swiglu`) run ``silu(gate) * up`` as
    ``ipex_train.swiglu``, one pass each way, between the projections they still call as modules. Hugging Face
    Llama-family decoder layers (:func:`routes_add_rms_norm`) run their residual add + post-attention RMSNorm as
    ``ipex_train.rms_norm.add_rms_norm``, one pass each way (the forward's bits are the layer's own).
    BERT-style intermediate blocks over an exact GELU (:func:`routes_bias_gelu`) keep their forward (the linear
    with its bias, torch's GELU) and run the GELU's backward and the bias gradient as one pass
    (``ipex_train.bias_gelu.gelu_with_bias_grad``); ViT-style MLPs (``ViTMLP`` and the like) likewise before their
    ``fc2``. ``nn.Linear`` modules with a bias (:func:`routes_linear`), and the linears the routes above compute
    themselves, run ``ipex_train.linear``: the bias added in oneDNN's GEMM epilogue instead of copied into the output
    before the GEMM, the same bits as ``F.linear``.
``"emulated"``
    linear, conv1d/2d/3d, conv_transpose1d/2d/3d, matmul (also ``@``), mm, bmm, addmm, baddbmm,
    scaled_dot_product_attention, einsum, tensordot, inner, chain_matmul, linalg.multi_dot,
    linalg.matmul, addbmm, mv, addmv, dot, vdot, bilinear and the RNNs (LSTM, GRU, RNN) are
    computed in fp32 when torch would run them in bf16 (bf16 operands, or fp32 operands under
    CPU bf16 autocast for the ops autocast lowers) and return bf16; when bf16 and fp32 operands
    meet without autocast (bf16 weights, fp32 activations: a mix torch refuses) they are computed
    in fp32 and return fp32. Every other op runs as it would anyway.

    ``optimize(dtype=torch.bfloat16)`` under this policy keeps the activations fp32: converted
    modules take their inputs as they come and hand back fp32 (an embedding's bf16 lookup is cast
    up), so the only casts are each weight's, once per forward and once more in backward
    (autograd keeps the bf16 weight, not its fp32 copy), and its gradient's back to bf16.
    Casting activations to bf16 around every layer would add work and round them, and buys
    nothing where bf16 is computed in fp32 anyway.

:func:`resolve` picks the policy (argument > ``IPEX_TRAIN_BF16_COMPUTE`` > CPU features) and logs
it once on the ``"ipex_train"`` logger.

Mechanism
---------
*Forward*: a :class:`torch.overrides.TorchFunctionMode` is active only while an attached model's
forward runs (:func:`attach` registers a forward pre-hook that enters it and an ``always_call``
forward hook that leaves it, on the model and on each submodule with children, so that a block
recomputed by activation checkpointing during backward runs under it too), so nothing outside
those forwards is touched and no global switch is flipped. The mode sees every torch call made from Python, so
functional code (``torch.matmul``, ``x @ w``, ``F.scaled_dot_product_attention``) is covered as well as
``nn.Linear``/``nn.Conv*``.
The Python composites of torch.nn.functional (``F.multi_head_attention_forward``, used by
nn.MultiheadAttention and nn.TransformerEncoderLayer) run with the mode still active, so the
linears and attention inside them are seen too.

*Backward*: the autograd engine runs backward kernels below the Python layer and outside the
forward's scope, where no torch-function mode sees them. Each emulated op is therefore a custom
:class:`torch.autograd.Function` whose backward also computes in fp32 and returns gradients in
each input's dtype (bf16 for bf16 weights, fp32 for fp32 weights under autocast). The Functions
save their inputs as they come (not fp32 copies of bf16 ones: saved memory stays that of bf16
training) and cast them again in backward. Attention saves its fp32 output and log-sum-exp, which
the fused attention backward needs; that is what fp32 training saves for it. bf16 weights on fp32
activations need no Python Function: ``F.linear`` (every nn.Linear) runs as one C++ autograd node
(``_ops.emulated_linear``) that saves the input and the bf16 weight and casts the weight again in its
backward; the other ops run on autograd-tracked fp32 casts of the weights, so their backward runs in
C++ in fp32 and the cast's backward rounds the weight grad to bf16 (no Python Function per op in
backward). Saved-tensor hooks around those ops make autograd keep the bf16 weight
instead of its fp32 copy and cast it again when backward unpacks it: an fp32 copy of every weight
alive from forward to backward would put peak memory above fp32 training's. Under activation
checkpointing (hooks of its own) and torch.compile the copies are saved as autograd would.

Unusual argument forms (``out=``, ``padding="same"`` with an even kernel, attention with dropout
or a differentiable mask) take the same autograd-level path: still no bf16 matmul.

Layout: this module chooses the policy and attaches/scopes it; ``_functions`` holds the fp32 autograd
Functions; ``_mode`` holds the op table and the TorchFunctionMode that routes ops to them.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch

from .. import linear as _linear_op
from ..base import envvars as _envvars
from ..base.choices import BF16_COMPUTE, parse_bf16_compute
from . import _routes
from ._mode import _AttentionMode, _EmulationMode
from ._routes import (
    routed_modules,
    routes_add_norm,
    routes_add_rms_norm,
    routes_bias_gelu,
    routes_linear,
    routes_lora,
    routes_multihead_attention,
    routes_patch_embedding,
    routes_prenorm_add_norm,
    routes_rms_norm,
    routes_rope,
    routes_swiglu,
)

__all__ = [
    "POLICIES",
    "ENV_VAR",
    "cpu_has_native_bf16",
    "resolve",
    "info",
    "attach",
    "slow_bf16_depthwise",
    "calls_attention",
    "routes_patch_embedding",
    "routes_multihead_attention",
    "routes_rms_norm",
    "routes_add_norm",
    "routes_add_rms_norm",
    "routes_prenorm_add_norm",
    "routes_lora",
    "routes_rope",
    "routed_modules",
    "routes_swiglu",
    "routes_bias_gelu",
    "routes_linear",
    "emulated_bf16",
    "ComputePolicyHandle",
]

POLICIES = BF16_COMPUTE
ENV_VAR = _envvars.BF16_COMPUTE.name
_NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16", "avx_ne_convert")

_log = logging.getLogger("ipex_train")
_logged: set[tuple[str, str]] = set()


# --------------------------------------------------------------------------- policy selection


def _features() -> dict[str, bool]:
    """CPU features as name -> bool (read through :mod:`ipex_train.base.ops`, which probes them)."""
    from ..base import ops as _ops

    return _ops.cpu_features()


def cpu_has_native_bf16(features: dict[str, bool] | None = None) -> bool:
    """True when the CPU has bf16 arithmetic (avx512_bf16, amx_bf16 or avx_ne_convert).

    ``features`` maps feature names to bools; by default they are read from the CPU.
    """
    if features is None:
        features = _features()
    return any(features.get(name, False) for name in _NATIVE_BF16_FEATURES)


def _resolve_with_source(requested: str | None) -> tuple[str, str]:
    requested = parse_bf16_compute(requested, "requested")
    if requested is not None:
        return requested, "argument"
    env = _envvars.BF16_COMPUTE.read()
    if env is not None:
        return env, f"environment variable {ENV_VAR}"
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


# --------------------------------------------------------------------------- scoping


class _Scope(threading.local):
    """A TorchFunctionMode entered per thread while at least one scoped forward runs (re-entrant by depth)."""

    def __init__(self, mode_type):
        self.mode_type = mode_type
        self.depth = 0
        self.mode = None

    def enter(self) -> None:
        if self.depth == 0:
            self.mode = self.mode_type()
            self.mode.__enter__()
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.mode.__exit__(None, None, None)
            self.mode = None


_emulation = _Scope(_EmulationMode)
_attention = _Scope(_AttentionMode)


def _enter() -> None:
    _emulation.enter()


def _leave() -> None:
    _emulation.leave()


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
        """True while the hooks are registered ("native" registers them only on its fp32 depthwise convs, in
        models that call attention (:func:`calls_attention`) to route it to ``ipex_train.attention``, and on the
        modules its routes take: the ``routes_*`` predicates, counted by :func:`routed_modules`)."""
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


# The native policy's depthwise rule is about backward kernels: without grad (eval loops, inference) the bf16
# forward is the faster one (EfficientNet-B0 eval forward 14.6 vs 16.4 ms in fp32). The two hooks bracket one leaf
# conv's forward, which cannot change grad mode, so they agree on whether the scope was entered.
def _enter_attention_hook(module, args):
    _attention.enter()


def _leave_attention_hook(module, args, output):
    _attention.leave()


def _enter_hook_with_grad(module, args):
    if torch.is_grad_enabled():
        _enter()


def _leave_hook_with_grad(module, args, output):
    if torch.is_grad_enabled():
        _leave()


def slow_bf16_depthwise(module: torch.nn.Module) -> bool:
    """Whether the native policy computes ``module`` in fp32: a depthwise Conv2d with stride > 1 or kernel > 3."""
    return (isinstance(module, torch.nn.Conv2d) and 1 < module.groups == module.in_channels
            and (max(module.stride) > 1 or max(module.kernel_size) > 3))


def calls_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` (probably) calls ``F.scaled_dot_product_attention``: it holds an ``nn.MultiheadAttention``,
    a Hugging Face module configured for SDPA attention (``config._attn_implementation == "sdpa"``), or a module with
    ``fused_attn = True`` (timm's attention blocks). The native policy routes attention only in such models."""
    for module in model.modules():
        if isinstance(module, torch.nn.MultiheadAttention) or getattr(module, "fused_attn", None) is True:
            return True
        if getattr(getattr(module, "config", None), "_attn_implementation", None) == "sdpa":
            return True
    return False


def attached(model: torch.nn.Module) -> ComputePolicyHandle | None:
    """The handle of the compute policy attached to ``model`` (by :func:`attach`), or None."""
    return _attached.get(model)


def attach(model: torch.nn.Module, policy: str) -> ComputePolicyHandle:
    """Apply ``policy`` ("native" or "emulated", see :func:`resolve`) to ``model``'s forward.

    "emulated" enters :func:`emulated_bf16` for the duration of each ``model(...)`` call, and of each
    call of one of its submodules that has children outside it (activation checkpointing recomputes
    blocks in backward); the backward of the graph built there is emulated too. "native" enters it
    only around the depthwise convs of :func:`slow_bf16_depthwise`, and, in models that call attention
    (:func:`calls_attention`), routes ``F.scaled_dot_product_attention`` to ``ipex_train.attention`` over the same
    scope as "emulated"; it also swaps in a routed forward on every module one of its routes takes (the
    ``routes_*`` predicates, each naming the kernel it calls; instance-level forwards, removed on detach).
    Attaching again returns the existing handle for the same policy, or replaces a different one.
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
    hooks = []
    # On the model and every submodule that has children: activation checkpointing re-runs a block's forward
    # during backward, outside the model's forward (HF gradient_checkpointing_enable() on a GPT-2 failed with
    # "mat1 and mat2 must have the same dtype"), and the recomputation must run the same ops (the same attention
    # dropout masks). Inside the model's forward the scope is already entered and a block only bumps a per-thread
    # depth. Not on leaf layers: hooks on every module cost 2-5% of a small model's step (timm convnext_atto,
    # mobilenetv3), and checkpointing wraps blocks, not single layers.
    scoped = [module for module in model.modules() if module is model or next(module.children(), None) is not None]
    if policy == "native":
        for module in model.modules():
            if slow_bf16_depthwise(module):
                hooks.append(module.register_forward_pre_hook(_enter_hook_with_grad))
                hooks.append(module.register_forward_hook(_leave_hook_with_grad, always_call=True))
        # Attention calls go to ipex_train.attention (bf16 matmuls + fused softmax rows, 3.5x torch's bf16 attention
        # at sequence 128; docs/attention.md). Only in models that call it: the hooks and the mode cost the others.
        for module in (scoped if calls_attention(model) else ()):
            hooks.append(module.register_forward_pre_hook(_enter_attention_hook))
            hooks.append(module.register_forward_hook(_leave_attention_hook, always_call=True))
        # Module routes (RMSNorm, add + norms, patch embeddings, MultiheadAttention, LoRA, ...): instance-level
        # forwards, deleted again by the handle's remove() (docs/compute_policy.md).
        hooks.extend(_routes.swap_all(model))
        _linear_op.available()  # the linear op's one-time probe now, not inside the first forward
    else:
        for module in scoped:
            hooks.append(module.register_forward_pre_hook(_enter_hook))
            hooks.append(module.register_forward_hook(_leave_hook, always_call=True))
    handle = ComputePolicyHandle(model, policy, tuple(hooks))
    _attached[model] = handle
    return handle
