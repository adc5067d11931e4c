"""ipex_train.rms_norm.add_rms_norm (residual add + LlamaRMSNorm, one fused op) against torch and float64 references.

Forward: the sum has the bits of torch's ``residual + x`` and y those of ``rms_norm`` (LlamaRMSNorm's) on that sum,
checked with torch.equal. Gradients against float64 autograd of ``s = x + residual`` (the kernel's rounded sum, as
float64), ``y = w * s * rsqrt(mean(s^2) + eps)`` without intermediate rounding, with an upstream gradient for y and
one for the sum. Errors relative to the reference's largest magnitude (``_err``): bf16 outputs, and y and the
weight's gradient of a bf16 sum, within 2**-6 (bf16's unit roundoff is 2**-8: the forward's rounding of s * rstd to
the sum's dtype, then one rounding of each output); the others within 1e-5 (fp32 ulps of the row sums). Routing by
the native compute policy: tests/test_add_rms_norm_route.py.
"""
import pytest
import torch
from op_names import OpNames

from ipex_train.base import ops as _ops
from ipex_train.rms_norm import _op, add_rms_norm, rms_norm, supports_add

BF16, F32 = torch.bfloat16, torch.float32
OURS = "ipex_train.add_rms_norm_forward"
OURS_BACKWARD = "ipex_train.add_rms_norm_backward"
# (x dtype, residual dtype): the combinations the kernel takes.
PAIRS = [(BF16, BF16), (BF16, F32), (F32, F32)]
SHAPES = [(2, 64, 768), (1, 37), (3, 17), (130, 100), (2, 3, 1), (1, 1, 200)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(shape, x_dtype, r_dtype, w_dtype, seed=0):
    n = shape[-1]
    x = (torch.randn(shape, generator=_gen(seed)) * 2.0).to(x_dtype).requires_grad_()
    r = (torch.randn(shape, generator=_gen(seed + 1)) + 0.5).to(r_dtype).requires_grad_()
    w = (torch.randn(n, generator=_gen(seed + 2)) * 0.3 + 1.0).to(w_dtype).requires_grad_()
    return x, r, w


def _err(ours, ref):
    return (ours.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)


def _tol(t, s=None):
    """bf16 outputs, and y and grad_weight of a bf16 sum (whose normalized values the forward rounds to bf16)."""
    return 2**-6 if BF16 in (t.dtype, getattr(s, "dtype", None)) else 1e-5


def _reference(s, w, eps, gy, gs):
    """float64 gradients of the sum and the weight for upstream gradients gy (of y) and gs (of the sum)."""
    s64 = s.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = w64 * (s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps))
    (y * gy.double()).sum().backward()
    return y.detach(), s64.grad + gs.double(), w64.grad


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("w_dtype", [BF16, F32], ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_forward_bits_and_grads_against_float64(shape, w_dtype, pair):
    x, r, w = _inputs(shape, *pair, w_dtype)
    with OpNames() as ops:
        y, s = add_rms_norm(x, r, w, 1e-6)
    assert OURS in ops.names
    with torch.no_grad():
        ref_s = r + x
        assert s.dtype == ref_s.dtype and torch.equal(s, ref_s)
        assert torch.equal(y, rms_norm(ref_s, w, 1e-6))
    gy = torch.randn(shape, generator=_gen(7)).to(y.dtype)
    gs = torch.randn(shape, generator=_gen(8)).to(s.dtype)
    with OpNames() as ops:
        torch.autograd.backward((y, s), (gy, gs))
    assert OURS_BACKWARD in ops.names
    ref_y, ref_gs, ref_gw = _reference(s, w, 1e-6, gy, gs)
    assert _err(y, ref_y) <= _tol(y, s)
    assert x.grad.dtype == x.dtype and r.grad.dtype == r.dtype and w.grad.dtype == w.dtype
    assert _err(x.grad, ref_gs) <= _tol(x.grad) and _err(r.grad, ref_gs) <= _tol(r.grad)
    assert _err(w.grad, ref_gw) <= _tol(w.grad, s)


def test_one_gradient_tensor_for_x_and_residual_of_one_dtype():
    grads = []
    x, r, w = _inputs((4, 32), BF16, BF16, F32)
    x.register_hook(grads.append)
    r.register_hook(grads.append)
    y, s = add_rms_norm(x, r, w)
    (y.float().sum() + s.float().sum()).backward()
    assert len(grads) == 2 and grads[0] is grads[1]


@pytest.mark.parametrize("used", ["y", "sum"])
def test_one_output_used(used):
    x, r, w = _inputs((5, 48), BF16, F32, F32)
    y, s = add_rms_norm(x, r, w, 1e-5)
    g = torch.randn(5, 48, generator=_gen(3))
    with OpNames() as ops:
        ((y if used == "y" else s) * g).sum().backward()
    assert OURS_BACKWARD not in ops.names
    ref_y, ref_gs, ref_gw = _reference(s, w, 1e-5, g if used == "y" else torch.zeros(5, 48),
                                       g if used == "sum" else torch.zeros(5, 48))
    assert _err(r.grad, ref_gs) <= 1e-5 and _err(x.grad, ref_gs) <= 2**-7
    assert (w.grad is None) == (used == "sum")
    if w.grad is not None:
        assert _err(w.grad, ref_gw) <= 1e-5


def _run(threads, x, r, w, gy, gs):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs, rs, ws = (t.detach().clone().requires_grad_() for t in (x, r, w))
        y, s = add_rms_norm(xs, rs, ws)
        torch.autograd.backward((y, s), (gy, gs))
        return y, s, xs.grad, rs.grad, ws.grad
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_same_bits_at_1_2_3_threads(pair):
    x, r, w = _inputs((300, 96), *pair, F32)  # five blocks of the weight gradient's 64 rows
    gy = torch.randn(300, 96, generator=_gen(4))
    gs = torch.randn(300, 96, generator=_gen(5)).to(r.dtype)
    one = _run(1, x, r, w, gy, gs)
    for threads in (2, 3):
        assert all(torch.equal(a, c) for a, c in zip(one, _run(threads, x, r, w, gy, gs))), threads


@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_kernel_variants_agree(variant, pair):
    # The forward's bits are torch's whatever the variant; the backward's row sums add in each ISA's vector width.
    x, r, w = _inputs((40, 203), *pair, F32)
    gy = torch.randn(40, 203, generator=_gen(5))
    gs = torch.randn(40, 203, generator=_gen(6)).to(r.dtype)
    out = _run(2, x, r, w, gy, gs)
    _ops.set_kernel_variant("scalar")
    try:
        ref = _run(2, x, r, w, gy, gs)
    finally:
        _ops.set_kernel_variant(variant)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    for a, c in zip(out[2:], ref[2:]):
        rtol, atol = (2**-7, 2e-2) if a.dtype == BF16 else (1e-5, 1e-5)
        torch.testing.assert_close(a, c, rtol=rtol, atol=atol)


def test_unsupported_tensors_fall_back_to_torch():
    x = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    r = torch.randn(3, 40, dtype=torch.float16)
    w = torch.ones(40)
    assert not supports_add(x, r, w) and not supports_add(r.float(), x.to(BF16), w)  # fp16; fp32 x, bf16 residual
    with OpNames() as ops:
        y, s = add_rms_norm(x, r, w)
        (y.float().sum() + s.float().sum()).backward()
    assert OURS not in ops.names
    assert torch.equal(s, r + x) and torch.equal(y, rms_norm(r + x, w))


def test_bad_arguments_name_themselves():
    x = torch.ones(2, 8, dtype=BF16)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        add_rms_norm(x, x, torch.ones(7))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, torch.ones(1, 8, dtype=BF16), w)
    with pytest.raises(ValueError, match="eps"):
        add_rms_norm(x, x, w, -1.0)
    with pytest.raises(TypeError, match="eps must be a float"):
        add_rms_norm(x, x, w, "1e-6")
    with pytest.raises(TypeError, match="residual must be a tensor"):
        add_rms_norm(x, [1.0] * 8, w)
    with pytest.raises(TypeError, match="x and weight"):
        add_rms_norm([1.0] * 8, x, w)
    # The op itself checks what the Python layer leaves to it.
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        _op.add_forward(x.float(), x, w, 1e-6)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        _op.add_forward(x, x[:1], w, 1e-6)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        _op.add_forward(x, x, w, -1.0)


def _samples():
    out = []
    for x_dtype, r_dtype in PAIRS:
        for w_dtype in (BF16, F32):
            out.append((*_inputs((6, 48), x_dtype, r_dtype, w_dtype), 1e-5))
    out.append((*_inputs((2, 3, 40), BF16, BF16, BF16), 1e-6))
    return out


@pytest.mark.parametrize("args", _samples(), ids=lambda a: f"{a[0].dtype}-{a[1].dtype}-{a[2].dtype}"
                         if isinstance(a, tuple) else None)
def test_opcheck(args):
    torch.library.opcheck(torch.ops.ipex_train.add_rms_norm_forward.default, args)


def test_torch_compile_full_graph():
    x, r, w = _inputs((6, 48), BF16, F32, F32)

    def fn(x, r, w):
        y, s = add_rms_norm(x, r, w, 1e-5)
        return y * 2 + s

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(x, r, w).graph_break_count == 0
    out = torch.compile(fn, fullgraph=True)(x, r, w)
    assert torch.equal(out, fn(x, r, w))
    out.sum().backward()
    assert x.grad.dtype == BF16 and r.grad.dtype == F32 and w.grad is not None
