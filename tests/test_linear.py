"""ipex_train.linear: F.linear with the bias in oneDNN's GEMM epilogue. Where :func:`supports` holds, the output and
the gradients of x, weight and bias equal F.linear's bit for bit (torch.equal): the same products, and the bias added
to the fp32 accumulation before the one rounding either way. Everything else goes to F.linear itself."""
import pytest
import torch
import torch.nn.functional as F
from op_names import OpNames

import ipex_train.linear as lin
from ipex_train.base import ops as _ops

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    # The op's numerics on small tensors: linear() otherwise leaves outputs under MIN_OUTPUT_ELEMENTS to F.linear.
    monkeypatch.setattr(lin, "MIN_OUTPUT_ELEMENTS", 0)
OURS = "ipex_train.linear_bias"

available = pytest.mark.skipif(not lin._probe(), reason="oneDNN's bf16 linear with a bias epilogue does not run here "
                               "(or differs from F.linear), so ipex_train.linear is F.linear")


@pytest.mark.skipif(not _ops.cpu_features().get("amx_bf16", False), reason="measured equal to F.linear on AMX CPUs "
                    "only; elsewhere the probe decides")
def test_the_probe_passes_on_amx():
    # On AMX CPUs the op was measured equal to F.linear: a probe failing there would quietly leave every call to
    # F.linear (and skip the tests below), so that is a failure, not a skip.
    assert lin._probe()


def _operands(x_shape, out, grads=(True, True, True), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=gen).to(BF16).requires_grad_(grads[0])
    w = (torch.randn(out, x_shape[-1], generator=gen) * x_shape[-1] ** -0.5).to(BF16).requires_grad_(grads[1])
    b = torch.randn(out, generator=gen).to(BF16).requires_grad_(grads[2])
    return x, w, b


@available
@pytest.mark.parametrize("x_shape,out", [((17, 64), 96), ((2, 9, 48), 40), ((4, 197, 256), 768), ((3, 768), 10),
                                         ((1, 1, 32), 16)], ids=str)
@pytest.mark.parametrize("grads", [(True, True, True), (True, False, True), (True, True, False), (False, True, True)],
                         ids=["all", "frozen-weight", "detached-bias", "no-input-grad"])
def test_output_and_grads_equal_f_linear(x_shape, out, grads):
    x, w, b = _operands(x_shape, out, grads)
    g = torch.randn(*x_shape[:-1], out, generator=torch.Generator().manual_seed(1)).to(BF16)
    inputs = [t for t in (x, w, b) if t.requires_grad]
    with OpNames() as ops:
        y = lin.linear(x, w, b)
        grads_ours = torch.autograd.grad(y, inputs, g)
    assert OURS in ops.names and "aten.addmm" not in ops.names
    y_ref = F.linear(x, w, b)
    assert torch.equal(y, y_ref)
    for ours, ref in zip(grads_ours, torch.autograd.grad(y_ref, inputs, g)):
        assert ours.shape == ref.shape and torch.equal(ours, ref)


@available
def test_no_grad_and_inference_mode():
    x, w, b = _operands((5, 32), 24)
    with torch.inference_mode():
        assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))
    with torch.no_grad():
        assert not lin.linear(x, w, b).requires_grad


@pytest.mark.parametrize("case", ["fp32", "fp16", "no-bias", "non-contiguous", "4-d", "1-d", "fp32-bias", "empty",
                                  "autocast"])
def test_other_calls_run_f_linear(case):
    x, w, b = _operands((6, 8, 32), 24)
    ctx = torch.autocast("cpu", dtype=BF16) if case == "autocast" else torch.no_grad()
    if case in ("fp32", "fp16"):
        dtype = torch.float32 if case == "fp32" else torch.float16
        x, w, b = (t.detach().to(dtype) for t in (x, w, b))
    elif case == "no-bias":
        b = None
    elif case == "non-contiguous":
        x = x.transpose(0, 1)
    elif case == "4-d":
        x = x.reshape(2, 3, 8, 32)
    elif case == "1-d":
        x = x[0, 0]
    elif case == "fp32-bias":
        b = b.detach().float()
    elif case == "empty":
        x = x[:0]
    with ctx:
        assert not lin.supports(x, w, b)
    if case == "fp32-bias":  # a mix F.linear refuses: its own error
        with pytest.raises(RuntimeError), torch.no_grad():
            F.linear(x, w, b)
        with pytest.raises(RuntimeError), torch.no_grad():
            lin.linear(x, w, b)
        return
    with ctx, OpNames() as ops:
        y = lin.linear(x, w, b)
    assert OURS not in ops.names
    with ctx:
        assert torch.equal(y, F.linear(x, w, b))


def test_small_outputs_run_f_linear(monkeypatch):
    monkeypatch.setattr(lin, "MIN_OUTPUT_ELEMENTS", 6 * 24 + 1)
    x, w, b = _operands((6, 32), 24)
    with OpNames() as ops:
        y = lin.linear(x, w, b)
    assert OURS not in ops.names and torch.equal(y, F.linear(x, w, b))


def test_bad_shapes_raise_f_linears_error():
    x, w, b = _operands((4, 32), 24)
    with pytest.raises(RuntimeError):
        lin.linear(torch.tensor(1.0, dtype=BF16), w, b)  # 0-d input
    with pytest.raises(RuntimeError):
        lin.linear(x, w[:, :16], b)
    with pytest.raises(RuntimeError):
        lin.linear(x, w, b[:5])


def test_a_failed_probe_leaves_f_linear(monkeypatch):
    monkeypatch.setattr(lin, "_probe", lambda: False)
    x, w, b = _operands((4, 32), 24)
    with OpNames() as ops:
        y = lin.linear(x, w, b)
    assert OURS not in ops.names and torch.equal(y, F.linear(x, w, b))


@available
def test_opcheck():
    x, w, b = _operands((2, 9, 48), 40)
    torch.library.opcheck(torch.ops.ipex_train.linear_bias.default, (x, w, b))


@available
def test_compiles_without_graph_breaks():
    x, w, b = _operands((2, 9, 48), 40)
    compiled = torch.compile(lambda x, w, b: torch.relu(lin.linear(x, w, b)), fullgraph=True, backend="aot_eager")
    y = compiled(x, w, b)
    y.float().sum().backward()
    ref = torch.relu(F.linear(x, w, b))
    assert torch.equal(y, ref)
