"""ipex_train.swiglu (silu(gate) * up, one fused op) against float64 torch references.

Reference: ``F.silu(gate) * up`` in float64 autograd on the same (bf16 or fp32) values, no intermediate rounding.
The kernel computes in fp32 (its exp has a relative error of ~2e-7) and rounds each output once to the inputs'
dtype:

- y, elementwise: within ``RTOL[dtype]`` of the reference's magnitude: bf16 2**-8 + 1e-5 (one rounding: bf16's unit
  roundoff is 2**-8), fp32 2e-6 (a few fp32 ulps; measured 6e-7).
- d_gate and d_up, relative to the reference gradient's largest magnitude (silu'(x) crosses zero near x = -1.28,
  where an elementwise relative bound means nothing): the same bounds (measured bf16 2.3e-3, fp32 4.8e-7).

Routing by the native compute policy: tests/test_swiglu_route.py.
"""
import pytest
import torch
import torch.nn.functional as F
from op_names import OpNames

from ipex_train.base import ops as _ops
from ipex_train.swiglu import _op, silu_mul, supports

BF16, F32 = torch.bfloat16, torch.float32
OURS = "ipex_train.silu_mul_forward"
OURS_BACKWARD = "ipex_train.silu_mul_backward"
RTOL = {BF16: 2**-8 + 1e-5, F32: 2e-6}
# Sizes around both vector widths (8 and 16 floats) and the kernel's 16384-element blocks.
SHAPES = [(1,), (7,), (15,), (17,), (3, 33), (2, 5, 1001), (5, 7000), (4, 64, 512)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(shape, dtype, seed=0):
    # gate spans silu's curve (negative tail, the bend, the linear part), up and the gradient plain normals.
    gate = (torch.randn(shape, generator=_gen(seed)) * 4.0).to(dtype).requires_grad_()
    up = torch.randn(shape, generator=_gen(seed + 1)).to(dtype).requires_grad_()
    g = torch.randn(shape, generator=_gen(seed + 2)).to(dtype)
    return gate, up, g


def _reference(gate, up, g):
    gd, ud = (t.detach().double().requires_grad_() for t in (gate, up))
    y = F.silu(gd) * ud
    y.backward(g.double())
    return y.detach(), gd.grad, ud.grad


def _max_err(ours, ref):
    return (ours.double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-30)


def _check(gate, up, g, y):
    ref_y, ref_dg, ref_du = _reference(gate, up, g)
    tol = RTOL[y.dtype]
    assert ((y.double() - ref_y).abs() <= tol * ref_y.abs() + 1e-30).all()
    assert _max_err(gate.grad, ref_dg) <= tol
    assert _max_err(up.grad, ref_du) <= tol


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_forward_and_grads_against_float64(variant, shape, dtype):
    gate, up, g = _inputs(shape, dtype)
    with OpNames() as ops:
        y = silu_mul(gate, up)
        y.backward(g)
    assert ops.names.count(OURS) == 1 and ops.names.count(OURS_BACKWARD) == 1  # the kernel, not a fallback
    assert "aten.silu" not in ops.names and "aten.silu_backward" not in ops.names
    assert y.dtype == gate.grad.dtype == up.grad.dtype == dtype and y.is_contiguous()
    _check(gate, up, g, y)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_special_values(variant, dtype):
    # Large |x| (exp underflows to 0: silu(x) is x or 0) and zeros; inf and NaN propagate as in torch's silu.
    gate = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1.278], dtype=dtype)
    up = torch.linspace(-2, 2, gate.numel()).to(dtype)
    gate.requires_grad_()
    up.requires_grad_()
    g = torch.ones_like(gate)
    silu_mul(gate, up).backward(g)
    _check(gate, up, g, silu_mul(gate, up))
    odd = torch.tensor([float("nan"), float("inf"), 1.0], dtype=dtype)
    out = silu_mul(odd, torch.ones_like(odd))
    assert out[0].isnan() and out[1] == float("inf") and torch.isfinite(out[2])


def test_non_contiguous_and_empty_inputs():
    # Strided inputs are read through contiguous copies; the gradients keep the inputs' shapes.
    base = (torch.randn(48, 70, generator=_gen(1)) * 3).to(BF16)
    gate = base.t().requires_grad_()  # (70, 48), strides (1, 70)
    up = torch.randn(70, 96, generator=_gen(2)).to(BF16)[:, ::2].requires_grad_()  # (70, 48), stride 2
    g = torch.randn(70, 48, generator=_gen(3)).to(BF16)
    y = silu_mul(gate, up)
    y.backward(g)
    assert y.is_contiguous() and gate.grad.shape == up.grad.shape == (70, 48)
    _check(gate, up, g, y)
    e = torch.zeros(0, 48, dtype=BF16, requires_grad=True)
    out = silu_mul(e, e.detach().clone().requires_grad_())
    assert out.shape == (0, 48)
    out.sum().backward()
    assert e.grad.shape == (0, 48)


def test_only_the_needed_gradient():
    gate, up, g = _inputs((3, 40), F32)
    up = up.detach()
    silu_mul(gate, up).backward(g)
    _, ref_dg, _ = _reference(gate, up, g)
    assert up.grad is None and _max_err(gate.grad, ref_dg) <= RTOL[F32]


def _run(threads, gate, up, g):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gate.grad = up.grad = None
        y = silu_mul(gate, up)
        y.backward(g)
        return [t.clone() for t in (y, gate.grad, up.grad)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_same_bits_at_1_2_3_threads(dtype):
    gate, up, g = _inputs((3, 16411), dtype)  # 49233 elements: three full blocks and a tail, split per thread count
    one = _run(1, gate, up, g)
    for threads in (2, 3):
        assert all(torch.equal(a, c) for a, c in zip(one, _run(threads, gate, up, g))), threads


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_kernel_variants_agree(variant, dtype):
    # The same fp32 operations lane by lane in every ISA (no contraction into FMAs, -ffp-contract=off).
    gate, up, g = _inputs((40, 203), dtype)
    out = _run(2, gate, up, g)
    _ops.set_kernel_variant("scalar")
    try:
        ref = _run(2, gate, up, g)
    finally:
        _ops.set_kernel_variant(variant)
    for a, c in zip(out, ref):
        torch.testing.assert_close(a, c, rtol=RTOL[dtype], atol=0.0)


def test_unsupported_inputs_fall_back_to_torch():
    gate = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    up = torch.randn(3, 40, dtype=torch.float16)
    assert not supports(gate, up) and not supports(gate.float(), up.to(BF16))  # fp16; mixed dtypes
    assert not supports(torch.randn(3, 40), torch.randn(1, 40))  # broadcasting shapes
    with OpNames() as ops:
        out = silu_mul(gate, up)
        out.float().sum().backward()
    assert OURS not in ops.names
    assert torch.equal(out, F.silu(gate) * up)
    mixed = silu_mul(gate.detach().float(), up.to(BF16))
    assert mixed.dtype == F32 and torch.equal(mixed, F.silu(gate.detach().float()) * up.to(BF16))


def test_bad_arguments_name_themselves():
    x = torch.ones(2, 8)
    with pytest.raises(TypeError, match="gate must be a tensor"):
        silu_mul([1.0] * 8, x)
    with pytest.raises(TypeError, match="up must be a tensor"):
        silu_mul(x, 2.0)
    with pytest.raises(ValueError, match=r"up must have gate's shape \(2, 8\)"):
        silu_mul(x, torch.ones(1, 8))
    with pytest.raises(TypeError, match="floating-point"):
        silu_mul(x.long(), x.long())
    # The op itself checks what the Python layer leaves to it.
    with pytest.raises(TypeError, match="up must have gate's dtype"):
        _op.forward(x, x.to(BF16))
    with pytest.raises(TypeError, match="gate must be bfloat16 or float32"):
        _op.forward(x.half(), x.half())
    with pytest.raises(ValueError, match="up must have gate's shape"):
        _op.forward(x, torch.ones(2, 4))
    with pytest.raises(ValueError, match="grad must be a CPU tensor of gate's shape"):
        torch.ops.ipex_train.silu_mul_backward(torch.ones(3), x, x)


def _samples():
    out = []
    for dtype in (BF16, F32):
        for shape in ((6, 48), (2, 3, 17), (5,)):
            gate, up, _ = _inputs(shape, dtype)
            out.append((gate, up))
    gate, up, _ = _inputs((8, 6), F32)
    out.append((gate.detach().t().requires_grad_(), up.detach().t().requires_grad_()))  # strided operands
    return out


@pytest.mark.parametrize("args", _samples(), ids=lambda a: f"{a[0].dtype}-{tuple(a[0].shape)}")
def test_opcheck(args):
    torch.library.opcheck(torch.ops.ipex_train.silu_mul_forward.default, args)


def test_torch_compile_full_graph():
    gate, up, _ = _inputs((6, 48), BF16)

    def fn(gate, up):
        return silu_mul(gate, up) * 2

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(gate, up).graph_break_count == 0
    out = torch.compile(fn, fullgraph=True)(gate, up)
    assert torch.equal(out, fn(gate, up))
    out.float().sum().backward()
    eager_gate, eager_up = (t.detach().clone().requires_grad_() for t in (gate, up))
    fn(eager_gate, eager_up).float().sum().backward()
    assert torch.equal(gate.grad, eager_gate.grad) and torch.equal(up.grad, eager_up.grad)
