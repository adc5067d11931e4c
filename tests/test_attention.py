"""ipex_train.attention against fp32 torch attention, forward and gradients.

Tolerances: the op computes the scores and the products in bf16 (bf16 matmuls, fp32 accumulation) and the softmax
in fp32, as torch's bf16 math attention does; the scores, probabilities and dS are rounded to bf16 once each. Against
fp32 SDPA on the same bf16-valued inputs, every output and gradient is within 3% of the reference's largest
magnitude (measured: up to 1.5%); a softmax computed wrongly (no scale, no mask, wrong GQA head) is off by far more.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ipex_train import attention

BF16 = torch.bfloat16
TOL = 3e-2


def _qkv(b=2, hq=4, hk=4, s=33, t=33, d=40, layout_bshd=False):
    def make(h, n):
        if layout_bshd:  # as Hugging Face models pass them: (batch, seq, heads, dim) transposed
            return torch.randn(b, n, h, d).to(BF16).transpose(1, 2)
        return torch.randn(b, h, n, d).to(BF16)

    return make(hq, s), make(hk, t), make(hk, t)


def _check(kw, q, k, v, **ref_kw):
    """Our forward and grads (bf16) against fp32 SDPA on the same values."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attention.scaled_dot_product_attention(q, k, v, **kw)
    assert out.dtype == BF16 and out.shape == q.shape[:3] + (v.shape[-1],)
    g = torch.randn(out.shape)
    out.backward(g.to(BF16))
    r = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_args = {**kw, **ref_kw}
    if isinstance(ref_args.get("attn_mask"), torch.Tensor):
        ref_args["attn_mask"] = ref_args["attn_mask"] if ref_args["attn_mask"].dtype == torch.bool \
            else ref_args["attn_mask"].float()
    ref = F.scaled_dot_product_attention(*r, **ref_args)
    ref.backward(g)
    for got, want in ((out, ref), (q.grad, r[0].grad), (k.grad, r[1].grad), (v.grad, r[2].grad)):
        err = (got.float() - want.detach()).abs().max().item()
        assert err <= TOL * want.abs().max().item(), (err, want.abs().max().item())


def test_plain_and_scale():
    torch.manual_seed(0)
    _check({}, *_qkv())
    _check({"scale": 0.3}, *_qkv(d=64, s=128, t=128))


def test_hugging_face_layout_and_cross_attention():
    torch.manual_seed(1)
    _check({}, *_qkv(s=17, t=70, layout_bshd=True))


def test_causal():
    torch.manual_seed(2)
    _check({"is_causal": True}, *_qkv(s=50, t=50))
    _check({"is_causal": True}, *_qkv(s=20, t=37))  # top-left aligned, as torch


def test_boolean_padding_mask():
    torch.manual_seed(3)
    q, k, v = _qkv(t=40)
    keep = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    keep[0, ..., 30:] = False  # padding of the first sequence
    _check({"attn_mask": keep}, q, k, v)
    keep = torch.rand(2, 4, 33, 40) > 0.3  # per head, per query
    keep[..., 0] = True
    _check({"attn_mask": keep}, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_additive_mask(dtype):
    torch.manual_seed(4)
    q, k, v = _qkv(t=40)
    mask = torch.randn(2, 1, 33, 40)
    mask[1, ..., 35:] = torch.finfo(torch.float32).min  # Hugging Face's additive padding
    _check({"attn_mask": mask.to(dtype)}, q, k, v)


def test_grouped_query_attention():
    torch.manual_seed(5)
    q, k, v = _qkv(hq=8, hk=2, s=24, t=24)
    _check({"enable_gqa": True, "is_causal": True}, q, k, v)
    keep = torch.rand(2, 8, 24, 24) > 0.2
    keep[..., 0] = True
    _check({"enable_gqa": True, "attn_mask": keep}, q, k, v)


def test_fully_masked_rows_give_zeros():
    q, k, v = (x.requires_grad_() for x in _qkv())
    keep = torch.ones(2, 1, 33, 33, dtype=torch.bool)
    keep[0, 0, 5] = False
    out = attention.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.equal(out[0, :, 5], torch.zeros_like(out[0, :, 5]))
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad.float()).all() for x in (q, k, v))


def _dropout_reference(q, k, p, seed):
    """Our dropout mask, read off the op itself: with value = identity the output is the dropped probabilities."""
    t = k.shape[2]
    eye = torch.eye(t).to(BF16).expand(q.shape[0], k.shape[1], t, t)
    torch.manual_seed(seed)
    dropped = attention.scaled_dot_product_attention(q, k, eye, dropout_p=p)
    return dropped != 0


def test_dropout_gradients_match_a_reference_with_the_same_mask():
    torch.manual_seed(6)
    p = 0.3
    q, k, _ = _qkv(s=48, t=48, d=48)
    keep = _dropout_reference(q, k, p, seed=11)
    kept = keep.float().mean().item()
    assert abs(kept - (1 - p)) < 0.02  # 2 x 4 x 48 x 48 draws
    v = torch.randn(2, 4, 48, 48).to(BF16)
    torch.manual_seed(11)  # the same seed draws the same mask (it depends on the seed and positions only)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = attention.scaled_dot_product_attention(qq, kk, vv, dropout_p=p)
    g = torch.randn(out.shape)
    out.backward(g.to(BF16))
    r = [x.detach().float().requires_grad_() for x in (q, k, v)]
    probs = torch.softmax(r[0] @ r[1].transpose(-1, -2) / 48**0.5, dim=-1)
    ref = (probs * keep / (1 - p)) @ r[2]
    ref.backward(g)
    for got, want in ((out, ref), (qq.grad, r[0].grad), (kk.grad, r[1].grad), (vv.grad, r[2].grad)):
        err = (got.float() - want.detach()).abs().max().item()
        assert err <= TOL * want.abs().max().item()


def test_dropout_is_reproducible_under_manual_seed():
    q, k, v = _qkv()
    torch.manual_seed(0)
    a = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    b = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    torch.manual_seed(0)
    c = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_kernel_variants_agree(variant):
    # Every ISA variant computes the same formulas (summation order aside) and draws the same dropout masks.
    torch.manual_seed(7)
    q, k, v = _qkv(s=40, t=45, d=24)
    torch.manual_seed(1)
    out = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    from ipex_train.base import ops as _ops

    _ops.set_kernel_variant("scalar")
    try:
        torch.manual_seed(1)
        ref = attention.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    finally:
        _ops.set_kernel_variant(variant)
    assert torch.equal(out == 0, ref == 0)
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-3)


def test_torch_compile_full_graph():
    torch.manual_seed(8)
    q, k, v = _qkv(hq=4, hk=2)
    keep = torch.rand(2, 1, 33, 33) > 0.2
    keep[..., 0] = True

    def fn(q, k, v):
        return attention.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(fn)(q, k, v)
    assert explain.graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True)
    args = [x.detach().requires_grad_() for x in (q, k, v)]
    eager = [x.detach().requires_grad_() for x in (q, k, v)]
    out = compiled(*args)
    out.float().sum().backward()
    fn(*eager).float().sum().backward()
    assert torch.equal(out, fn(q, k, v))
    for a, b in zip(args, eager):
        assert torch.equal(a.grad, b.grad)


class _Calls(TorchDispatchMode):
    """Records (op, args) of every aten/ipex_train call made while it is active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def test_backward_neither_copies_saved_inputs_nor_fills_zero_grads():
    # Hugging Face's transposed views are made contiguous once, before the op, so the op saves contiguous tensors
    # and its backward copies none of them again; the grads of the probabilities (outputs nobody differentiates)
    # are not materialised as S x T zeros.
    q, k, v = (x.detach().requires_grad_() for x in _qkv(s=16, t=16, layout_bshd=True))
    out = attention.scaled_dot_product_attention(q, k, v)
    with _Calls() as record:
        out.backward(torch.ones_like(out))
    backward = [args for func, args in record.calls if func is torch.ops.ipex_train.attention_backward.default]
    assert len(backward) == 1
    assert all(t.is_contiguous() for t in backward[0][1:4])  # the saved query, key, value
    names = {func.__name__ for func, _ in record.calls}
    assert not names & {"fill_.Scalar", "zeros_like.default", "zeros.default", "new_zeros.default"}, names


def test_what_it_does_not_cover_goes_to_torch():
    q, k, v = _qkv()
    assert attention.supports(q, k, v)
    assert not attention.supports(q.float(), k.float(), v.float())
    mask = torch.zeros(2, 1, 33, 33, requires_grad=True)
    assert not attention.supports(q, k, v, attn_mask=mask)  # a learned bias needs its gradient
    assert not attention.supports(q, k, v, attn_mask=torch.zeros(33, 33, dtype=torch.bool), is_causal=True)
    assert not attention.supports(q, k[:, :3], v[:, :3], enable_gqa=True)  # 4 heads over 3
    # Past the row kernel's key cap, only head dims the tiled kernel takes (multiples of 16) are covered.
    long_k = torch.zeros(2, 4, attention.ROWS_MAX_KEYS + 1, 40, dtype=BF16)
    assert not attention.supports(q, long_k, long_k)
    # Not covered: computed by torch, with torch's result.
    out = attention.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q.float(), k.float(), v.float()))
    with pytest.raises(RuntimeError):
        attention.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(33, 33, dtype=torch.bool),
                                               is_causal=True)


def test_op_rejects_bad_inputs():
    q, k, v = _qkv()
    seed = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(TypeError, match="bfloat16"):
        torch.ops.ipex_train.attention_forward(q.float(), k, v, None, 0.0, False, 1.0, seed)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        torch.ops.ipex_train.attention_forward(q, k[:, :3], v[:, :3], None, 0.0, False, 1.0, seed)
    with pytest.raises(ValueError, match="dropout_p"):
        torch.ops.ipex_train.attention_forward(q, k, v, None, 1.0, False, 1.0, seed)
    with pytest.raises(ValueError, match="seed"):
        torch.ops.ipex_train.attention_forward(q, k, v, None, 0.0, False, 1.0, torch.zeros(2))


@pytest.mark.parametrize("s", [40, 1100], ids=["rows", "tiles"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_nan_input_is_never_hidden(bad, where, causal, s):
    # Never a silently finite result: a NaN (or an inf, whose scores give inf - inf) in one element of a query, key or
    # value makes the output NaN exactly where fp32 torch attention's is. Each gradient has NaNs where torch's has
    # them; a NaN's, nowhere else (torch's blocks may spread it over more masked keys than the tiles do; after an
    # inf the row kernel's saved probabilities spread it over more keys than torch's flash backward does).
    g0 = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, s, 32, generator=g0).to(BF16) for _ in range(3)]
    if not attention.supports(*qkv, is_causal=causal):
        pytest.skip("torch's attention computes this call here (the tiled kernel runs with AVX-512 BF16 only)")
    qkv[("query", "key", "value").index(where)][0, 0, s // 2, 3] = float(bad)
    g = torch.randn(1, 2, s, 32, generator=g0)

    def nans(fn, dtype):
        q, k, v = (x.to(dtype).detach().requires_grad_() for x in qkv)
        out = fn(q, k, v, is_causal=causal)
        out.backward(g.to(dtype))
        return [t.isnan() for t in (out.detach(), q.grad, k.grad, v.grad)]

    ours, theirs = nans(attention.scaled_dot_product_attention, BF16), nans(F.scaled_dot_product_attention,
                                                                            torch.float32)
    assert torch.equal(ours[0], theirs[0]) and (ours[0].any() or (bad == "inf" and where == "value"))
    for got, want in zip(ours[1:], theirs[1:]):
        assert got.any() == want.any() and (bad == "inf" or not (got & ~want).any())
