"""ipex_train.attention.packed_attention: ragged documents packed into rows against each document run alone
(fp32 causal attention per document), forward and the three gradients; the two ways of giving the documents; bad
arguments.

Tolerance as in test_attention_tiles.py: within 2% of the reference's largest magnitude (+1e-3 absolute for the
exactly-zero gradients of one-token documents); attending across a document boundary is off by far more.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ipex_train import attention
from ipex_train.base import ops as _ops

BF16 = torch.bfloat16
TOL = 2e-2
# Two rows of 256 tokens: documents of lengths crossing the 64-token tiles, one-token documents, one whole-tile one.
ROWS = ([5, 70, 1, 150, 30], [64, 64, 1, 127])


def _docs_alone(q, k, v, g, lengths_per_row, window=None):
    """fp32 causal attention of each document alone: output and grads laid out as the packed inputs."""
    r = [x.detach().float().requires_grad_() for x in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    outs = []
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            if window is not None:
                mask &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
            outs.append((b, sl, F.scaled_dot_product_attention(
                r[0][b:b + 1, :, sl], r[1][b:b + 1, :, sl].repeat_interleave(rep, 1),
                r[2][b:b + 1, :, sl].repeat_interleave(rep, 1), attn_mask=mask)))
            start += n
    out = torch.zeros(q.shape[:3] + (v.shape[-1],))
    for b, sl, o in outs:
        out[b:b + 1, :, sl] = o
    out.backward(g)
    return out.detach(), r[0].grad, r[1].grad, r[2].grad


def _packed(q, k, v, g, **kw):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attention.packed_attention(q, k, v, **kw)
    out.backward(g.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def _inputs(hq=4, hk=2, d=64, dtype=BF16):
    gen = torch.Generator().manual_seed(0)
    s = sum(ROWS[0])
    q, k, v = (torch.randn(2, h, s, d, generator=gen).to(dtype) for h in (hq, hk, hk))
    return q, k, v, torch.randn(2, hq, s, d, generator=gen)


def _positions():
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ROWS])


def _close(got, want):
    for a, b in zip(got, want):
        err = (a.float() - b).abs().max().item()
        assert err <= TOL * b.abs().max().item() + 1e-3, (err, b.abs().max().item())


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_ragged_documents_equal_each_alone(dtype):
    q, k, v, g = _inputs(dtype=dtype)
    got = _packed(q, k, v, g, position_ids=_positions(), enable_gqa=True)
    _close(got, _docs_alone(q, k, v, g, ROWS))


def test_cumulative_lengths_give_the_same_bits_as_position_ids():
    q, k, v, g = _inputs()
    cu = torch.tensor([0] + ROWS[0] + ROWS[1]).cumsum(0)
    by_lengths = _packed(q, k, v, g, cu_seqlens=cu, enable_gqa=True)
    by_positions = _packed(q, k, v, g, position_ids=_positions(), enable_gqa=True)
    assert all(torch.equal(a, b) for a, b in zip(by_lengths, by_positions))


def test_sliding_window_within_documents():
    q, k, v, g = _inputs(hq=2, hk=2)
    got = _packed(q, k, v, g, position_ids=_positions(), window=40)
    _close(got, _docs_alone(q, k, v, g, ROWS, window=40))


@pytest.mark.skipif(not attention._bf16_dot_in_use(),
                    reason="the tiled kernel runs on AVX-512 BF16 with the avx512 kernel variant only")
def test_portable_build_agrees(variant):
    q, k, v, g = _inputs(hq=2, hk=1, d=32)
    fast = _packed(q, k, v, g, position_ids=_positions(), enable_gqa=True)
    _ops.set_kernel_variant("scalar")  # the variant fixture restores the one in effect
    from ipex_train.attention import _op

    starts = attention.document_starts(2, q.shape[2], position_ids=_positions())
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = _op.flash_forward(qq, kk, vv, None, starts, 0.0, True, 1 / math.sqrt(32), torch.zeros(1, dtype=torch.int64))
    out.backward(g.to(BF16))
    for a, b in zip(fast, (out, qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_document_starts():
    starts = attention.document_starts(1, 8, position_ids=torch.tensor([0, 1, 2, 0, 1, 0, 1, 2]))
    assert starts.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5]] and starts.dtype == torch.int32
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    assert torch.equal(attention.document_starts(1, 8, cu_seqlens=cu), starts)
    assert attention.document_starts(1, 8, cu_seqlens=cu, window=2).tolist() == [[0, 0, 1, 3, 3, 5, 5, 6]]


def test_bad_arguments():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="exactly one"):
        attention.packed_attention(q, k, v)
    with pytest.raises(ValueError, match="exactly one"):
        attention.packed_attention(q, k, v, position_ids=_positions(), cu_seqlens=torch.tensor([0, 512]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention.packed_attention(q, k, v, cu_seqlens=torch.tensor([0, 100]))
    with pytest.raises(ValueError, match="crosses"):
        attention.packed_attention(q, k, v, cu_seqlens=torch.tensor([0, 200, 512]))
    with pytest.raises(TypeError, match="integer"):
        attention.packed_attention(q, k, v, position_ids=_positions().float())
    with pytest.raises(ValueError, match="position_ids must have shape"):
        attention.packed_attention(q, k, v, position_ids=_positions()[:, :10])
    with pytest.raises(ValueError, match="window"):
        attention.packed_attention(q, k, v, position_ids=_positions(), window=0)
    with pytest.raises(ValueError, match="as many keys as queries"):
        attention.packed_attention(q, k[:, :, :100], v[:, :, :100], position_ids=_positions())
