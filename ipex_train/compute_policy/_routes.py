"""The native policy's module routes: which modules it runs through a kernel of ours by an instance-level forward
(:mod:`._swap`), one predicate per route and the table :func:`swap_all` walks."""
from __future__ import annotations

import torch

from . import (
    _add_norm,
    _add_rms_norm,
    _bias_gelu,
    _linear,
    _lora,
    _mha,
    _patch_embed,
    _prenorm,
    _rms_norm,
    _rope,
    _swiglu,
)


def routes_rms_norm(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module`` through ``ipex_train.rms_norm``: a Hugging Face RMSNorm whose class
    computes exactly LlamaRMSNorm's formula (Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, Phi-3) and
    whose forward is not already replaced on the instance. Only its bf16 inputs go to the kernel."""
    return _rms_norm.routable(module)


def routes_add_norm(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module``'s dropout + residual add + LayerNorm through ``ipex_train.add_norm``:
    a Hugging Face post-norm output block of ``_add_norm.POST_NORM_OUTPUT`` (BERT, RoBERTa and kin) over a plain
    ``nn.Dropout`` and ``nn.LayerNorm``, whose forward is not already replaced on the instance. Calls the kernel
    cannot compute as the class does (hooks, autocast, other dtypes) run the class's ops."""
    return _add_norm.routable(module)


def routes_add_rms_norm(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module``'s residual add + ``post_attention_layernorm`` through
    ``ipex_train.rms_norm.add_rms_norm``: a Hugging Face Llama-family decoder layer (``_add_rms_norm.LLAMA_DECODER``)
    whose forward is the code the route was checked against, with its class's forward. The attention, MLP and input
    norm still run as modules; calls the kernel cannot compute as the class does (hooks on the norm, autocast, other
    dtypes, a norm of another formula) run the class's forward or ops."""
    return _add_rms_norm.routable(module)


def routes_prenorm_add_norm(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module``'s residual add after the attention and the LayerNorm that follows it
    through ``ipex_train.add_norm.add_layer_norm_with_sum``: a Hugging Face pre-norm encoder layer whose forward is the
    code the route was checked against (``_prenorm._CHECKED``: ViT's, shared by DeiT, ViT-MAE and kin) over a plain
    ``nn.LayerNorm`` and ``nn.Dropout``, not already replaced on the instance. The attention, the MLP and the other
    norm still run as modules; calls the kernel cannot compute as the class does (hooks on the norm or the dropout,
    autocast, other dtypes) run the class's ops."""
    return _prenorm.routable(module)


def routes_rope(module: torch.nn.Module) -> bool:
    """Whether the native policy rotates ``module``'s query and key through ``ipex_train.rope``: a Hugging Face
    Llama-family attention layer (``_rope.LLAMA_ATTENTION``) whose forward and rotary helpers are the code the route
    was checked against, with its class's forward. Calls under autocast or on tensors the kernel does not take run the
    class's forward."""
    return _rope.routable(module)


def routes_swiglu(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module``'s ``act_fn(gate_proj(x)) * up_proj(x)`` through
    ``ipex_train.swiglu``: a Hugging Face Llama-family MLP of ``_swiglu.LLAMA_MLP`` with a SiLU activation, whose
    forward is not already replaced on the instance. The projections still run as modules; calls the kernel cannot
    compute as the class does (hooks on the activation, autocast, other dtypes) run the class's ops."""
    return _swiglu.routable(module)


def routes_bias_gelu(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module``'s up-projection + GELU through
    ``ipex_train.bias_gelu.gelu_with_bias_grad`` (the class's forward, bit for bit; the GELU's backward and the bias
    gradient in one pass): a Hugging Face block whose class's forward is BertIntermediate's (BERT, RoBERTa, ELECTRA
    and ~50 more) or ViTMLP's (ViT, DeiT, BEiT, Dinov2 and ~80 more), checked against transformers 5.24's code, over
    a plain ``nn.Linear`` with a bias and an exact (erf) GELU, whose forward is not already replaced on the instance.
    Calls the kernel cannot compute as the class does (hooks on the linear or the activation, autocast, other dtypes)
    run the class's forward."""
    return _bias_gelu.routable(module)


def routes_patch_embedding(module: torch.nn.Module) -> bool:
    """Whether the native policy computes ``module`` as a GEMM over unfolded patches: a plain ``nn.Conv2d`` whose
    stride equals its kernel (above 1), without padding, dilation or groups, whose forward is not already replaced on
    the instance. Only its batched bf16 CPU inputs take the GEMM."""
    return _patch_embed.routable(module)


def routes_multihead_attention(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module``'s self-attention calls through ``ipex_train.attention`` on the
    batch-first layout (no transposes, copies or split selects around it): an ``nn.MultiheadAttention`` with its
    class's forward, one packed input projection, no ``bias_k``/``bias_v`` and no ``add_zero_attn``, not already
    replaced on the instance. Other calls (cross-attention, ``need_weights``, masks other than a key padding mask or
    the causal hint, autocast, no grad) run the class's forward."""
    return _mha.routable(module)


def routes_lora(module: torch.nn.Module) -> bool:
    """Whether the native policy routes ``module``'s calls to ``ipex_train.lora``: a peft ``lora.Linear`` over a plain
    ``nn.Linear`` whose forward is not already replaced on the instance. Each call still takes the fused path only
    when it is plain LoRA on CPU tensors of one dtype (bf16 or fp32), else peft's own forward
    (docs/compute_policy.md)."""
    return _lora.routable(module)


def routes_linear(module: torch.nn.Module) -> bool:
    """Whether the native policy runs ``module`` through ``ipex_train.linear``: an ``nn.Linear`` with a bias and at
    least 512 output features (its class's forward, not already replaced on the instance), whose bias oneDNN then
    adds in the GEMM's epilogue rather than torch copying it into the output first; the same bits as ``F.linear``.
    Calls the op does not take, or with outputs under ``ipex_train.linear.MIN_OUTPUT_ELEMENTS``, run ``F.linear``."""
    return _linear.routable(module)


# (predicate, swap) per route, in the order attach() applies them. Llama-family RMSNorm: ~10 autograd passes in torch
# ops, one fused pass per row here; post-norm blocks: dropout + residual add + LayerNorm in one pass each way;
# pre-norm (ViT) layers: the same after the attention, the sum passed on as the residual stream;
# Llama-family rotary embeddings in one pass that writes the attention's layout; patch embeddings (stride == kernel)
# as one GEMM over the unfolded patches; nn.MultiheadAttention self-attention on the batch-first layout, without
# torch's transposes and split copies; peft LoRA: the adapter's product summed into the base output by the matmul;
# Llama-family MLPs: silu(gate) * up in one pass each way; Llama-family decoder layers: the residual add and the
# post-attention RMSNorm in one pass each way; BERT-style intermediate blocks: bias + GELU in one pass each way, the
# bias gradient reduced in the backward's pass (and ViT-style MLPs' first half likewise); linears with a bias: the
# bias in the GEMM's epilogue (last: the routes above call some linears themselves, through the same op).
ROUTES = (
    (routes_rms_norm, _rms_norm.swap),
    (routes_add_norm, _add_norm.swap),
    (routes_prenorm_add_norm, _prenorm.swap),
    (routes_rope, _rope.swap),
    (routes_patch_embedding, _patch_embed.swap),
    (routes_multihead_attention, _mha.swap),
    (routes_lora, _lora.swap),
    (routes_swiglu, _swiglu.swap),
    (routes_add_rms_norm, _add_rms_norm.swap),
    (routes_bias_gelu, _bias_gelu.swap),
    (routes_linear, _linear.swap),
)


# The forward each route sets on a module, by the route's name (what routed_modules counts).
ROUTED_FORWARDS = (
    ("rms_norm", _rms_norm.forward),
    ("add_norm", _add_norm.forward),
    ("prenorm_add_norm", _prenorm.forward),
    ("swiglu", _swiglu.forward),
    ("rope", _rope.forward),
    ("patch_embedding", _patch_embed.forward),
    ("multihead_attention", _mha.forward),
    ("lora", _lora.forward),
    ("add_rms_norm", _add_rms_norm.forward),
    ("bias_gelu", _bias_gelu.forward),
    ("linear", _linear.forward),
)


def routed_modules(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of ``model`` each module route currently runs (route name -> count; routes with none are
    left out, the others in the order of ROUTED_FORWARDS), read from the modules' instance-level forwards."""
    name_of = {forward: name for name, forward in ROUTED_FORWARDS}
    counts: dict[str, int] = {}
    for module in model.modules():
        name = name_of.get(getattr(vars(module).get("forward"), "__func__", None))
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return {name: counts[name] for name, _ in ROUTED_FORWARDS if name in counts}


def swap_all(model: torch.nn.Module) -> list:
    """Swap in the routed forward of every module of ``model`` a route takes; the handles' ``remove()`` undo it."""
    return [swap(module) for routable, swap in ROUTES for module in model.modules() if routable(module)]
