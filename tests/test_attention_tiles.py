"""The tiled attention kernel (ipex_train.attention, torch.ops.ipex_train.attention_flash_*) against fp32 torch
attention, forward and the three gradients, at lengths around the tile size and long ones; its bits at 1, 2 and 3
threads; its dropout mask against the row kernel's. Every test runs with both products of the AVX-512 BF16 tiles
(oneDNN's batch-reduce GEMM, where it runs here, and the tiles' own dot-product loops).

Tolerances: the products take bf16 operands with fp32 accumulation, the softmax is fp32, and the probabilities and
dS are rounded to bf16 once each before their products (as in torch's bf16 attention). Against fp32 SDPA on the same
bf16-valued inputs every output and gradient is within 2% of the reference's largest magnitude, plus 1e-3 absolute
for gradients that are exactly 0 in fp32 (a single key); measured up to 0.7%. A wrong scale, mask, skipped tile or
GQA head is off by far more.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ipex_train import attention
from ipex_train.attention import _op
from ipex_train.base import ops as _ops

BF16 = torch.bfloat16
TOL = 2e-2

pytestmark = pytest.mark.skipif(not _ops.cpu_features().get("avx512_bf16", False),
                                reason="the tiled kernel runs at speed only with AVX-512 BF16 (tested below via the "
                                       "portable build too)")


PRODUCTS = ["own"] + (["onednn"] if _op.tile_products() == "onednn" else [])


@pytest.fixture(autouse=True, params=PRODUCTS)
def products(request):
    before = _op.tile_products()
    _op.tile_products(request.param)
    yield request.param
    _op.tile_products(before)


def _qkv(b, hq, hk, s, t, d, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, s, d, generator=g).to(BF16), torch.randn(b, hk, t, d, generator=g).to(BF16),
            torch.randn(b, hk, t, dv or d, generator=g).to(BF16))


def _flash(q, k, v, mask=None, starts=None, p=0.0, causal=False, seed=0):
    return _op.flash_forward(q, k, v, mask, starts, p, causal, 1.0 / math.sqrt(q.shape[-1]),
                             torch.tensor([seed], dtype=torch.int64))


def _grads(fn, q, k, v, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(g.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def _reference(q, k, v, g, **kw):
    rep = q.shape[1] // k.shape[1]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw)

    return _grads(fn, q.float(), k.float(), v.float(), g)


def _close(got, want):
    for a, b in zip(got, want):
        err = (a.float() - b).abs().max().item()
        assert err <= TOL * b.abs().max().item() + 1e-3, (err, b.abs().max().item())


@pytest.mark.parametrize("s", [1, 17, 64, 1024, 1025])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_against_fp32(s, causal):
    q, k, v = _qkv(1, 2, 2, s, s, 64, seed=s)
    g = torch.randn(1, 2, s, 64)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=causal), q, k, v, g)
    _close(got, _reference(q, k, v, g, is_causal=causal))


def test_long_causal_sequence_against_fp32():
    q, k, v = _qkv(1, 1, 1, 4097, 4097, 64, seed=1)
    g = torch.randn(1, 1, 4097, 64)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=True), q, k, v, g)
    _close(got, _reference(q, k, v, g, is_causal=True))


@pytest.mark.parametrize("b, heads", [(1, 16), (4, 8), (1, 40)], ids=["2 chunks", "1 chunk", "1 chunk, 40 heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_fewer_chunks_when_many_heads(b, heads, causal):
    # Batch x key/value heads of 16 and 32 or more take 2 and 1 chunks of key tiles (4 below 9): against fp32, and the
    # same bits at 1 and 3 threads.
    q, k, v = _qkv(b, heads, heads, 260, 260, 64, seed=heads)
    g = torch.randn(b, heads, 260, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(lambda q, k, v: _flash(q, k, v, causal=causal), q, k, v, g)
        torch.set_num_threads(3)
        three = _grads(lambda q, k, v: _flash(q, k, v, causal=causal), q, k, v, g)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, c) for a, c in zip(one, three))
    _close(one, _reference(q, k, v, g, is_causal=causal))


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_head_dims_and_grouped_queries(d):
    q, k, v = _qkv(2, 4, 2, 70, 70, d, seed=d)
    g = torch.randn(2, 4, 70, d)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=True), q, k, v, g)
    _close(got, _reference(q, k, v, g, is_causal=True))
    q, k, v = _qkv(1, 4, 1, 40, 150, d, dv=32, seed=d + 1)  # cross attention, one key/value head, dv != d
    g = torch.randn(1, 4, 40, 32)
    got = _grads(lambda q, k, v: _flash(q, k, v), q, k, v, g)
    _close(got, _reference(q, k, v, g))


def test_causal_with_fewer_queries_than_keys_is_top_left_aligned():
    q, k, v = _qkv(1, 2, 2, 70, 200, 64)
    g = torch.randn(1, 2, 70, 64)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=True), q, k, v, g)
    _close(got, _reference(q, k, v, g, is_causal=True))


def test_boolean_and_additive_masks():
    q, k, v = _qkv(2, 2, 2, 90, 130, 64)
    g = torch.randn(2, 2, 90, 64)
    keep = torch.rand(2, 1, 90, 130) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(keep.shape).masked_fill(~keep, -math.inf) + torch.randn(keep.shape)
    got = _grads(lambda q, k, v: _flash(q, k, v, mask=additive), q, k, v, g)
    _close(got, _reference(q, k, v, g, attn_mask=additive))
    # Through the public function, enough keys for the tiled kernel: a boolean key padding mask.
    t = attention.TILES_FROM_KEYS + 6
    q, k, v = _qkv(2, 2, 2, 40, t, 64, seed=3)
    g = torch.randn(2, 2, 40, 64)
    pad = torch.ones(2, 1, 1, t, dtype=torch.bool)
    pad[1, ..., 450:] = False
    got = _grads(lambda q, k, v: attention.scaled_dot_product_attention(q, k, v, attn_mask=pad), q, k, v, g)
    _close(got, _reference(q, k, v, g, attn_mask=pad))


def test_rows_without_keys_give_zeros():
    q, k, v = _qkv(1, 1, 1, 80, 80, 64)
    keep = torch.ones(1, 1, 80, 80, dtype=torch.bool)
    keep[0, 0, 70] = False
    mask = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = _flash(q, k, v, mask=mask, causal=True)
    assert torch.equal(out[0, 0, 70], torch.zeros(64, dtype=BF16))
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad.float()).all() for x in (q, k, v))


def test_same_bits_at_any_thread_count():
    q, k, v = _qkv(1, 4, 2, 300, 300, 64)
    g = torch.randn(1, 4, 300, 64)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_grads(lambda q, k, v: _flash(q, k, v, causal=True, p=0.1, seed=5), q, k, v, g))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_dropout_draws_the_row_kernels_mask():
    # With value = identity the output is the dropped probabilities: both kernels drop the same elements.
    q, k, _ = _qkv(1, 2, 2, 48, 48, 64)
    eye = torch.eye(48).to(BF16).expand(1, 2, 48, 48)
    seed = torch.tensor([7], dtype=torch.int64)
    tiles = _op.flash_forward(q, k, eye, None, None, 0.3, False, 0.125, seed)
    rows = _op.forward(q, k, eye, None, 0.3, False, 0.125, seed)
    assert torch.equal(tiles == 0, rows == 0)
    kept = (rows != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.03
    torch.testing.assert_close(tiles, rows, rtol=2**-7, atol=2e-3)


def test_dropout_gradients_match_a_reference_with_the_same_mask():
    p = 0.2
    q, k, v = _qkv(1, 2, 2, 80, 80, 64)
    seed = torch.tensor([3], dtype=torch.int64)
    eye = torch.eye(80).to(BF16).expand(1, 2, 80, 80).contiguous()
    # With value = identity the output is the dropped probabilities: nonzero where kept (and not causally masked).
    keep = _op.flash_forward(q, k, eye, None, None, p, True, 0.125, seed) != 0
    causal = torch.ones(80, 80, dtype=torch.bool).tril()
    keep = keep | ~causal  # the masked elements are 0 for another reason

    def ref(q, k, v):
        probs = torch.softmax((q @ k.transpose(-1, -2) / 8).masked_fill(~causal, -math.inf), -1)
        return (probs * keep / (1 - p)) @ v

    g = torch.randn(1, 2, 80, 64)
    got = _grads(lambda q, k, v: _op.flash_forward(q, k, v, None, None, p, True, 0.125, seed), q, k, v, g)
    _close(got, _grads(ref, q.float(), k.float(), v.float(), g))


def test_portable_build_agrees(variant):
    q, k, v = _qkv(1, 2, 1, 70, 70, 32)
    g = torch.randn(1, 2, 70, 32)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=True, p=0.1, seed=2), q, k, v, g)
    _ops.set_kernel_variant("scalar")  # the variant fixture restores the one in effect
    portable = _grads(lambda q, k, v: _flash(q, k, v, causal=True, p=0.1, seed=2), q, k, v, g)
    assert torch.equal(got[0] == 0, portable[0] == 0)
    for a, b in zip(got, portable):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_a_nan_query_or_key_is_never_hidden(variant):
    # Every kernel build (the scalar and AVX2 variants run the portable tiles): a NaN in one query element makes that
    # row's output NaN, one in a key element every row reaching that key, exactly as in fp32 torch attention; each
    # gradient has NaNs where torch's has them and nowhere else (torch spreads them over more masked keys).
    q, k, v = _qkv(1, 2, 2, 130, 130, 32)
    q[0, 0, 70, 3] = float("nan")
    k[0, 1, 100, 5] = float("nan")
    g = torch.randn(1, 2, 130, 32)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=True), q, k, v, g)
    want = _reference(q, k, v, g, is_causal=True)
    assert torch.equal(got[0].isnan(), want[0].isnan()) and got[0].isnan().any()
    for a, b in zip(got[1:], want[1:]):
        assert a.isnan().any() == b.isnan().any() and not (a.isnan() & ~b.isnan()).any()


def test_onednn_products_run_here():
    # Where AVX-512 BF16 is (this module's condition), oneDNN's micro-kernel passes its exactness check: a failed
    # check would leave the default on the tiles' own products and the parametrization above on those only.
    assert PRODUCTS == ["own", "onednn"]


def test_products_agree_and_choice_is_checked(products):
    q, k, v = _qkv(2, 4, 2, 200, 200, 96)
    g = torch.randn(2, 4, 200, 96)
    got = _grads(lambda q, k, v: _flash(q, k, v, causal=True), q, k, v, g)
    other = "own" if products == "onednn" else PRODUCTS[-1]
    _op.tile_products(other)
    assert _op.tile_products() == other
    again = _grads(lambda q, k, v: _flash(q, k, v, causal=True), q, k, v, g)
    for a, b in zip(got, again):  # the same sums in another order: bf16 outputs within a rounding or two
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="'onednn' or 'own'"):
        _op.tile_products("mkl")
    assert _op.tile_products() == other  # a refused choice changes nothing


def test_torch_compile_full_graph():
    s = attention.CAUSAL_TILES_FROM_KEYS + 8  # long enough for the tiled kernel
    q, k, v = _qkv(1, 4, 2, s, s, 64)

    def fn(q, k, v):
        return attention.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(q, k, v).graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = [x.detach().requires_grad_() for x in (q, k, v)]
    eager = [x.detach().requires_grad_() for x in (q, k, v)]
    out = compiled(*args)
    out.float().sum().backward()
    fn(*eager).float().sum().backward()
    assert torch.equal(out, fn(q, k, v))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(args, eager))


def test_op_rejects_bad_inputs():
    q, k, v = _qkv(1, 2, 2, 16, 16, 64)
    seed = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiples of 16"):
        torch.ops.ipex_train.attention_flash_forward(q[..., :40], k[..., :40], v, None, None, 0.0, False, 1.0, seed)
    with pytest.raises(TypeError, match="bfloat16"):
        torch.ops.ipex_train.attention_flash_forward(q.float(), k, v, None, None, 0.0, False, 1.0, seed)
    with pytest.raises(ValueError, match="dropout_p"):
        torch.ops.ipex_train.attention_flash_forward(q, k, v, None, None, 1.0, False, 1.0, seed)
    starts = torch.zeros(1, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="is_causal"):
        torch.ops.ipex_train.attention_flash_forward(q, k, v, None, starts, 0.0, False, 1.0, seed)
    starts[0, 5] = 3  # then decreases
    with pytest.raises(ValueError, match="not decrease"):
        torch.ops.ipex_train.attention_flash_forward(q, k, v, None, starts, 0.0, True, 1.0, seed)


@pytest.mark.skipif(not attention._bf16_dot_in_use(), reason="the router picks the tiled kernel only with the avx512 "
                                                             "kernel variant (IPEX_TRAIN_KERNEL may force another)")
def test_routing_between_the_kernels(monkeypatch):
    calls = []
    for name in ("forward", "flash_forward"):
        original = getattr(_op, name)
        monkeypatch.setattr(_op, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    for s, causal in ((attention.CAUSAL_TILES_FROM_KEYS - 1, True), (attention.CAUSAL_TILES_FROM_KEYS, True),
                      (attention.TILES_FROM_KEYS - 1, False), (attention.TILES_FROM_KEYS, False)):
        q, k, v = _qkv(1, 1, 1, 16, s, 64)
        attention.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert calls == ["forward", "flash_forward", "forward", "flash_forward"]
    # Long key sequences are covered (no cap); head dims the tiles cannot take stay with the row kernel up to its cap.
    q, k, v = _qkv(1, 1, 1, 8, 3000, 64)
    assert attention.supports(q, k, v)
    q40, k40, v40 = _qkv(1, 1, 1, 8, attention.ROWS_MAX_KEYS + 1, 40)
    assert not attention.supports(q40, k40, v40)
    assert attention.supports(q40[..., :attention.ROWS_MAX_KEYS, :], k40[..., :attention.ROWS_MAX_KEYS, :],
                              v40[..., :attention.ROWS_MAX_KEYS, :])


def test_opcheck():
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 70, 70, 64))
    seed = torch.zeros(1, dtype=torch.int64)
    starts = torch.zeros(1, 70, dtype=torch.int32)
    torch.library.opcheck(torch.ops.ipex_train.attention_flash_forward.default,
                          (q, k, v, None, starts, 0.0, True, 0.125, seed))
    out, lse = torch.ops.ipex_train.attention_flash_forward(q, k, v, None, None, 0.1, False, 0.125, seed)
    args = (torch.randn(out.shape).to(BF16), q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, 0.1,
            False, 0.125, seed)
    torch.library.opcheck(torch.ops.ipex_train.attention_flash_backward.default, args)


def test_the_kept_dq_shares_never_leak_into_another_call():
    # A large backward leaves the kept buffer full of its dQ shares; a smaller causal one (whose early query tiles
    # get no share from the later key chunks) reusing it must give the bits of a fresh buffer.
    big = _qkv(2, 4, 2, 700, 700, 64, seed=1)
    _grads(lambda q, k, v: _flash(q, k, v), *big, torch.randn(2, 4, 700, 64))
    assert attention.workspace_bytes() >= 4 * 2 * 4 * 700 * 64 * 4
    small = _qkv(1, 4, 2, 300, 300, 64, seed=2)
    g = torch.randn(1, 4, 300, 64)
    reused = _grads(lambda q, k, v: _flash(q, k, v, causal=True), *small, g)
    assert attention.workspace_bytes(release=True) == 0
    assert attention.workspace_bytes() == 0
    fresh = _grads(lambda q, k, v: _flash(q, k, v, causal=True), *small, g)
    assert all(torch.equal(a, b) for a, b in zip(reused, fresh))
    assert attention.workspace_bytes() > 0
    with pytest.raises(TypeError, match="release"):
        attention.workspace_bytes(release=1)


def test_concurrent_backwards_give_the_sequential_bits():
    # One backward holds the kept buffer; one running at the same time in another thread allocates its own.
    import threading

    cases = [(_qkv(1, 4, 2, 400 + 100 * i, 400 + 100 * i, 64, seed=i), torch.randn(1, 4, 400 + 100 * i, 64))
             for i in range(4)]
    want = [_grads(lambda q, k, v: _flash(q, k, v, causal=True), *qkv, g) for qkv, g in cases]
    got = [None] * len(cases)

    def run(i):
        qkv, g = cases[i]
        for _ in range(3):
            got[i] = _grads(lambda q, k, v: _flash(q, k, v, causal=True), *qkv, g)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
