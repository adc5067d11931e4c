"""The native compute policy's routing of Hugging Face Llama-family decoder layers' residual add +
post_attention_layernorm to ipex_train.rms_norm.add_rms_norm; the op's own numerics are in tests/test_add_rms_norm.py.

A routed layer's forward has the class's bits (torch.equal on bf16 and fp32, the route alone). Routed against
unrouted training: the same tiny LlamaForCausalLM trained 3 SGD steps under optimize(bf16, "native") from the same
weights and batch, every other route on in both. The routed backward adds the sum's two gradients in fp32 and rounds
once (autograd rounds each to bf16, then their sum), so losses agree within 1% per step and every parameter after 3
steps within 5% of the larger of its largest magnitude and 20x its largest change, plus 1e-6 (bf16 weights round a
slightly different update differently).
"""
import copy

import pytest
import torch
from op_names import OpNames
from route_checks import (
    assert_trained_alike,
    detach_restores_and_attach_again,
    emulated_does_not_route,
    native,
    optimized,
    train,
)

import ipex_train.compute_policy as cp
from ipex_train.compute_policy import _add_rms_norm

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

BF16 = torch.bfloat16
OURS = "ipex_train.add_rms_norm_forward"
OURS_BACKWARD = "ipex_train.add_rms_norm_backward"
LAYERS = 2
VOCAB, SEQ = 100, 24


def _config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=SEQ * 2, initializer_range=0.1)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config()).train()


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _train(model, opt, steps=3):
    return train(model, opt, lambda m: m(input_ids=IDS, labels=IDS).loss, steps)


def _layers(model):
    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


@native
def test_routed_trains_as_unrouted(monkeypatch):
    base = _llama()
    start = copy.deepcopy(base.state_dict())
    model, opt = optimized(base)
    assert cp.routed_modules(model)["add_rms_norm"] == LAYERS
    with OpNames() as ops:
        routed = _train(model, opt, steps=1)
    assert ops.names.count(OURS) == LAYERS and ops.names.count(OURS_BACKWARD) == LAYERS
    routed += _train(model, opt, steps=2)
    ref_base = _llama()
    ref_base.load_state_dict(start)
    monkeypatch.setattr(_add_rms_norm, "routable", lambda module: False)
    ref_model, ref_opt = optimized(ref_base)
    assert "add_rms_norm" not in cp.routed_modules(ref_model) and "rms_norm" in cp.routed_modules(ref_model)
    with OpNames() as ops:
        unrouted = _train(ref_model, ref_opt, steps=1)
    assert OURS not in ops.names
    unrouted += _train(ref_model, ref_opt, steps=2)
    assert_trained_alike(routed, unrouted, model, ref_model, start)


def _layer_and_inputs(dtype=BF16, seq=7):
    model = _llama().to(dtype)
    x = torch.randn(2, seq, 64).to(dtype)
    pos = torch.arange(seq).unsqueeze(0)
    return model, _layers(model)[0], x, model.model.rotary_emb(x, pos)


def _routed_call(layer, x, pe, **kwargs):
    handle = _add_rms_norm.swap(layer)  # this route alone: the other submodules run as in the class's call
    try:
        with OpNames() as ops:
            out = layer(x, position_embeddings=pe, **kwargs)
    finally:
        handle.remove()
    return out, OURS in ops.names


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
def test_routed_layer_has_the_class_bits(dtype):
    _, layer, x, pe = _layer_and_inputs(dtype)
    ref = layer(x, position_embeddings=pe)
    out, fused = _routed_call(layer, x, pe)
    assert fused and out.dtype == ref.dtype == dtype and torch.equal(out, ref)
    # Under the RMSNorm route too (post_attention_layernorm routed on the instance: still fused, same bits).
    handle = cp._rms_norm.swap(layer.post_attention_layernorm)
    try:
        out, fused = _routed_call(layer, x, pe)
    finally:
        handle.remove()
    assert fused and torch.equal(out, ref)


@pytest.mark.parametrize("case", ["norm_hook", "global_hook", "autocast", "fp16", "norm_forward", "norm_class",
                                  "positional"])
def test_fallbacks_compute_as_the_class(case):
    _, layer, x, pe = _layer_and_inputs(torch.float16 if case == "fp16" else torch.float32)
    handles, args = [], ()
    norm = layer.post_attention_layernorm
    if case == "norm_hook":
        handles = [norm.register_forward_hook(lambda mod, a, o: o * 2)]
    elif case == "global_hook":
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)]
    elif case == "norm_forward":  # an instance-level forward (another library's patch)
        norm.forward = lambda t: t * 3
    elif case == "norm_class":
        layer.post_attention_layernorm = torch.nn.RMSNorm(64, eps=1e-6)
    elif case == "positional":
        args = (None,)  # attention_mask passed positionally
    try:
        with torch.autocast("cpu", dtype=BF16, enabled=case == "autocast"):
            ref = layer(x, *args, position_embeddings=pe)
            handle = _add_rms_norm.swap(layer)
            try:
                with OpNames() as ops:
                    out = layer(x, *args, position_embeddings=pe)
            finally:
                handle.remove()
    finally:
        for h in handles:
            h.remove()
    assert OURS not in ops.names
    assert torch.equal(out, ref)


def test_generation_with_cache_matches_the_class():
    model, _, _, _ = _layer_and_inputs(torch.float32)
    model.eval()
    prompt = IDS[:, :6]
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        handles = [_add_rms_norm.swap(layer) for layer in _layers(model)]
        try:
            with OpNames() as ops:
                out = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        finally:
            for h in handles:
                h.remove()
    assert ops.names.count(OURS) == LAYERS * 6  # the prompt, then one call per new token but the last
    assert torch.equal(out, ref)


def test_routable_classes(monkeypatch):
    config = _config()
    layer = LlamaDecoderLayer(config, 0)
    assert cp.routes_add_rms_norm(layer)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    qwen = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16)
    assert cp.routes_add_rms_norm(Qwen3DecoderLayer(qwen, 0))
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer  # Llama's forward, other norms

    assert not cp.routes_add_rms_norm(GemmaDecoderLayer(transformers.GemmaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16), 0))

    class Custom(LlamaDecoderLayer):  # a subclass may change forward: not routed by name
        pass

    assert not cp.routes_add_rms_norm(Custom(config, 0))
    layer.forward = lambda *a, **k: None
    assert not cp.routes_add_rms_norm(layer)
    # Another release's code (here: another expected hash) leaves the layers unrouted.
    monkeypatch.setattr(_add_rms_norm, "_CHECKED", "0" * 16)
    _add_rms_norm._checked.cache_clear()
    try:
        assert not cp.routes_add_rms_norm(LlamaDecoderLayer(config, 0))
    finally:
        monkeypatch.undo()
        _add_rms_norm._checked.cache_clear()
    assert cp.routes_add_rms_norm(LlamaDecoderLayer(config, 0))


@native
def test_detach_restores_and_attach_again():
    model, _ = optimized(_llama())
    detach_restores_and_attach_again(model, _layers(model), cp.routes_add_rms_norm, OURS,
                                     lambda m: m(input_ids=IDS).logits)


def test_emulated_policy_does_not_route():
    emulated_does_not_route(_llama(), _layers, lambda m, o: _train(m, o, steps=1), OURS)


@native
def test_fp32_residual_stream_is_fused():
    # As benchmarks' llama_s256: fp32 embeddings keep the residual stream fp32 while the attention's output is bf16,
    # a pair the kernel takes (the sum fp32, as torch's promotion of `residual + h`).
    model, _ = optimized(_llama())
    embeds = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(0))
    with OpNames() as ops:
        model(inputs_embeds=embeds, labels=IDS).loss.backward()
    assert ops.names.count(OURS) == LAYERS and ops.names.count(OURS_BACKWARD) == LAYERS


@native
def test_gradient_checkpointing_recomputes_the_routed_forward():
    # LlamaDecoderLayer's __call__ (GradientCheckpointingLayer) checkpoints whatever forward the instance has: the
    # routed one runs twice per layer (forward, then the recomputation) and the gradients are those without
    # checkpointing, bit for bit (no dropout, the same ops recomputed).
    def grads(checkpointing):
        model = _llama()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model, _ = optimized(model)
        assert cp.routed_modules(model)["add_rms_norm"] == LAYERS
        with OpNames() as ops:
            model(input_ids=IDS, labels=IDS).loss.backward()
        assert ops.names.count(OURS) == LAYERS * (2 if checkpointing else 1)
        assert ops.names.count(OURS_BACKWARD) == LAYERS
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name, g in plain.items():
        assert torch.equal(checkpointed[name], g), name


@native
@pytest.mark.parametrize("cache_args", ["use_cache", "cache", "neither"])
def test_checkpointing_leaves_a_dropped_cache_to_the_class(cache_args):
    # Checkpointing, GradientCheckpointingLayer's wrapper drops use_cache=True or a cache (and warns) before it
    # checkpoints the class's forward; the routed forward leaves such calls to it: nothing fused, the class's bits, the
    # cache untouched. Other calls are fused and checkpointed by the routed forward itself.
    model, layer, x, pe = _layer_and_inputs(torch.float32)
    model.gradient_checkpointing_enable()
    x.requires_grad_()

    def kwargs():
        return {"use_cache": {"use_cache": True}, "cache": {"cache": transformers.DynamicCache(config=model.config)},
                "neither": {"use_cache": False, "cache": None}}[cache_args]

    ref = layer(x, position_embeddings=pe, **kwargs())
    routed_kwargs = kwargs()
    out, fused = _routed_call(layer, x, pe, **routed_kwargs)
    assert fused == (cache_args == "neither")
    assert torch.equal(out, ref)
    if cache_args == "cache":
        assert routed_kwargs["cache"].get_seq_length() == 0
