"""The native policy's one exception: depthwise convs whose bf16 backward oneDNN runs slowly are computed in fp32.

Tolerance against an fp32 computation on the same bf16 values: both compute in fp32 and the policy rounds each
result to bf16 once, so they differ by at most one bf16 rounding (relative 2**-9) plus summation-order noise:
rtol 2**-8, atol 1e-5 * max|reference|.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ipex_train
import ipex_train.compute_policy as cp

BF16 = torch.bfloat16
A = torch.ops.aten


class ConvDtypes(TorchDispatchMode):
    """Records (op, weight shape, dtype of the weight operand) for each convolution forward/backward."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Under inference_mode the dispatcher sees conv2d itself, not its decomposition into convolution.
        if func.overloadpacket in (A.convolution, A.conv2d, A.convolution_backward):
            w = args[2] if func.overloadpacket is A.convolution_backward else args[1]
            self.calls.append((func.overloadpacket, tuple(w.shape), w.dtype))
        return func(*args, **(kwargs or {}))


def _net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),                        # dense: bf16
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8),    # depthwise stride 2: fp32
        nn.Conv2d(8, 8, 5, padding=2, groups=8),              # depthwise 5x5: fp32
        nn.Conv2d(8, 8, 3, padding=1, groups=8),              # depthwise 3x3 stride 1: bf16
        nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=4),   # grouped, not depthwise: bf16
    )


def test_rule_picks_strided_and_large_depthwise_conv2d_only():
    picked = [cp.slow_bf16_depthwise(m) for m in _net()]
    assert picked == [False, True, True, False, False]
    assert not cp.slow_bf16_depthwise(nn.Conv1d(8, 8, 5, groups=8))  # measured for Conv2d only
    assert not cp.slow_bf16_depthwise(nn.Linear(4, 4))


def test_native_computes_slow_depthwise_convs_in_fp32_and_the_rest_in_bf16():
    torch.manual_seed(0)
    model = _net().to(BF16)
    handle = cp.attach(model, "native")
    assert handle.active and len(handle._hooks) == 4  # enter + leave on the two picked convs
    x = torch.randn(2, 3, 12, 12).to(BF16).requires_grad_()
    with ConvDtypes() as seen:
        out = model(x)
        out.float().square().sum().backward()
    assert out.dtype == BF16 and all(p.grad.dtype == BF16 for p in model.parameters())
    by_weight = {}
    for op, shape, dtype in seen.calls:
        by_weight.setdefault(shape, set()).add((op, dtype))
    f32 = {(A.convolution, torch.float32), (A.convolution_backward, torch.float32)}
    b16 = {(A.convolution, BF16), (A.convolution_backward, BF16)}
    assert by_weight[(8, 1, 3, 3)] == f32 | b16  # the stride-2 one fp32, the stride-1 one bf16 (same shape)
    assert by_weight[(8, 1, 5, 5)] == f32
    assert by_weight[(8, 3, 3, 3)] == b16 and by_weight[(16, 2, 3, 3)] == b16

    # The fp32-computed layer against fp32 math on the same bf16 values, forward and backward.
    layer = model[1]
    layer.zero_grad(set_to_none=True)
    h = torch.randn(2, 8, 12, 12).to(BF16).requires_grad_()
    y = layer(h)
    g = torch.randn_like(y)
    y.backward(g)
    h32 = h.detach().float().requires_grad_()
    w32, b32 = (t.detach().float().requires_grad_() for t in (layer.weight, layer.bias))
    ref = F.conv2d(h32, w32, b32, 2, 1, 1, 8)
    ref.backward(g.float())
    for got, want in ((y, ref), (h.grad, h32.grad), (layer.weight.grad, w32.grad)):
        torch.testing.assert_close(got.float(), want.detach(), rtol=2**-8, atol=1e-5 * want.abs().max().item())


def test_native_policy_without_such_convs_registers_nothing():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=8)).to(BF16)
    handle = cp.attach(model, "native")
    assert not handle.active and not any(m._forward_pre_hooks for m in model.modules())


def test_summary_counts_the_fp32_depthwise_convs():
    model = _net()
    model, optimizer = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                           bf16_compute="native")
    info = ipex_train.summary(model, optimizer)
    assert info.fp32_compute_convs == 2
    assert "compute policy native (2 depthwise convs computed in fp32" in str(info)
    model = _net()
    model, optimizer = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                           bf16_compute="emulated")
    assert ipex_train.summary(model, optimizer).fp32_compute_convs == 0


def test_without_grad_the_depthwise_convs_stay_bf16():
    # The rule is about slow bf16 backward kernels: a forward without grad keeps bf16 (its faster forward).
    model = _net().to(BF16)
    cp.attach(model, "native")
    x = torch.randn(2, 3, 12, 12).to(BF16)
    for scope in (torch.no_grad, torch.inference_mode):
        with scope(), ConvDtypes() as seen:
            model(x)
        assert {dtype for _, _, dtype in seen.calls} == {BF16}
        assert torch._C._len_torch_function_stack() == 0
