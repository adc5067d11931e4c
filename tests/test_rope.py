"""ipex_train.rope (the rotary embedding in one pass each way) against Hugging Face's apply_rotary_pos_emb and a
float64 reference.

Tolerances: fp32 inputs give torch's very bits forward and backward (each element is one product minus or plus
another, each rounded to fp32, as torch's ops round them). bf16 inputs: computed in fp32 and rounded once, so within
half a bf16 ulp of the float64 result (relative 2**-8 of the element; atol 1e-6 for elements near 0); torch's bf16
ops round three times and are held to 2**-6 of the reference's largest magnitude.
"""
import pytest
import torch

import ipex_train.rope as rope
from ipex_train.base import ops as _ops

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

BF16 = torch.bfloat16


def _tables(b, s, d, dtype, seed=1):
    # Other angles in the two halves (LlamaRotaryEmbedding repeats them; the formula, and so the kernel, takes any),
    # so that a half read in the other's place shows.
    emb = torch.randn(b, s, d, generator=torch.Generator().manual_seed(seed)) * 3
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(b, s, hq, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, hq, d, generator=g).to(dtype), torch.randn(b, s, hk, d, generator=g).to(dtype))


def _hf(q, k, cos, sin):
    return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _grads(fn, q, k, cos, sin, gq, gk, dtype=None):
    q = q.detach().to(dtype or q.dtype).requires_grad_()
    k = k.detach().to(dtype or k.dtype).requires_grad_()
    c, s = (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))
    oq, ok = fn(q, k, c, s)
    torch.autograd.backward([oq, ok], [gq.to(oq.dtype), gk.to(ok.dtype)])
    return oq.detach(), ok.detach(), q.grad, k.grad


SHAPES = [(2, 17, 4, 2, 64), (1, 1, 3, 1, 128), (3, 5, 6, 6, 80), (1, 9, 2, 1, 6), (2, 33, 8, 2, 96)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_batch", [True, False])
def test_fp32_bit_identical_to_hugging_face(shape, per_batch):
    b, s, hq, hk, d = shape
    q, k = _qk(b, s, hq, hk, d, torch.float32)
    cos, sin = _tables(b if per_batch else 1, s, d, torch.float32)
    gq, gk = torch.randn(b, hq, s, d), torch.randn(b, hk, s, d)
    got = _grads(rope.apply_rotary, q, k, cos, sin, gq, gk)
    ref = _grads(_hf, q, k, cos, sin, gq, gk)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.equal(g, r)
    assert got[0].is_contiguous() and got[1].is_contiguous()  # the attention's layout, no copy left to make
    assert got[2].is_contiguous() and got[3].is_contiguous()  # the projections' layout


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_against_float64(shape):
    b, s, hq, hk, d = shape
    q, k = _qk(b, s, hq, hk, d, BF16)
    cos, sin = _tables(b, s, d, BF16)
    gq, gk = torch.randn(b, hq, s, d).to(BF16), torch.randn(b, hk, s, d).to(BF16)
    got = _grads(rope.apply_rotary, q, k, cos, sin, gq, gk)
    ref = _grads(_hf, q, k, cos, sin, gq, gk, dtype=torch.float64)
    torch_bf16 = _grads(_hf, q, k, cos, sin, gq, gk)
    for g, r, t in zip(got, ref, torch_bf16):
        assert g.dtype == BF16
        # Rounded once: within half an ulp of the exact value.
        assert ((g.double() - r).abs() <= r.abs() * 2**-8 + 1e-6).all()
        assert (t.double() - r).abs().max() <= 2**-6 * r.abs().max()


def test_strided_inputs_and_grads():
    # A query that is a slice of a wider projection (strided heads and positions) and gradients in any layout.
    b, s, d = 2, 11, 64
    wide = torch.randn(b, s, 6, d)
    q, k = wide[:, :, :4], wide[:, :, 4:]
    cos, sin = _tables(1, s, d, torch.float32)
    gq = torch.randn(b, s, 4, d).transpose(1, 2)  # (b, h, s, d) view of another layout
    gk = torch.randn(b, 2, s, d)
    got = _grads(rope.apply_rotary, q, k, cos, sin, gq, gk)
    ref = _grads(_hf, q, k, cos, sin, gq, gk)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_kernel_variants_agree(variant, dtype):
    # The same rounded operations in the same order on every ISA: bit-identical.
    q, k = _qk(2, 13, 4, 2, 96, dtype)
    cos, sin = _tables(2, 13, 96, dtype)
    gq, gk = torch.randn(2, 4, 13, 96).to(dtype), torch.randn(2, 2, 13, 96).to(dtype)
    got = _grads(rope.apply_rotary, q, k, cos, sin, gq, gk)
    _ops.set_kernel_variant("scalar")
    try:
        ref = _grads(rope.apply_rotary, q, k, cos, sin, gq, gk)
    finally:
        _ops.set_kernel_variant(variant)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_same_bits_at_any_thread_count():
    q, k = _qk(2, 300, 4, 2, 64, BF16)
    cos, sin = _tables(2, 300, 64, BF16)
    gq, gk = torch.randn(2, 4, 300, 64).to(BF16), torch.randn(2, 2, 300, 64).to(BF16)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_grads(rope.apply_rotary, q, k, cos, sin, gq, gk))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_unsupported_calls_fall_back_to_the_formula():
    q, k = _qk(1, 5, 2, 2, 8, BF16)
    cos, sin = _tables(1, 5, 8, torch.float32)  # other dtype than the query: torch's promotion, torch's ops
    assert not rope.supports(q, k, cos, sin)
    for g, r in zip(rope.apply_rotary(q, k, cos, sin), _hf(q, k, cos, sin)):
        assert g.dtype == torch.float32 and torch.equal(g, r)
    cos, sin = _tables(1, 5, 8, BF16)
    cos.requires_grad_()  # a gradient for the table: only torch's ops give one
    assert not rope.supports(q, k, cos, sin)
    oq, _ = rope.apply_rotary(q, k, cos, sin)
    oq.float().sum().backward()
    assert cos.grad is not None
    assert not rope.supports(q[..., :7], k[..., :7], cos[..., :7].detach(), sin[..., :7])  # odd head dim
    assert rope.supports(q, k, cos.detach(), sin)


def test_bad_arguments_name_themselves():
    q, k = _qk(1, 4, 2, 1, 8, BF16)
    cos, sin = _tables(1, 4, 8, BF16)
    with pytest.raises(TypeError, match="cos must be a tensor"):
        rope.apply_rotary(q, k, [1.0], sin)
    with pytest.raises(ValueError, match="4-D"):
        rope.apply_rotary(q[0], k, cos, sin)
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.ipex_train.rope_forward(q, k, cos.float(), sin.float())
    with pytest.raises(ValueError, match="head_dim"):
        torch.ops.ipex_train.rope_forward(q, k, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="share B, S and D"):
        torch.ops.ipex_train.rope_forward(q, k[:, :3], cos, sin)


def test_opcheck():
    q, k = _qk(2, 7, 4, 2, 16, BF16)
    cos, sin = _tables(2, 7, 16, BF16)
    torch.library.opcheck(torch.ops.ipex_train.rope_forward.default,
                          (q.requires_grad_(), k.requires_grad_(), cos, sin))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_torch_compile_full_graph(dtype):
    q, k = _qk(2, 7, 4, 2, 16, dtype)
    cos, sin = _tables(2, 7, 16, dtype)

    def fn(q, k, c, s):
        a, b = rope.apply_rotary(q, k, c, s)
        return a.float().sum() + b.float().sum()

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(q, k, cos, sin).graph_break_count == 0
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    out = torch.compile(fn, fullgraph=True)(qs, ks, cos, sin)
    out.backward()
    ref = _grads(rope.apply_rotary, q, k, cos, sin, torch.ones(2, 4, 7, 16), torch.ones(2, 2, 7, 16))
    assert torch.equal(qs.grad, ref[2]) and torch.equal(ks.grad, ref[3])
