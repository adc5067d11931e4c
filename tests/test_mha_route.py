"""The native compute policy's route for ``nn.MultiheadAttention`` self-attention: the packed projection viewed into
the attention's layout and ``ipex_train.attention`` called on it, without torch's transposes, copies and selects.

Routed against the class (under the same policy, so the attention itself is ipex_train's in both): the output bit for
bit, the gradients within bf16 rounding (they are summed in another order); torchvision's ViT and an
``nn.TransformerEncoder`` with a key padding mask trained 3 SGD steps routed and unrouted from the same weights. Every
call the route does not compute as the class does runs the class's forward.
"""
import pickle
import types
from unittest import mock

import pytest
import torch
from route_checks import assert_trained_alike, emulated_does_not_route, native, optimized, train

import ipex_train
import ipex_train.compute_policy as cp
from ipex_train.compute_policy import _mha

BF16 = torch.bfloat16
OURS = "ipex_train.attention_forward"


class _Counted:
    """Stands in for the ``ipex_train.attention`` module inside the route: counts the route's calls."""

    def __init__(self):
        self.calls = 0

    def scaled_dot_product_attention(self, *args, **kwargs):
        self.calls += 1
        return ipex_train.attention.scaled_dot_product_attention(*args, **kwargs)


def _pair(batch_first=True, bias=True, dropout=0.0, width=64, heads=4):
    """The same module optimized twice (bf16, native policy): routed, and with the route off."""
    def build(routed):
        torch.manual_seed(0)
        m = torch.nn.MultiheadAttention(width, heads, bias=bias, dropout=dropout, batch_first=batch_first).train()
        with mock.patch.object(_mha, "routable", _mha.routable if routed else (lambda module: False)):
            m, _ = optimized(m)
        return m
    return build(True), build(False)


def _input(batch_first, batch=3, seq=20, width=64, seed=1):
    shape = (batch, seq, width) if batch_first else (seq, batch, width)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _run(module, x, **kwargs):
    """Output and the gradients of the input and every parameter (for a fixed output gradient)."""
    x = x.detach().requires_grad_()
    out, weights = module(x, x, x, **kwargs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    grads = torch.autograd.grad(out, [x, *module.parameters()], g)
    return out, weights, grads


def _close(a, b):
    scale = b.float().abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= 2**-7 * scale + 1e-6


CALLS = {
    "plain": {"need_weights": False},
    "padding mask": {"need_weights": False, "key_padding_mask": "pad"},
    "additive padding mask": {"need_weights": False, "key_padding_mask": "additive"},
    "causal": {"need_weights": False, "attn_mask": "causal", "is_causal": True},
}


@native
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("call", CALLS)
def test_routed_matches_the_class(batch_first, bias, call):
    routed, plain = _pair(batch_first, bias)
    x = _input(batch_first)
    kwargs = dict(CALLS[call])
    if kwargs.get("key_padding_mask") in ("pad", "additive"):
        pad = torch.zeros(3, 20, dtype=torch.bool)
        pad[0, 15:] = True
        pad[2, 5:] = True
        if kwargs["key_padding_mask"] == "additive":  # as nn.TransformerEncoder passes it, plus a finite bias
            pad = torch.zeros(3, 20).masked_fill(pad, float("-inf"))
            pad[1, 3] = -2.5
        kwargs["key_padding_mask"] = pad
    if kwargs.get("attn_mask") == "causal":
        kwargs["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(20)
    counted = _Counted()
    with mock.patch.object(_mha, "attention", counted):
        out, weights, grads = _run(routed, x, **kwargs)
    assert counted.calls == 1 and weights is None
    ref_out, ref_weights, ref_grads = _run(plain, x, **kwargs)
    assert ref_weights is None
    assert out.dtype == BF16 and out.shape == ref_out.shape
    assert torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        _close(got, want)


@native
def test_routed_dropout_draws_as_the_class():
    routed, plain = _pair(dropout=0.3)
    x = _input(True)
    torch.manual_seed(5)
    out, _, grads = _run(routed, x, need_weights=False)
    torch.manual_seed(5)
    ref_out, _, ref_grads = _run(plain, x, need_weights=False)
    assert torch.equal(out, ref_out)
    for got, want in zip(grads, ref_grads):
        _close(got, want)


def _cross(module, x):
    return module(x, x.clone(), x.clone(), need_weights=False)


FALLBACKS = {
    "cross-attention": lambda m, x: _cross(m, x),
    "need_weights": lambda m, x: m(x, x, x),
    "float attn_mask": lambda m, x: m(x, x, x, need_weights=False, attn_mask=torch.zeros(20, 20)),
    "bool attn_mask": lambda m, x: m(x, x, x, need_weights=False,
                                     attn_mask=torch.ones(20, 20, dtype=torch.bool).triu(1)),
    "padding and attention masks": lambda m, x: m(x, x, x, need_weights=False, attn_mask=torch.zeros(20, 20),
                                                  key_padding_mask=torch.zeros(3, 20)),
    "padding mask with causal hint": lambda m, x: m(
        x, x, x, need_weights=False, key_padding_mask=torch.zeros(3, 20), is_causal=True,
        attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(20)),
    "unbatched": lambda m, x: m(x[0], x[0], x[0], need_weights=False),
    "no grad": lambda m, x: _no_grad(m, x),
    "autocast": lambda m, x: _autocast(m, x),
}


def _no_grad(m, x):
    with torch.no_grad():
        return m(x, x, x, need_weights=False)


def _autocast(m, x):
    with torch.autocast("cpu", dtype=BF16):
        return m(x, x, x, need_weights=False)


@native
@pytest.mark.parametrize("case", FALLBACKS)
def test_fallbacks_compute_as_the_class(case):
    routed, plain = _pair()
    x = _input(True).requires_grad_()
    counted = _Counted()
    with mock.patch.object(_mha, "attention", counted):
        out = FALLBACKS[case](routed, x)
    assert counted.calls == 0
    ref = FALLBACKS[case](plain, x)
    for got, want in zip(out, ref):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


@native
def test_a_call_the_class_refuses_raises_as_the_class():
    routed, plain = _pair()
    x = _input(True)
    bad = torch.zeros(3, 1, dtype=torch.bool)  # not (batch, seq)
    with pytest.raises(AssertionError) as want:
        plain(x, x, x, need_weights=False, key_padding_mask=bad)
    with pytest.raises(AssertionError) as got:
        routed(x, x, x, need_weights=False, key_padding_mask=bad)
    assert str(got.value) == str(want.value)


def test_routable_configurations():
    assert cp.routes_multihead_attention(torch.nn.MultiheadAttention(64, 4))
    assert cp.routes_multihead_attention(torch.nn.MultiheadAttention(64, 4, bias=False, batch_first=True))
    assert not cp.routes_multihead_attention(torch.nn.MultiheadAttention(64, 4, add_bias_kv=True))
    assert not cp.routes_multihead_attention(torch.nn.MultiheadAttention(64, 4, add_zero_attn=True))
    assert not cp.routes_multihead_attention(torch.nn.MultiheadAttention(64, 4, kdim=32, vdim=32))
    assert not cp.routes_multihead_attention(torch.nn.Linear(64, 64))

    class Custom(torch.nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    assert not cp.routes_multihead_attention(Custom(64, 4))
    swapped = torch.nn.MultiheadAttention(64, 4)
    swapped.forward = types.MethodType(lambda self, *a, **k: None, swapped)
    assert not cp.routes_multihead_attention(swapped)


def _vit():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                hidden_dim=64, mlp_dim=128, num_classes=10).train()


def _vit_loss(model):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (4,), generator=gen)
    return torch.nn.functional.cross_entropy(model(x).float(), y)


class _Encoder(torch.nn.Module):
    """An ``nn.TransformerEncoder`` (post-norm, sequence-first) over token embeddings, fed a key padding mask."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 64)
        layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 50)

    def forward(self, ids, pad):
        return self.head(self.encoder(self.embed(ids).transpose(0, 1), src_key_padding_mask=pad))


def _encoder():
    torch.manual_seed(0)
    return _Encoder().train()


def _encoder_loss(model):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (4, 16), generator=gen)
    pad = torch.zeros(4, 16, dtype=torch.bool)
    pad[1, 10:] = True
    pad[3, 4:] = True
    logits = model(ids, pad).float().transpose(0, 1)
    keep = ~pad
    return torch.nn.functional.cross_entropy(logits[keep], ids[keep])


def _attentions(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]


@native
@pytest.mark.parametrize("build, loss", [(_vit, _vit_loss), (_encoder, _encoder_loss)], ids=["vit", "encoder"])
def test_routed_trains_as_unrouted(build, loss):
    model, opt = optimized(build())
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert cp.routed_modules(model).get("multihead_attention") == 2
    assert all("forward" in vars(m) for m in _attentions(model))
    counted = _Counted()
    with mock.patch.object(_mha, "attention", counted):
        routed = train(model, opt, loss, 3)
    assert counted.calls == 3 * 2
    with mock.patch.object(_mha, "routable", lambda module: False):
        ref_model, ref_opt = optimized(build())
    assert "multihead_attention" not in cp.routed_modules(ref_model)
    unrouted = train(ref_model, ref_opt, loss, 3)
    assert_trained_alike(routed, unrouted, model, ref_model, start)


@native
def test_detach_restores_and_attach_again():
    model, _ = optimized(_vit())
    modules = _attentions(model)
    assert modules and all(not cp.routes_multihead_attention(m) for m in modules)  # already routed
    routed = _vit_loss(model)
    cp.attached(model).remove()
    assert all("forward" not in vars(m) and cp.routes_multihead_attention(m) for m in modules)
    counted = _Counted()
    with mock.patch.object(_mha, "attention", counted):
        plain = _vit_loss(model)
    assert counted.calls == 0
    assert torch.equal(routed, plain)
    handle = cp.attach(model, "native")
    assert all("forward" in vars(m) for m in modules)
    copied = pickle.loads(pickle.dumps(model))
    assert torch.equal(_vit_loss(copied), routed)
    handle.remove()


def test_emulated_policy_does_not_route():
    emulated_does_not_route(_vit(), _attentions, lambda m, o: train(m, o, _vit_loss, 1), OURS)


@native
def test_routed_module_compiles_without_graph_break():
    module, _ = _pair()
    x = _input(True).requires_grad_()
    torch._dynamo.reset()
    call = lambda x: module(x, x, x, need_weights=False)[0]  # noqa: E731
    assert torch._dynamo.explain(call)(x).graph_break_count == 0
    out = torch.compile(call, fullgraph=True)(x)
    assert torch.equal(out, call(x))
