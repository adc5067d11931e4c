"""ipex_train.add_norm.add_layer_norm_with_sum (pre-norm blocks: the residual add's sum is an output too, and
differentiable) against float64 torch references.

Reference: tests/test_add_norm.py's, ``s = x * keep + residual`` and ``y = F.layer_norm(s)`` in float64 autograd, with
the sum's own gradient added: ``(y * g + s * g_sum).sum()`` backward. Tolerances as there (``_tolerances``): the
sum's gradient is added to the LayerNorm's in fp32 before the one rounding of each input's gradient; the sum equals
``x * keep + residual`` computed in fp32 and rounded once to the residual's dtype, bit for bit.

Routing by the native compute policy: tests/test_prenorm_route.py.
"""
import pytest
import torch
import torch.nn.functional as F
from op_names import OpNames
from test_add_norm import OURS, OURS_BACKWARD, PAIRS, _err, _gen, _inputs, _keep, _seed, _tolerances

from ipex_train.add_norm import _op, add_layer_norm, add_layer_norm_with_sum

BF16, F32 = torch.bfloat16, torch.float32



def _reference_with_sum(x, r, w, b, eps, g, g_sum, keep=None):
    xd, rd, wd, bd = (t.detach().double().requires_grad_() for t in (x, r, w, b))
    s = (xd if keep is None else xd * keep) + rd
    y = F.layer_norm(s, (x.shape[-1],), wd, bd, eps)
    total = s.new_zeros(())
    if g is not None:
        total = total + (y * g.double()).sum()
    if g_sum is not None:
        total = total + (s * g_sum.double()).sum()
    total.backward()
    return y.detach(), s.detach(), xd.grad, rd.grad, wd.grad, bd.grad


def _check_with_sum(x, r, w, b, y, s, g, g_sum, keep, tol, eps=1e-5):
    ref_y, ref_s, rx, rr, rw, rb = _reference_with_sum(x, r, w, b, eps, g, g_sum, keep)
    ty, tx, tr, tw = tol
    assert _err(y, ref_y) <= ty
    # The sum is x * keep + residual computed in fp32 and rounded once to the residual's dtype.
    h = x.detach().float() if keep is None else x.detach().float() * keep.float()
    assert torch.equal(s, (h + r.detach().float()).to(r.dtype))
    assert _err(x.grad, rx) <= tx and _err(r.grad, rr) <= tr
    if g is None:  # LayerNorm unused: no weight / bias gradient
        assert w.grad is None and b.grad is None
    else:
        assert _err(w.grad, rw) <= tw and _err(b.grad, rb) <= tw


def _backward_of(y, s, g, g_sum):
    outputs = [t for t, grad in ((y, g), (s, g_sum)) if grad is not None]
    torch.autograd.backward(outputs, [grad for grad in (g, g_sum) if grad is not None])


@pytest.mark.parametrize("used", ["both", "sum_only", "y_only"])
@pytest.mark.parametrize("shape", [(4, 64, 768), (3, 17), (130, 100), (1, 1, 200)])
@pytest.mark.parametrize("w_f32", [True, False])
@pytest.mark.parametrize("pair", PAIRS)
def test_with_sum_forward_and_grads_against_float64(pair, w_f32, shape, used):
    x_dtype, r_dtype = pair
    x, r, w, b = _inputs(shape, x_dtype, r_dtype, F32 if w_f32 else r_dtype)
    g = None if used == "sum_only" else torch.randn(shape, generator=_gen(9)).to(r_dtype)
    # The residual stream's gradient is of the LayerNorm's order or larger (it sums every later block's).
    g_sum = None if used == "y_only" else (torch.randn(shape, generator=_gen(10)) * 3).to(r_dtype)
    with OpNames() as ops:
        y, s = add_layer_norm_with_sum(x, r, w, b, 1e-5)
        _backward_of(y, s, g, g_sum)
    assert ops.names.count(OURS) == 1 and ops.names.count(OURS_BACKWARD) == 1  # the kernel, not a fallback
    assert "aten.native_layer_norm" not in ops.names and "aten.add.Tensor" not in ops.names  # grad_sum added inside
    assert y.dtype == s.dtype == r_dtype and x.grad.dtype == x_dtype and r.grad.dtype == r_dtype
    _check_with_sum(x, r, w, b, y, s, g, g_sum, None, _tolerances(x_dtype, r_dtype))


@pytest.mark.parametrize("pair", PAIRS)
def test_with_sum_dropout_uses_one_mask(pair):
    x_dtype, r_dtype = pair
    shape, p, seed = (70, 300), 0.3, 1234
    x, r, w, b = _inputs(shape, x_dtype, r_dtype, F32)
    g = torch.randn(shape, generator=_gen(9)).to(r_dtype)
    g_sum = torch.randn(shape, generator=_gen(10)).to(r_dtype)
    y, s = _op.forward_with_sum(x, r, w, b, 1e-5, p, _seed(seed))
    _backward_of(y, s, g, g_sum)
    keep = _keep(shape, p, seed)
    assert torch.equal(x.grad == 0, (keep == 0) | (r.grad == 0))  # grad_x: grad_residual through the mask
    _check_with_sum(x, r, w, b, y, s, g, g_sum, keep, _tolerances(x_dtype, r_dtype))


def test_with_sum_matches_add_layer_norm_and_its_sum():
    # Same forward as add_layer_norm; with no gradient of the sum the backward is the post-norm one, bit for bit.
    x, r, w, b = _inputs((37, 96), BF16, BF16, F32)
    g = torch.randn(37, 96, generator=_gen(9)).to(BF16)
    y, s = add_layer_norm_with_sum(x, r, w, b, 1e-5)
    y.backward(g)
    grads = [t.grad.clone() for t in (x, r, w, b)]
    for t in (x, r, w, b):
        t.grad = None
    y2 = add_layer_norm(x, r, w, b, 1e-5)
    y2.backward(g)
    assert torch.equal(y, y2) and all(torch.equal(a, t.grad) for a, t in zip(grads, (x, r, w, b)))


def _run_with_sum(threads, x, r, w, b, g, g_sum):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (x, r, w, b):
            t.grad = None
        y, s = _op.forward_with_sum(x, r, w, b, 1e-5, 0.25, _seed(99))
        _backward_of(y, s, g, g_sum)
        return [t.clone() for t in (y, s, x.grad, r.grad, w.grad, b.grad)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("pair", [(BF16, BF16), (F32, F32)])
def test_with_sum_same_bits_at_1_2_3_threads(pair):
    x, r, w, b = _inputs((300, 96), *pair, F32)
    g = torch.randn(300, 96, generator=_gen(5)).to(pair[1])
    g_sum = torch.randn(300, 96, generator=_gen(6)).to(pair[1])
    one = _run_with_sum(1, x, r, w, b, g, g_sum)
    for threads in (2, 3):
        assert all(torch.equal(a, c) for a, c in zip(one, _run_with_sum(threads, x, r, w, b, g, g_sum))), threads


def test_with_sum_unsupported_dtypes_fall_back_to_torch():
    x = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    r = torch.randn(3, 40, dtype=torch.float16, requires_grad=True)
    w, b = torch.ones(40), torch.zeros(40)
    with OpNames() as ops:
        y, s = add_layer_norm_with_sum(x, r, w, b, 1e-5)
        (y.float().sum() + s.float().sum()).backward()
    assert OURS not in ops.names
    assert torch.equal(s, x + r) and torch.equal(y, F.layer_norm(x + r, (40,), w, b, 1e-5))
    assert r.grad is not None and x.grad is not None


def test_with_sum_bad_arguments_name_themselves():
    x = torch.ones(2, 8, dtype=BF16)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_layer_norm_with_sum(x, torch.ones(1, 8, dtype=BF16), None, None, 1e-5)
    with pytest.raises(TypeError, match="training"):
        add_layer_norm_with_sum(x, x, None, None, 1e-5, p=0.1, training=None)
    y, s, mean, rstd = _op.forward_with_stats(x, x, torch.ones(8), torch.zeros(8), 1e-5, 0.0, _seed(0))
    with pytest.raises(ValueError, match="grad_sum must have the sum's shape"):
        torch.ops.ipex_train.add_layer_norm_backward(y, s, torch.ones(8), mean, rstd, 0.0, _seed(0), BF16,
                                                     torch.ones(2, 7, dtype=BF16))


def _backward_samples():
    out = []
    for x_dtype, r_dtype in PAIRS:
        for p in (0.0, 0.3):
            x, r, w, b = (t.detach() for t in _inputs((6, 48), x_dtype, r_dtype, F32))
            y, s, mean, rstd = _op.forward_with_stats(x, r, w, b, 1e-5, p, _seed(11))
            g = torch.randn(6, 48, generator=_gen(3)).to(r_dtype)
            for g_sum in (None, torch.randn(6, 48, generator=_gen(4)).to(r_dtype)):
                out.append((g, s, w, mean, rstd, p, _seed(11), x_dtype, g_sum))
    return out


@pytest.mark.parametrize("args", _backward_samples(), ids=lambda a: f"{a[7]}-{a[1].dtype}-p{a[5]}-"
                         f"{'sum' if a[8] is not None else 'nosum'}" if isinstance(a, tuple) else None)
def test_opcheck_backward(args):
    torch.library.opcheck(torch.ops.ipex_train.add_layer_norm_backward.default, args)


def test_with_sum_torch_compile_full_graph():
    x, r, w, b = _inputs((6, 48), BF16, F32, F32)

    def fn(x, r, w, b):
        y, s = add_layer_norm_with_sum(x, r, w, b, 1e-5)
        return y * 2 + s

    torch._dynamo.reset()
    assert torch._dynamo.explain(fn)(x, r, w, b).graph_break_count == 0
    out = torch.compile(fn, fullgraph=True)(x, r, w, b)
    assert torch.equal(out, fn(x, r, w, b))
    out.sum().backward()
    grads = [t.grad.clone() for t in (x, r, w, b)]
    for t in (x, r, w, b):
        t.grad = None
    fn(x, r, w, b).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (x, r, w, b)))
