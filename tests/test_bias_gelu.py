"""ipex_train.bias_gelu (gelu(x + bias), exact erf GELU, one fused op) against float64 torch references.

Reference: the pre-activation ``(x.float() + bias.float()).to(x.dtype)`` (what the kernel rounds, as torch computes
it), then exact GELU in float64 autograd (as ``x * erfc(-x / sqrt 2) / 2``: float64 ``F.gelu`` returns 0 below
x = -8.3, where 1 + erf cancels), no further rounding; the bias gradient is the float64 sum over the rows.
The kernel computes in fp32 and rounds each output once:

- y, elementwise: within ``RTOL[dtype]`` of the reference's magnitude, plus ``ATOL`` (the CDF's exp flushes below
  e^-88, so gelu(x) for x < -13 is off by up to ~1e-38): bf16 2**-8 + 1e-5 (one rounding), fp32 2e-6 + 2e-7 x^2
  (x the pre-activation: the CDF is t P(t) exp(-x^2 / 2) / 2 or 1 minus that, and the exp's argument is rounded to
  fp32; measured 4.4e-7 for |x| < 1, 1.5e-6 on [-4, -1], 1.7e-5 on [-12, -8]).
- the normal CDF Phi(x) = (1 + erf(x / sqrt 2)) / 2 read off fp32 y / x, against float64 torch.special.erf / erfc:
  relative error within 8e-7 for x > -1 (measured 4.4e-7), 3e-6 down to -4 (1.5e-6), 3e-5 down to -12 (1.7e-5);
  torch's own fp32 gelu: 4.6e-3 on [-4, -1] and no relative accuracy below -4, where its 1 + erf cancels. erf
  itself within 6e-7 absolute for |x| <= 5 (measured 4.4e-7; torch's fp32 gelu 6.2e-7).
- dx and the bias gradient relative to the reference's largest magnitude (gelu' crosses zero near x = -0.75, where
  an elementwise bound means nothing): the same RTOL (measured bf16 3.1e-3, fp32 2.5e-7).

Routing by the native compute policy: tests/test_bias_gelu_route.py.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from op_names import OpNames

from ipex_train.base import ops as _ops
from ipex_train.bias_gelu import _op, bias_gelu, gelu_with_bias_grad, supports

BF16, F32 = torch.bfloat16, torch.float32
OURS = "ipex_train.bias_gelu_forward"
OURS_BACKWARD = "ipex_train.bias_gelu_backward"
RTOL = {BF16: 2**-8 + 1e-5, F32: 2e-6}
TAIL = 2e-7  # fp32 y's bound grows by this times x^2: the rounding of the exp's argument, -x^2 / 2
ATOL = 1e-37
# Widths around both vector widths (8 and 16 floats); row counts around the 64-row blocks of the bias gradient.
SHAPES = [(1,), (7,), (3, 15), (17, 17), (2, 5, 33), (65, 40), (130, 1001), (4, 64, 96)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(shape, dtype, bias_dtype=None, seed=0):
    # x + bias spans GELU's curve (negative tail, the bend, the linear part); the gradient a plain normal.
    x = (torch.randn(shape, generator=_gen(seed)) * 3.0).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], generator=_gen(seed + 1)).to(bias_dtype or dtype).requires_grad_()
    g = torch.randn(shape, generator=_gen(seed + 2)).to(dtype)
    return x, bias, g


def _reference(x, bias, g):
    pre = (x.detach().float() + bias.detach().float()).to(x.dtype).double().requires_grad_()
    y = pre * 0.5 * torch.special.erfc(-pre / math.sqrt(2.0))  # F.gelu's 1 + erf cancels to 0 below x = -8.3
    y.backward(g.double())
    return y.detach(), pre.grad, pre.grad.reshape(-1, pre.shape[-1]).sum(0)


def _max_err(ours, ref):
    return (ours.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-30)


def _check(x, bias, g, y):
    ref_y, ref_dx, ref_db = _reference(x, bias, g)
    tol = RTOL[y.dtype]
    pre = (x.detach().float() + bias.detach().float()).double()
    elementwise = tol + (TAIL * pre * pre if y.dtype == F32 else 0.0)
    assert ((y.double() - ref_y).abs() <= elementwise * ref_y.abs() + ATOL).all(), _max_err(y, ref_y)
    assert _max_err(x.grad, ref_dx) <= tol
    assert _max_err(bias.grad, ref_db) <= tol


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_forward_and_grads_against_float64(variant, shape, dtype):
    x, bias, g = _inputs(shape, dtype)
    with OpNames() as ops:
        y = bias_gelu(x, bias)
        y.backward(g)
    assert ops.names.count(OURS) == 1 and ops.names.count(OURS_BACKWARD) == 1  # the kernel, not a fallback
    assert "aten.gelu" not in ops.names and "aten.gelu_backward" not in ops.names
    assert y.dtype == x.grad.dtype == bias.grad.dtype == dtype and y.is_contiguous()
    _check(x, bias, g, y)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_fp32_bias_on_any_activation(variant, dtype):
    # An fp32 bias (master weights) on bf16 x: x + bias in fp32, rounded to x's dtype; the bias gradient in fp32.
    x, bias, g = _inputs((70, 37), dtype, bias_dtype=F32)
    y = bias_gelu(x, bias)
    y.backward(g)
    assert y.dtype == dtype and bias.grad.dtype == F32
    _check(x, bias, g, y)


def test_normal_cdf_against_torch_erf(variant):
    # fp32 x, zero bias: y = x * Phi(x) rounded once, so y / x is the kernel's Phi within two fp32 roundings.
    x = torch.cat([torch.linspace(-12.0, 12.0, 24001), torch.logspace(-6, 0, 500), -torch.logspace(-6, 0, 500)])
    x = x[x != 0].unsqueeze(-1)
    y = bias_gelu(x, x.new_zeros(1))
    phi = y.double() / x.double()
    xd = x.double()
    ref = 0.5 * (1.0 + torch.special.erf(xd / math.sqrt(2.0)))
    ref = torch.where(xd < -3, 0.5 * torch.special.erfc(-xd / math.sqrt(2.0)), ref)  # no 1 + erf cancellation
    rel = ((phi - ref).abs() / ref).flatten()
    xf = xd.flatten()
    assert rel[xf > -1].max().item() <= 8e-7
    assert rel[xf >= -4].max().item() <= 3e-6
    assert rel.max().item() <= 3e-5
    erf = (2 * phi - 1).flatten()
    assert (erf - torch.special.erf(xf / math.sqrt(2.0)))[xf.abs() <= 5].abs().max().item() <= 6e-7


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_special_values(variant, dtype):
    # Large |x| (the CDF is 0 or 1) and zeros; inf and NaN propagate as in torch's gelu.
    x = torch.tensor([[0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 13.0, -13.0, 1e-30, -0.7518]], dtype=dtype)
    bias = torch.zeros(x.shape[-1], dtype=dtype, requires_grad=True)
    x.requires_grad_()
    g = torch.ones_like(x)
    bias_gelu(x, bias).backward(g)
    _check(x, bias, g, bias_gelu(x, bias))
    odd = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0], dtype=dtype)
    out = bias_gelu(odd, torch.zeros(4, dtype=dtype))
    ref = F.gelu(odd)
    assert out[0].isnan() and out[1] == float("inf") and torch.equal(out[2].isnan(), ref[2].isnan())
    assert torch.isfinite(out[3])


def test_non_contiguous_and_empty_inputs():
    base = (torch.randn(48, 70, generator=_gen(1)) * 3).to(BF16)
    x = base.t().requires_grad_()  # (70, 48), strides (1, 70)
    bias = torch.randn(96, generator=_gen(2)).to(BF16)[::2].detach().requires_grad_()  # stride 2
    g = torch.randn(70, 48, generator=_gen(3)).to(BF16)
    y = bias_gelu(x, bias)
    y.backward(g)
    assert y.is_contiguous() and x.grad.shape == (70, 48) and bias.grad.shape == (48,)
    _check(x, bias, g, y)
    e = torch.zeros(0, 48, dtype=BF16, requires_grad=True)
    b = torch.zeros(48, dtype=BF16, requires_grad=True)
    out = bias_gelu(e, b)
    assert out.shape == (0, 48)
    out.sum().backward()
    assert e.grad.shape == (0, 48) and torch.equal(b.grad, torch.zeros(48, dtype=BF16))


def test_only_the_needed_gradient():
    x, bias, g = _inputs((3, 40), F32)
    bias = bias.detach()
    bias_gelu(x, bias).backward(g)
    _, ref_dx, _ = _reference(x, bias, g)
    assert bias.grad is None and _max_err(x.grad, ref_dx) <= RTOL[F32]
    x, bias, g = _inputs((3, 40), F32)
    bias_gelu(x.detach(), bias).backward(g)
    _, _, ref_db = _reference(x, bias, g)
    assert _max_err(bias.grad, ref_db) <= RTOL[F32]


def _run(threads, x, bias, g):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x.grad = bias.grad = None
        y = bias_gelu(x, bias)
        y.backward(g)
        return [t.clone() for t in (y, x.grad, bias.grad)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_same_bits_at_1_2_3_threads(dtype):
    x, bias, g = _inputs((333, 203), dtype)  # six 64-row blocks and a tail, split differently per thread count
    one = _run(1, x, bias, g)
    for threads in (2, 3):
        assert all(torch.equal(a, c) for a, c in zip(one, _run(threads, x, bias, g))), threads


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_kernel_variants_agree(variant, dtype):
    # The vector variants contract multiply-adds into FMAs (bias_gelu_rows.h) and the scalar one does not: they agree
    # within the accuracy bound, relative to each output's largest magnitude (one bf16 rounding apart for bf16).
    x, bias, g = _inputs((40, 203), dtype)
    out = _run(2, x, bias, g)
    _ops.set_kernel_variant("scalar")
    try:
        ref = _run(2, x, bias, g)
    finally:
        _ops.set_kernel_variant(variant)
    for a, c in zip(out, ref):
        assert _max_err(a, c.double()) <= RTOL[dtype]


def test_unsupported_inputs_fall_back_to_torch():
    x = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(40, dtype=torch.float16)
    assert not supports(x, bias) and not supports(x.float(), bias.to(BF16))  # fp16; a bf16 bias on fp32 x
    assert not supports(x.float(), torch.randn(40, dtype=torch.float64))
    with OpNames() as ops:
        out = bias_gelu(x, bias)
        out.float().sum().backward()
    assert OURS not in ops.names
    assert torch.equal(out, F.gelu(x + bias))
    mixed = bias_gelu(x.detach().float(), bias.to(BF16))
    assert mixed.dtype == F32 and torch.equal(mixed, F.gelu(x.detach().float() + bias.to(BF16)))


def test_bad_arguments_name_themselves():
    x = torch.ones(2, 8)
    with pytest.raises(TypeError, match="x must be a tensor"):
        bias_gelu([1.0] * 8, torch.ones(8))
    with pytest.raises(TypeError, match="bias must be a tensor"):
        bias_gelu(x, 2.0)
    with pytest.raises(ValueError, match=r"bias must be 1-D of x's last dimension \(8\)"):
        bias_gelu(x, torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"bias must be 1-D of x's last dimension \(8\)"):
        bias_gelu(x, torch.ones(4))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        bias_gelu(x.long(), torch.ones(8))
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        bias_gelu(torch.tensor(1.0), torch.ones(1))
    # The op itself checks what the Python layer leaves to it.
    with pytest.raises(TypeError, match="bias must be float32 or x's dtype"):
        _op.forward(x, torch.ones(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        _op.forward(x.half(), torch.ones(8))
    with pytest.raises(ValueError, match="bias must be 1-D of x's last dimension"):
        _op.forward(x, torch.ones(4))
    with pytest.raises(ValueError, match="grad must be a CPU tensor of x's shape"):
        torch.ops.ipex_train.bias_gelu_backward(torch.ones(3), x, torch.ones(8))


def _samples():
    out = []
    for dtype in (BF16, F32):
        for shape in ((6, 48), (2, 3, 17), (5,), (70, 9)):
            x, bias, _ = _inputs(shape, dtype)
            out.append((x, bias))
    x, bias, _ = _inputs((8, 6), BF16, bias_dtype=F32)
    out.append((x, bias))
    x, _, _ = _inputs((8, 6), F32)
    _, bias, _ = _inputs((6, 8), F32)
    out.append((x.detach().t().requires_grad_(), bias))  # strided x
    return out


@pytest.mark.parametrize("args", _samples(), ids=lambda a: f"{a[0].dtype}-{a[1].dtype}-{tuple(a[0].shape)}")
def test_opcheck(args):
    torch.library.opcheck(torch.ops.ipex_train.bias_gelu_forward.default, args)


@pytest.mark.parametrize("op", ["bias_gelu", "gelu_with_bias_grad"])
def test_torch_compile_full_graph(op):
    x, bias, _ = _inputs((6, 48), BF16)
    fused = {"bias_gelu": bias_gelu, "gelu_with_bias_grad": gelu_with_bias_grad}[op]

    def fn(x, bias):
        return fused(x, bias) * 2

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(x, bias).graph_break_count == 0
    out = torch.compile(fn, fullgraph=True)(x, bias)
    assert torch.equal(out, fn(x, bias))
    out.float().sum().backward()
    eager_x, eager_b = (t.detach().clone().requires_grad_() for t in (x, bias))
    fn(eager_x, eager_b).float().sum().backward()
    assert torch.equal(x.grad, eager_x.grad) and torch.equal(bias.grad, eager_b.grad)


# gelu_with_bias_grad: torch's GELU forward on a pre-activation that holds the bias, the kernel's backward (the bias
# gradient from the same pass). Reference: the float64 one above with a zero bias (the kernel's x + 0 is pre).
AFTER = "ipex_train.gelu_with_bias_grad"


@pytest.mark.parametrize("shape", [(7,), (17, 17), (2, 5, 33), (130, 1001)], ids=str)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_gelu_with_bias_grad_is_torchs_forward_and_the_kernels_backward(shape, dtype):
    pre, bias, g = _inputs(shape, dtype)
    with OpNames() as ops:
        y = gelu_with_bias_grad(pre, bias)
        y.backward(g)
    assert AFTER in ops.names and OURS_BACKWARD in ops.names and OURS not in ops.names
    assert torch.equal(y, F.gelu(pre.detach()))
    zero = torch.zeros_like(bias)
    _, ref_dpre, ref_db = _reference(pre, zero, g)
    assert _max_err(pre.grad, ref_dpre) <= RTOL[dtype]
    assert _max_err(bias.grad, ref_db) <= RTOL[dtype]
    assert bias.grad.dtype == bias.dtype and bias.grad.shape == bias.shape


def test_gelu_with_bias_grad_through_a_linear_matches_torch():
    # The route's use: F.linear with the detached bias, the bias's gradient from the GELU.
    gen = _gen(3)
    x = torch.randn(40, 24, generator=gen).to(BF16).requires_grad_()
    w = (torch.randn(56, 24, generator=gen) * 0.2).to(BF16).requires_grad_()
    b = torch.randn(56, generator=gen).to(BF16).requires_grad_()
    g = torch.randn(40, 56, generator=gen).to(BF16)
    ref = F.gelu(F.linear(x, w, b))
    ref.backward(g)
    ref_grads = [t.grad.clone() for t in (x, w, b)]
    x.grad = w.grad = b.grad = None
    out = gelu_with_bias_grad(F.linear(x, w, b.detach()), b)
    out.backward(g)
    assert torch.equal(out, ref)
    for ours, theirs in zip((x.grad, w.grad, b.grad), ref_grads):
        assert _max_err(ours, theirs.double()) <= 2**-7


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_gelu_with_bias_grad_falls_back_to_torch(dtype):
    pre, bias, g = _inputs((9, 20), dtype)
    with OpNames() as ops:
        y = gelu_with_bias_grad(pre, bias)
        y.backward(g)
    assert AFTER not in ops.names and OURS_BACKWARD not in ops.names
    assert torch.equal(y, F.gelu(pre.detach()))
    d_pre = torch.ops.aten.gelu_backward(g, pre.detach())
    assert torch.equal(pre.grad, d_pre)
    torch.testing.assert_close(bias.grad, d_pre.float().sum(0).to(dtype))


def test_gelu_with_bias_grad_only_the_needed_gradient():
    pre, bias, g = _inputs((5, 30), F32)
    gelu_with_bias_grad(pre, bias.detach()).backward(g)
    assert bias.grad is None and pre.grad is not None
    pre, bias, g = _inputs((5, 30), F32)
    gelu_with_bias_grad(pre.detach(), bias).backward(g)
    assert pre.grad is None and bias.grad is not None


def test_gelu_with_bias_grad_bad_arguments_name_themselves():
    pre, bias, _ = _inputs((4, 6), F32)
    with pytest.raises(TypeError, match="pre must be a tensor"):
        gelu_with_bias_grad(pre.detach().numpy(), bias)
    with pytest.raises(ValueError, match=r"bias must be 1-D of pre's last dimension"):
        gelu_with_bias_grad(pre, bias[:5])


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_gelu_with_bias_grad_opcheck(dtype, layout):
    pre, _, _ = _inputs((6, 40) if layout != "transposed" else (40, 6), dtype)
    pre = {"contiguous": pre, "transposed": pre.detach().t(), "strided": pre.detach()[:, ::2]}[layout]
    bias = torch.randn(pre.shape[-1], generator=_gen(5)).to(dtype).requires_grad_()
    torch.library.opcheck(torch.ops.ipex_train.gelu_with_bias_grad.default, (pre.requires_grad_(), bias))


def test_gelu_with_bias_grad_without_a_backward_is_torchs_gelu():
    # Under no_grad, or with neither input requiring grad, there is no backward to fuse: torch's GELU, and no custom op
    # in what torch.export or AOTInductor would trace.
    pre, bias, _ = _inputs((5, 24), BF16)
    for ctx, args in ((torch.no_grad(), (pre, bias)), (torch.enable_grad(), (pre.detach(), bias.detach()))):
        with ctx, OpNames() as ops:
            y = gelu_with_bias_grad(*args)
        assert AFTER not in ops.names and torch.equal(y, F.gelu(pre.detach()))
