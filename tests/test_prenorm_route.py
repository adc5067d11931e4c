"""The native compute policy's routing of Hugging Face pre-norm encoder layers (ViTLayer and the classes with its
forward) to ipex_train.add_norm.add_layer_norm_with_sum; the op's own numerics are in tests/test_add_norm_with_sum.py.

Routed against unrouted: the same small ViT, trained 3 SGD steps under optimize(bf16, "native") from the same weights
and batch, dropout 0. The routed layers compute the residual add and layernorm_after in fp32 and round the sum and
y once each, as torch's bf16 add and mixed-dtype LayerNorm (fp32 statistics) do, so losses agree within 1% per step
and every parameter after 3 steps within 5% of the larger of its largest magnitude and 20x its largest change over
the steps, plus 1e-6 (the post-norm route's bounds, tests/test_add_norm_route.py). Measured here: the three losses
equal to the printed digits, parameters within 4e-9 of each other (the fused op rounds the sum and y as torch's ops
do; only the weight-gradient sums' order differs).
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

transformers = pytest.importorskip("transformers")
from transformers.models.vit.modeling_vit import ViTLayer  # noqa: E402

BF16 = torch.bfloat16
OURS = "ipex_train.add_layer_norm_forward"
OURS_BACKWARD = "ipex_train.add_layer_norm_backward"
LAYERS = 2


def _config(dropout=0.0):
    return transformers.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, image_size=32, patch_size=8, num_channels=3,
                                  hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0,
                                  attn_implementation="sdpa")


def _vit(dropout=0.0):
    torch.manual_seed(0)
    return transformers.ViTModel(_config(dropout), add_pooling_layer=False).train()


PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
TARGET = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(1))


def _loss(model):
    return (model(pixel_values=PIXELS).last_hidden_state.float() - TARGET).pow(2).mean()


def _train(model, opt, steps=3):
    return train(model, opt, _loss, steps)


def _layers(model):
    return [m for m in model.modules() if isinstance(m, ViTLayer)]


@native
def test_routed_trains_as_unrouted(monkeypatch):
    base = _vit()
    start = copy.deepcopy(base.state_dict())
    model, opt = optimized(base)
    assert cp.routed_modules(model).get("prenorm_add_norm") == LAYERS
    assert all("forward" in vars(m) for m in _layers(model))
    with OpNames() as ops:
        routed = _train(model, opt, steps=1)
    assert ops.names.count(OURS) == LAYERS and ops.names.count(OURS_BACKWARD) == LAYERS
    routed += _train(model, opt, steps=2)
    ref_base = _vit()
    ref_base.load_state_dict(start)
    monkeypatch.setattr(cp._prenorm, "routable", lambda module: False)
    ref_model, ref_opt = optimized(ref_base)
    assert "prenorm_add_norm" not in cp.routed_modules(ref_model)
    with OpNames() as ops:
        unrouted = _train(ref_model, ref_opt, steps=1)
    assert OURS not in ops.names
    unrouted += _train(ref_model, ref_opt, steps=2)
    assert_trained_alike(routed, unrouted, model, ref_model, start)


@native
def test_dropout_routed_model_trains():
    model, opt = optimized(_vit(dropout=0.1), lr=0.02)
    torch.manual_seed(0)
    with OpNames() as ops:
        losses = _train(model, opt, steps=1)
    assert ops.names.count(OURS) == LAYERS and ops.names.count(OURS_BACKWARD) == LAYERS
    losses += _train(model, opt, steps=7)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0]
    with torch.no_grad():
        a, b = (model(pixel_values=PIXELS).last_hidden_state for _ in range(2))
        assert not torch.equal(a, b)
        model.eval()
        a, b = (model(pixel_values=PIXELS).last_hidden_state for _ in range(2))
        assert torch.equal(a, b)


def _layer_and_input(dtype=BF16):
    torch.manual_seed(0)
    layer = ViTLayer(_config(0.0)).train()
    h = torch.randn(2, 5, 64).to(dtype)
    return layer, h


def _routed_call(layer, h, with_class=False):
    """The routed layer's output and whether the fused op ran; with_class: also the class's forward, called under
    the same attached policy (which routes the attention too)."""
    handle = cp.attach(layer, "native")
    try:
        with OpNames() as ops:
            out = layer(h)
        ref = type(layer).forward(layer, h) if with_class else None
    finally:
        handle.remove()
    return (out, OURS in ops.names, ref) if with_class else (out, OURS in ops.names)


@native
def test_routed_layer_matches_unrouted_layer_with_gradients():
    layer, h = _layer_and_input()
    layer.to(BF16).layernorm_before.float()
    layer.layernorm_after.float()  # optimize keeps norms fp32
    ref_layer = copy.deepcopy(layer)
    h_ref, h = h.clone().requires_grad_(), h.clone().requires_grad_()
    g = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)).to(BF16)
    ref = ref_layer(h_ref)
    ref.backward(g)
    out, fused = _routed_call(layer, h)
    out.backward(g)
    assert fused and out.dtype == ref.dtype == BF16
    assert (out.float() - ref.float()).abs().max().item() <= 2**-6 * ref.float().abs().max().item()
    # The input's gradient flows through the residual stream (the sum's own gradient) and the norm.
    assert (h.grad.float() - h_ref.grad.float()).abs().max().item() <= 2**-5 * h_ref.grad.float().abs().max().item()
    ref_params = dict(ref_layer.named_parameters())
    for name, p in layer.named_parameters():
        if name == "attention.k_proj.bias":  # zero in exact arithmetic (softmax ignores it): rounding noise only
            continue
        q = ref_params[name].grad.float()
        assert (p.grad.float() - q).abs().max().item() <= 2**-5 * q.abs().max().item() + 1e-6, name


@native
@pytest.mark.parametrize("case", ["norm_hook", "dropout_hook", "global_hook", "autocast", "fp16", "p_one",
                                  "before_hook"])
def test_fallbacks_compute_as_the_class(case):
    # The reference: the class's forward under the same attached policy (which also routes the attention).
    layer, h = _layer_and_input(torch.float16 if case == "fp16" else torch.float32)
    if case == "fp16":  # the attention runs, then the class's remaining ops (the kernel takes bf16 and fp32)
        layer.half()
    handles = []
    if case == "norm_hook":
        handles = [layer.layernorm_after.register_forward_hook(lambda mod, a, o: o * 2)]
    elif case == "dropout_hook":
        handles = [layer.dropout.register_forward_pre_hook(lambda mod, a: None)]
    elif case == "before_hook":  # layernorm_before is still called as a module: its hooks run, the add still fuses
        handles = [layer.layernorm_before.register_forward_hook(lambda mod, a, o: o * 2)]
    elif case == "global_hook":
        handles = [torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: None)]
    elif case == "p_one":
        layer.dropout.p = 1.0
    try:
        with torch.autocast("cpu", dtype=BF16, enabled=case == "autocast"):
            out, fused, ref = _routed_call(layer, h, with_class=True)
    finally:
        for handle in handles:
            handle.remove()
    if case == "before_hook":
        assert fused and (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()  # fp32: rounding only
    else:
        assert not fused and torch.equal(out, ref)


def test_routable_classes():
    config = _config()
    assert cp.routes_prenorm_add_norm(ViTLayer(config))
    # Classes with ViTLayer's forward, token for token (the code hash), route; others do not.
    from transformers.models.deit.modeling_deit import DeiTLayer
    from transformers.models.dinov2.modeling_dinov2 import Dinov2Layer
    from transformers.models.vit_mae.modeling_vit_mae import ViTMAELayer

    assert cp.routes_prenorm_add_norm(DeiTLayer(transformers.DeiTConfig(**config.to_diff_dict())))
    assert cp.routes_prenorm_add_norm(ViTMAELayer(transformers.ViTMAEConfig(hidden_size=64, intermediate_size=128,
                                                                            num_attention_heads=4)))
    assert not cp.routes_prenorm_add_norm(Dinov2Layer(transformers.Dinov2Config(hidden_size=64,
                                                                                num_attention_heads=4)))
    layer = ViTLayer(config)
    layer.layernorm_after = torch.nn.RMSNorm(64)
    assert not cp.routes_prenorm_add_norm(layer)
    layer = ViTLayer(config)
    layer.dropout = torch.nn.Identity()
    assert not cp.routes_prenorm_add_norm(layer)
    layer = ViTLayer(config)
    layer.layernorm_after = torch.nn.LayerNorm(64, bias=False)  # the op takes bias=None
    assert cp.routes_prenorm_add_norm(layer)


def test_other_code_is_not_routed(monkeypatch):
    # Another transformers release whose ViTLayer.forward differs: the hash no longer matches, the class's forward runs.
    monkeypatch.setattr(cp._prenorm, "_CHECKED", "0" * 16)
    cp._prenorm._checked.cache_clear()
    try:
        assert not cp.routes_prenorm_add_norm(ViTLayer(_config()))
    finally:
        cp._prenorm._checked.cache_clear()


@native
def test_detach_restores_and_attach_again():
    model, _ = optimized(_vit())
    detach_restores_and_attach_again(model, _layers(model), cp.routes_prenorm_add_norm, OURS,
                                     lambda m: m(pixel_values=PIXELS).last_hidden_state)


def test_emulated_policy_does_not_route():
    emulated_does_not_route(_vit(), _layers, lambda m, o: _train(m, o, steps=1), OURS)


@native
def test_gradient_checkpointing_recomputes_the_same_dropout():
    # The routed forward checkpoints as the class's wrapper does; the recomputation draws the same dropout seeds.
    def grads(checkpointing):
        model = _vit(dropout=0.2)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model, _ = optimized(model)
        torch.manual_seed(5)
        with OpNames() as ops:
            _loss(model).backward()
        assert ops.names.count(OURS) == LAYERS * (2 if checkpointing else 1)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-3, atol=1e-6, msg=name)


@native
def test_routed_layer_compiles_without_graph_break():
    # Eager attention: the policy's SDPA route (a mode entered by module hooks) is not what this test is about.
    torch.manual_seed(0)
    config = _config()
    config._attn_implementation = "eager"
    layer = ViTLayer(config).train()
    h = torch.randn(2, 5, 64).to(BF16)
    layer.to(BF16).layernorm_after.float()
    handle = cp.attach(layer, "native")
    try:
        torch._dynamo.reset()
        assert torch._dynamo.explain(layer)(h).graph_break_count == 0
        out = torch.compile(layer, fullgraph=True)(h)
        assert torch.equal(out, layer(h))
    finally:
        handle.remove()
