"""ipex_train.add_norm (dropout + residual add + LayerNorm, one fused op) against float64 torch references.

Reference: ``F.layer_norm(x * keep + residual)`` in float64 autograd on the same values (keep: the kernel's mask
times 1 / (1 - p), recovered from its forward), no intermediate rounding. The kernel computes in fp32, rounds the
sum to the residual's dtype (as the unfused module's ``h + input_tensor`` does) and each output once. Errors are
measured relative to the reference's largest magnitude (``_err``):

- bf16 sum (bf16 x and residual): y within 2**-6 (bf16's unit roundoff is 2**-8: one rounding of the sum, scaled by
  the normalization, and one of y; measured 6e-3 over SHAPES); grad_x and grad_residual within 2**-6 (computed from
  the rounded sum, rounded once to bf16; measured 3.4e-3); grad_weight and grad_bias within 2**-6 (products with
  xhat of the rounded sum, summed in fp32, rounded once to the weight's dtype; measured 3.8e-3).
- fp32 sum (fp32 residual, x bf16 or fp32): y, grad_residual, grad_weight and grad_bias within 2e-6 (fp32 ulps of
  the row sums; measured 3e-7); grad_x within 2e-6 for fp32 x, 2**-7 for bf16 x (one bf16 rounding; measured
  3.2e-3).

``add_layer_norm_with_sum`` (the sum as a differentiable output): tests/test_add_norm_with_sum.py.

Routing by the native compute policy: tests/test_add_norm_route.py (post-norm), tests/test_prenorm_route.py (pre-norm).
"""
import pytest
import torch
import torch.nn.functional as F
from op_names import OpNames

from ipex_train.add_norm import _op, add_layer_norm, supports
from ipex_train.base import ops as _ops

BF16, F32 = torch.bfloat16, torch.float32
OURS = "ipex_train.add_layer_norm_forward"
OURS_BACKWARD = "ipex_train.add_layer_norm_backward"
# (x dtype, residual dtype): the combinations the kernel takes.
PAIRS = [(BF16, BF16), (BF16, F32), (F32, F32)]
SHAPES = [(4, 64, 768), (1, 37), (3, 17), (130, 100), (2, 3, 1), (1, 1, 200)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(shape, x_dtype, r_dtype, w_dtype, seed=0):
    n = shape[-1]
    x = (torch.randn(shape, generator=_gen(seed)) * 2.0).to(x_dtype).requires_grad_()
    r = (torch.randn(shape, generator=_gen(seed + 1)) + 0.5).to(r_dtype).requires_grad_()
    w = (torch.randn(n, generator=_gen(seed + 2)) * 0.3 + 1.0).to(w_dtype).requires_grad_()
    b = (torch.randn(n, generator=_gen(seed + 3)) * 0.1).to(w_dtype).requires_grad_()
    return x, r, w, b


def _err(ours, ref):
    return (ours.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)


def _seed(value):
    return torch.tensor([value], dtype=torch.int64)


def _fused(x, r, w, b, eps, p, seed):
    """The op with an explicit seed: y (differentiable) and the rounded sum."""
    y, s, _, _ = _op.forward_with_stats(x, r, w, b, eps, p, _seed(seed))
    return y, s


def _keep(shape, p, seed):
    """The kernel's keep-scale per element for this seed: the sum of x = 1 and residual = 0 (fp32, no rounding)."""
    n = shape[-1]
    ones, zeros = torch.ones(shape), torch.zeros(shape)
    _, s = _fused(ones, zeros, torch.ones(n), torch.zeros(n), 1e-5, p, seed)
    return s.double()


def _reference(x, r, w, b, eps, g, keep=None):
    xd, rd, wd, bd = (t.detach().double().requires_grad_() for t in (x, r, w, b))
    h = xd if keep is None else xd * keep
    y = F.layer_norm(h + rd, (x.shape[-1],), wd, bd, eps)
    y.backward(g.double())
    return y.detach(), xd.grad, rd.grad, wd.grad, bd.grad


def _tolerances(x_dtype, r_dtype):
    """(y, grad_x, grad_residual, grad_weight/bias) relative tolerances: see the module docstring."""
    if r_dtype == BF16:
        return 2**-6, 2**-6, 2**-6, 2**-6
    return 2e-6, (2**-7 if x_dtype == BF16 else 2e-6), 2e-6, 2e-6


def _check_against(x, r, w, b, y, g, keep, tol, eps=1e-5):
    ref_y, rx, rr, rw, rb = _reference(x, r, w, b, eps, g, keep)
    ty, tx, tr, tw = tol
    assert _err(y, ref_y) <= ty
    assert _err(x.grad, rx) <= tx
    assert _err(r.grad, rr) <= tr
    assert _err(w.grad, rw) <= tw and _err(b.grad, rb) <= tw


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("w_f32", [True, False])
@pytest.mark.parametrize("pair", PAIRS)
def test_forward_and_grads_against_float64(shape, w_f32, pair):
    x_dtype, r_dtype = pair
    x, r, w, b = _inputs(shape, x_dtype, r_dtype, F32 if w_f32 else r_dtype)
    g = torch.randn(shape, generator=_gen(9)).to(r_dtype)
    with OpNames() as ops:
        y = add_layer_norm(x, r, w, b, 1e-5)
        y.backward(g)
    assert ops.names.count(OURS) == 1 and ops.names.count(OURS_BACKWARD) == 1  # the kernel, not a fallback
    assert "aten.native_layer_norm" not in ops.names
    assert y.dtype == r_dtype and x.grad.dtype == x_dtype and r.grad.dtype == r_dtype
    assert w.grad.dtype == b.grad.dtype == w.dtype
    _check_against(x, r, w, b, y, g, None, _tolerances(x_dtype, r_dtype))


@pytest.mark.parametrize("pair", PAIRS)
def test_dropout_forward_and_backward_use_one_mask(pair):
    x_dtype, r_dtype = pair
    shape, p, seed = (70, 300), 0.3, 1234
    x, r, w, b = _inputs(shape, x_dtype, r_dtype, F32)
    g = torch.randn(shape, generator=_gen(9)).to(r_dtype)
    y, s = _fused(x, r, w, b, 1e-5, p, seed)
    y.backward(g)
    keep = _keep(shape, p, seed)
    # The mask the forward applied: the stored sum is x * keep + residual, rounded to its dtype.
    assert torch.equal(s, (x.detach().float() * keep.float() + r.detach().float()).to(r_dtype))  # fp32, as the kernel
    assert set(keep.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p), dtype=F32).item()}
    # The backward's grad_x is grad_residual through the same mask (exact zeros where dropped).
    assert torch.equal(x.grad == 0, (keep == 0) | (r.grad == 0))
    _check_against(x, r, w, b, y, g, keep, _tolerances(x_dtype, r_dtype))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_one_minus_p(p):
    keep = _keep((64, 4096), p, seed=7)
    kept = (keep != 0).double().mean().item()
    assert abs(kept - (1 - p)) <= 0.005  # 262144 draws: the binomial's sd is below 0.001
    # Columns and rows are not correlated with the decision: each row's and each column's kept fraction is near 1 - p.
    assert ((keep != 0).double().mean(1) - (1 - p)).abs().max() <= 0.05
    assert ((keep != 0).double().mean(0) - (1 - p)).abs().max() <= 0.25  # 64 draws per column


def test_public_dropout_draws_from_torch_generator():
    x, r, w, b = (t.detach() for t in _inputs((16, 64), BF16, BF16, F32))
    torch.manual_seed(3)
    a = add_layer_norm(x, r, w, b, 1e-5, p=0.2, training=True)
    torch.manual_seed(3)
    again = add_layer_norm(x, r, w, b, 1e-5, p=0.2, training=True)
    other = add_layer_norm(x, r, w, b, 1e-5, p=0.2, training=True)
    assert torch.equal(a, again) and not torch.equal(a, other)


def test_no_dropout_at_p0_or_in_eval():
    x, r, w, b = (t.detach() for t in _inputs((16, 64), BF16, BF16, F32))
    plain = add_layer_norm(x, r, w, b, 1e-5)
    assert torch.equal(add_layer_norm(x, r, w, b, 1e-5, p=0.0, training=True), plain)
    assert torch.equal(add_layer_norm(x, r, w, b, 1e-5, p=0.4, training=False), plain)
    assert not torch.equal(add_layer_norm(x, r, w, b, 1e-5, p=0.4, training=True), plain)


def test_weight_and_bias_none():
    x, r, _, _ = _inputs((5, 40), BF16, BF16, F32)
    y = add_layer_norm(x, r, None, None, 1e-5)
    ref = F.layer_norm(x.detach().double() + r.detach().double(), (40,), eps=1e-5)
    assert y.dtype == BF16 and _err(y, ref) <= 2**-6
    y.float().sum().backward()
    assert x.grad is not None and r.grad is not None


def test_non_contiguous_and_empty_inputs():
    # Strided x and residual are read through contiguous copies; no rows gives empty outputs and zero weight grads.
    base = torch.randn(48, 6, generator=_gen(1)).to(BF16)
    x = base.t().requires_grad_()  # (6, 48), strides (1, 6)
    r = torch.randn(48, 6, generator=_gen(2)).to(BF16).t().requires_grad_()
    w, b = torch.ones(48, requires_grad=True), torch.zeros(48, requires_grad=True)
    g = torch.randn(6, 48, generator=_gen(3)).to(BF16)
    y = add_layer_norm(x, r, w, b, 1e-5)
    y.backward(g)
    _check_against(x, r, w, b, y, g, None, _tolerances(BF16, BF16))
    e = torch.zeros(0, 48, dtype=BF16, requires_grad=True)
    out = add_layer_norm(e, e.detach().clone().requires_grad_(), w, b, 1e-5)
    assert out.shape == (0, 48)
    w.grad = None
    out.sum().backward()
    assert e.grad.shape == (0, 48) and torch.equal(w.grad, torch.zeros(48))


def _run(threads, x, r, w, b, g):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (x, r, w, b):
            t.grad = None
        y, s = _fused(x, r, w, b, 1e-5, 0.25, 99)
        y.backward(g)
        return [t.clone() for t in (y, s, x.grad, r.grad, w.grad, b.grad)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("pair", [(BF16, BF16), (F32, F32)])
def test_same_bits_at_1_2_3_threads(pair):
    # 300 rows: five blocks of the weight gradient's fixed row blocks, split differently at each thread count.
    x, r, w, b = _inputs((300, 96), *pair, F32)
    g = torch.randn(300, 96, generator=_gen(5)).to(pair[1])
    one = _run(1, x, r, w, b, g)
    for threads in (2, 3):
        assert all(torch.equal(a, c) for a, c in zip(one, _run(threads, x, r, w, b, g))), threads


@pytest.mark.parametrize("pair", PAIRS)
def test_kernel_variants_agree(variant, pair):
    # Row sums add in each ISA's vector width: a few ulps of fp32 apart, then one rounding to the output dtype.
    x, r, w, b = _inputs((40, 203), *pair, F32)
    g = torch.randn(40, 203, generator=_gen(5)).to(pair[1])
    out = _run(2, x, r, w, b, g)
    _ops.set_kernel_variant("scalar")
    try:
        ref = _run(2, x, r, w, b, g)
    finally:
        _ops.set_kernel_variant(variant)
    for a, c in zip(out, ref):
        rtol, atol = (2**-7, 2e-2) if a.dtype == BF16 else (1e-5, 1e-5)
        torch.testing.assert_close(a, c, rtol=rtol, atol=atol)


def test_unsupported_dtypes_fall_back_to_torch():
    x = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    r = torch.randn(3, 40, dtype=torch.float16)
    w, b = torch.ones(40), torch.zeros(40)
    assert not supports(x, r, w, b) and not supports(r.float(), x, w, b)  # fp16; fp32 x with a bf16 residual
    with OpNames() as ops:
        out = add_layer_norm(x, r, w, b, 1e-5)
        out.float().sum().backward()
    assert OURS not in ops.names
    assert torch.equal(out, F.layer_norm(x + r, (40,), w, b, 1e-5))


def test_bad_arguments_name_themselves():
    x = torch.ones(2, 8, dtype=BF16)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        add_layer_norm(x, x, torch.ones(7), None, 1e-5)
    with pytest.raises(ValueError, match="bias must be 1-D"):
        add_layer_norm(x, x, w, torch.ones(2, 8), 1e-5)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_layer_norm(x, torch.ones(1, 8, dtype=BF16), w, None, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        add_layer_norm(x, x, w, None, -1.0)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        add_layer_norm(x, x, w, None, 1e-5, p=1.0, training=True)
    with pytest.raises(TypeError, match="p must be a float"):
        add_layer_norm(x, x, w, None, 1e-5, p="0.1")
    with pytest.raises(TypeError, match="training"):
        add_layer_norm(x, x, w, None, 1e-5, p=0.1, training=1)
    with pytest.raises(TypeError, match="x and residual"):
        add_layer_norm([1.0] * 8, x, w, None, 1e-5)
    # The op itself checks what the Python layer leaves to it.
    with pytest.raises(TypeError, match="weight and bias must share one dtype"):
        _op.forward(x, x, w, torch.zeros(8, dtype=BF16), 1e-5, 0.0, _seed(0))
    with pytest.raises(ValueError, match="seed"):
        _op.forward(x, x, w, torch.zeros(8), 1e-5, 0.0, torch.zeros(2, dtype=torch.int64))


def _samples():
    out = []
    for x_dtype, r_dtype in PAIRS:
        for p in (0.0, 0.3):
            x, r, w, b = _inputs((6, 48), x_dtype, r_dtype, F32)
            out.append((x, r, w, b, 1e-5, p, _seed(11)))
    x, r, w, b = _inputs((2, 3, 40), BF16, BF16, BF16)
    out.append((x, r, w, b, 1e-6, 0.1, _seed(5)))
    return out


@pytest.mark.parametrize("args", _samples(), ids=lambda a: f"{a[0].dtype}-{a[1].dtype}-p{a[5]}"
                         if isinstance(a, tuple) else None)
def test_opcheck(args):
    torch.library.opcheck(torch.ops.ipex_train.add_layer_norm_forward.default, args)


def test_torch_compile_full_graph():
    x, r, w, b = _inputs((6, 48), BF16, F32, F32)

    def fn(x, r, w, b):
        return add_layer_norm(x, r, w, b, 1e-5) * 2

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(x, r, w, b).graph_break_count == 0
    out = torch.compile(fn, fullgraph=True)(x, r, w, b)
    assert torch.equal(out, fn(x, r, w, b))
    out.sum().backward()
    assert x.grad.dtype == BF16 and r.grad.dtype == F32 and w.grad is not None

