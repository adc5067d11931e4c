"""optimize(dtype=bf16) under the emulated compute policy: activations stay fp32, and the only bf16<->fp32 casts of a
train step are each converted parameter's (its fp32 copy in forward, again for backward, its grad back to bf16),
with no bf16 matmul or convolution kernel, and autograd keeps no fp32 copy of a weight from forward to backward.
The policy is forced, so these run the same on CPUs with and without bf16 units.

Tolerance: with fp32 activations the forward is an fp32 computation on the bf16-rounded weights, so it matches an fp32
model holding those rounded weights up to summation order (rtol 1e-5); weight grads are rounded to bf16 once (rtol
2**-8, as in test_compute_policy).
"""
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ipex_train
from ipex_train import compute_policy

BF16 = torch.bfloat16
A = torch.ops.aten
HEAVY = {A.mm, A.addmm, A.bmm, A.convolution, A.convolution_backward, A.mkldnn_rnn_layer,
         A.mkldnn_rnn_layer_backward}


class Casts(TorchDispatchMode):
    """Records every bf16<->fp32 conversion (its shape) and every heavy kernel that gets a bf16 operand."""

    def __init__(self):
        super().__init__()
        self.casts, self.heavy, self.bf16_heavy = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in (A._to_copy, A.copy_) and isinstance(out, torch.Tensor):
            source = args[1] if func.overloadpacket is A.copy_ else args[0]
            if {source.dtype, out.dtype} == {BF16, torch.float32}:
                self.casts.append(tuple(out.shape))
        if func.overloadpacket in HEAVY:
            self.heavy.append(func)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            if any(t.dtype == BF16 for t in tensors):
                self.bf16_heavy.append(func)
        return out


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.conv2(F.relu(self.bn(self.conv1(x)))).flatten(1))


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids):
        return self.head(self.norm(self.rnn(self.emb(ids))[0])).mean(1)


CASES = {
    "conv": (ConvNet, lambda g: torch.randn(4, 3, 8, 8, generator=g)),
    "tokens": (TokenNet, lambda g: torch.randint(0, 20, (4, 6), generator=g)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_activations_stay_fp32_and_only_parameters_are_cast(name):
    make, data = CASES[name]
    g = torch.Generator().manual_seed(1)
    x, y = data(g), torch.randint(0, 5, (4,), generator=g)
    torch.manual_seed(0)
    model = make()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                     bf16_compute="emulated")
    converted = [p for p in model.parameters() if p.dtype == BF16]
    assert converted
    seen = []
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            m.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))

    for _ in range(2):  # the second step runs on stepped weights
        with Casts() as casts:
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        assert out.dtype == torch.float32 and seen and set(seen) == {torch.float32}
        assert casts.bf16_heavy == []
        if name == "conv":
            # One cast up per parameter in forward and one of its grad down in backward; backward casts each
            # weight up once more instead of autograd keeping its fp32 copy (biases are not saved).
            weights = [tuple(p.shape) for p in converted if p.dim() > 1]
            assert sorted(casts.casts) == sorted([tuple(p.shape) for p in converted] * 2 + weights)
        else:
            # An embedding table is never cast (only its looked-up rows are read: the lookup is cast up). nn.LSTM
            # refuses inputs of another dtype than its weights, so around it activations are cast down and up.
            assert tuple(model.emb.weight.shape) not in casts.casts
        assert all(p.grad is None or p.grad.dtype == p.dtype for p in model.parameters())


def emulated_and_reference(model: nn.Module):
    """``model`` under optimize(bf16) with the emulated policy, and an fp32 copy holding its bf16-rounded weights
    (the fp32 computation the policy must equal)."""
    reference = copy.deepcopy(model)
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                   bf16_compute="emulated")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(model.get_parameter(name).float())
    return model, reference


def test_forward_is_fp32_on_the_rounded_weights():
    torch.manual_seed(0)
    model, ref = emulated_and_reference(ConvNet())
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    for name, p in ref.named_parameters():
        got = model.get_parameter(name).grad
        atol = 1e-5 * float(p.grad.abs().max())
        torch.testing.assert_close(got.float(), p.grad, rtol=2**-8 if got.dtype == BF16 else 1e-5, atol=atol)


MIXED = {
    "linear": (lambda x, w, b: F.linear(x, w, b), [(2, 5, 16), (24, 16), (24,)]),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), [(2, 4, 9, 9), (6, 4, 3, 3), (6,)]),
    "matmul": (torch.matmul, [(3, 4, 8), (8, 5)]),
    "lstm": (lambda x, *w: torch.lstm(x, (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)), w, True, 1, 0.0, True, False,
                                      True)[0], [(2, 4, 6), (12, 6), (12, 3), (12,), (12,)]),
}


@pytest.mark.parametrize("name", sorted(MIXED))
def test_fp32_activations_with_bf16_weights_compute_in_fp32(name):
    # What optimize() runs under the emulated policy: fp32 activations, bf16-stored weights. Torch refuses the mix;
    # the policy computes it in fp32 (exact on the bf16 weight values), returns fp32 and gives each input its own
    # dtype's grad, with no bf16 kernel and no bf16 rounding of the activations.
    fn, shapes = MIXED[name]
    torch.manual_seed(0)
    x = torch.randn(shapes[0], requires_grad=True)
    weights = [torch.randn(s).to(BF16).requires_grad_() for s in shapes[1:]]
    with pytest.raises(RuntimeError):
        fn(x, *weights)
    with Casts() as casts:
        with compute_policy.emulated_bf16():
            out = fn(x, *weights)
        out.backward(torch.ones_like(out))
    assert casts.heavy and casts.bf16_heavy == []
    assert out.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert all(w.grad.dtype == BF16 for w in weights)

    reference_weights = [w.detach().float().requires_grad_() for w in weights]
    x_ref = x.detach().requires_grad_()
    reference = fn(x_ref, *reference_weights)
    reference.backward(torch.ones_like(reference))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for w, r in zip(weights, reference_weights):  # one bf16 rounding of the fp32 grad
        torch.testing.assert_close(w.grad.float(), r.grad, rtol=2**-8, atol=1e-5 * float(r.grad.abs().max()))


class WeightCopies(TorchDispatchMode):
    """Weak references to every fp32 copy made of a bf16 tensor of one of ``shapes``."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.copies = set(shapes), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func.overloadpacket is A._to_copy and args[0].dtype == BF16 and out.dtype == torch.float32
                and tuple(out.shape) in self.shapes):
            self.copies.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("name", ["conv", "transformer"])
def test_fp32_weight_copies_are_not_kept_for_backward(name):
    # Autograd would keep each weight's fp32 copy from forward to backward: 4 bytes per parameter on top of the
    # bf16 weights and their fp32 truth, above fp32 training's peak. The policy saves the bf16 weight instead.
    torch.manual_seed(0)
    if name == "conv":
        model, x = ConvNet(), torch.randn(4, 3, 8, 8)
    else:
        model, x = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), torch.randn(2, 5, 16)
    model, reference = emulated_and_reference(model)
    # A fixed random projection of the output, not its mean square: after the encoder's final LayerNorm the mean
    # square is nearly constant, so every grad above it would be fp32 cancellation noise (~1e-7 here), and
    # comparing noise checks the summation order, not the math.
    projection = torch.randn(model(x).shape)
    with WeightCopies(tuple(p.shape) for p in model.parameters() if p.dtype == BF16) as mode:
        loss = (model(x) * projection).sum()
    assert mode.copies
    gc.collect()
    assert [r for r in mode.copies if r() is not None] == []
    loss.backward()
    (reference(x) * projection).sum().backward()
    for n, p in reference.named_parameters():
        got = model.get_parameter(n).grad.float()
        torch.testing.assert_close(got, p.grad, rtol=2**-8, atol=1e-5 * float(p.grad.abs().max()))


def test_weight_written_between_forward_and_backward_is_an_error():
    # As autograd says for any saved tensor modified in place; the fp32 copy it no longer keeps would hide it.
    torch.manual_seed(0)
    model = ConvNet()
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                   bf16_compute="emulated")
    loss = model(torch.randn(2, 3, 8, 8)).sum()
    with torch.no_grad():
        next(p for p in model.parameters() if p.dim() > 1).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_activation_checkpointing_keeps_its_own_saving():
    # Under torch.utils.checkpoint (its own saved-tensor hooks) the policy leaves saving to it: same grads.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = ConvNet()
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                   bf16_compute="emulated")
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    checkpoint(model, x, use_reentrant=False).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n])


class LargeNet(nn.Module):
    # Weights above _saved's scratch threshold (64K elements): their casts go through the reused buffers.
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 128, 3)
        self.fc = nn.Linear(128 * 4 * 4, 64)
        self.proj = nn.Linear(256, 512)

    def forward(self, x, tokens):
        return self.fc(F.relu(self.conv(x)).flatten(1)).sum() + self.proj(tokens).square().mean()


def test_large_weight_casts_through_scratch_buffers_match_fp32():
    from ipex_train.compute_policy import _saved

    torch.manual_seed(0)
    model, reference = emulated_and_reference(LargeNet())
    x, tokens = torch.randn(2, 64, 6, 6), torch.randn(2, 3, 256)
    for _ in range(2):  # the second pass reuses the buffers the first one filled; grads accumulate
        with WeightCopies(tuple(p.shape) for p in model.parameters() if p.dtype == BF16) as mode:
            loss = model(x, tokens)
        gc.collect()
        assert mode.copies == [] or all(r() is None for r in mode.copies)
        loss.backward()
        reference(x, tokens).backward()
    assert _saved._scratch.buffer.numel() >= 128 * 64 * 9  # forward casts and backward recasts went through it
    for n, p in reference.named_parameters():
        got = model.get_parameter(n).grad.float()
        torch.testing.assert_close(got, p.grad, rtol=2**-7, atol=1e-5 * float(p.grad.abs().max()))


def _linear_reference(x, w, b, g, create_graph=False):
    """fp32 F.linear on the bf16 values: output and grads of (x, w, b) against the upstream grad ``g``."""
    x = x.detach().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    b32 = None if b is None else b.detach().float().requires_grad_()
    y = F.linear(x, w32, b32)
    grads = torch.autograd.grad(y, [t for t in (x, w32, b32) if t is not None], g, create_graph=create_graph)
    return y, grads


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "permuted_4d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("size", ["small", "scratch"])  # below / above the 64K-element scratch threshold
def test_weight_linear_is_one_node_with_fp32_math(layout, bias, size):
    # F.linear of fp32 activations on a bf16 weight (every nn.Linear under optimize()) runs as one C++ autograd node
    # (ipex_train::emulated_linear): forward and input grad are fp32 math on the bf16 weight values (summation order
    # aside), the weight and bias grads that math rounded to bf16 once.
    torch.manual_seed(0)
    k, n = (24, 40) if size == "small" else (256, 384)
    base = torch.randn(3, 6, 5, k)
    x = {"contiguous": base, "transposed": base[0].transpose(0, 1),
         "permuted_4d": base.permute(1, 0, 2, 3)}[layout].requires_grad_()
    w = torch.randn(n, k).to(BF16).requires_grad_()
    b = torch.randn(n).to(BF16).requires_grad_() if bias else None
    with compute_policy.emulated_bf16():
        y = F.linear(x, w, b)
    assert "EmulatedLinear" in y.grad_fn.name() and y.dtype == torch.float32
    g = torch.randn(y.shape)
    y.backward(g)
    ref_y, ref_grads = _linear_reference(x, w, b, g)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_grads[0], rtol=1e-5, atol=1e-5)
    for p, ref in zip([w] + ([b] if bias else []), ref_grads[1:]):
        assert p.grad.dtype == BF16
        torch.testing.assert_close(p.grad.float(), ref, rtol=2**-8, atol=1e-5 * float(ref.abs().max()))


def test_weight_linear_scratch_is_recast_per_node():
    # Two layers share this thread's scratch buffer: the second one's cast overwrites the first one's between the
    # first forward and its backward, so each backward must cast its own weight again.
    torch.manual_seed(0)
    x = torch.randn(8, 300, requires_grad=True)
    w1, w2 = (torch.randn(300, 300).to(BF16).requires_grad_() for _ in range(2))
    with compute_policy.emulated_bf16():
        y = F.linear(F.linear(x, w1).relu(), w2)
    y.sum().backward()
    x_ref = x.detach().requires_grad_()
    v1, v2 = (w.detach().float().requires_grad_() for w in (w1, w2))
    F.linear(F.linear(x_ref, v1).relu(), v2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for w, v in ((w1, v1), (w2, v2)):
        torch.testing.assert_close(w.grad.float(), v.grad, rtol=2**-8, atol=1e-5 * float(v.grad.abs().max()))


def test_weight_linear_double_backward_and_no_grad():
    # create_graph (a gradient penalty) differentiates through the node's backward; under no_grad it is a plain
    # fp32 forward.
    torch.manual_seed(0)
    x = torch.randn(4, 300, requires_grad=True)
    w = torch.randn(500, 300).to(BF16).requires_grad_()
    with compute_policy.emulated_bf16():
        y = F.linear(x, w).tanh()
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    gx.square().sum().backward()
    x_ref = x.detach().requires_grad_()
    w_ref = w.detach().float().requires_grad_()
    (gx_ref,) = torch.autograd.grad(F.linear(x_ref, w_ref).tanh().sum(), x_ref, create_graph=True)
    gx_ref.square().sum().backward()
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    # w's grad arrives by two paths (through the input grad's weight and through tanh'), each rounded to bf16 and
    # summed in bf16 where they nearly cancel: bounded by a few bf16 steps of the largest grad.
    torch.testing.assert_close(w.grad.float(), w_ref.grad, rtol=2**-8, atol=2**-7 * float(w_ref.grad.abs().max()))
    with torch.no_grad(), compute_policy.emulated_bf16():
        out = F.linear(x, w)
    assert out.grad_fn is None and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def test_weight_linear_written_between_forward_and_backward_is_an_error():
    w = torch.randn(8, 4).to(BF16).requires_grad_()
    with compute_policy.emulated_bf16():
        y = F.linear(torch.randn(2, 4), w)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_weight_linear_backward_on_another_thread():
    # The node casts into the forward thread's scratch buffer; a backward run on another thread casts afresh
    # (that buffer may be in use by the forward thread meanwhile) and gives the same grads.
    import threading

    torch.manual_seed(0)
    x = torch.randn(8, 300, requires_grad=True)
    w = torch.randn(300, 300).to(BF16).requires_grad_()
    with compute_policy.emulated_bf16():
        y = F.linear(x, w)
    y.sum().backward(retain_graph=True)
    same_thread = w.grad.clone()
    w.grad = None
    worker = threading.Thread(target=lambda: y.sum().backward())
    worker.start()
    worker.join()
    torch.testing.assert_close(w.grad, same_thread, rtol=0, atol=0)
