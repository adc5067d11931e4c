"""The native policy's patch embeddings: a Conv2d whose stride equals its kernel computed as one GEMM over the
unfolded patches (ipex_train/compute_policy/_patch_embed.py), against the convolution in fp32 and in bf16."""
import pickle

import pytest
import torch
import torch.nn.functional as F

import ipex_train
import ipex_train.compute_policy as cp
from ipex_train.compute_policy import _patch_embed

BF16 = torch.bfloat16


def _conv_ref(x, w, b):
    return F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride=tuple(w.shape[2:]))


@pytest.mark.parametrize("shape,kernel,bias", [
    ((2, 3, 32, 32), (16, 16), True),
    ((1, 3, 30, 45), (8, 8), True),        # rows and columns past the last whole patch: dropped, as the conv does
    ((3, 5, 12, 12), (4, 6), False),       # rectangular patches, no bias
    ((2, 4, 7, 7), (7, 7), True),          # one patch
])
def test_forward_and_grads_against_the_convolution(shape, kernel, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(BF16).requires_grad_()
    w = (torch.randn(24, shape[1], *kernel, generator=g) * 0.1).to(BF16).requires_grad_()
    b = torch.randn(24, generator=g).to(BF16).requires_grad_() if bias else None
    out = _patch_embed.patch_conv(x, w, b)
    conv = F.conv2d(x, w, b, stride=kernel)
    assert out.shape == conv.shape and out.dtype == BF16 and out.is_contiguous()
    grad = torch.randn(out.shape, generator=g).to(BF16)
    out.backward(grad)
    ours = [x.grad, w.grad] + ([b.grad] if bias else [])
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    br = b.detach().double().requires_grad_() if bias else None
    ref = _conv_ref(xr, wr, br)
    ref.backward(grad.double())
    refs = [xr.grad, wr.grad] + ([br.grad] if bias else [])
    # bf16 products with fp32 sums, rounded to bf16 once: 1% of the largest magnitude (bf16 is 0.4% per rounding).
    for got, want in [(out, ref)] + list(zip(ours, refs)):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-2 * want.abs().max().item(), err
    # Against torch's own bf16 convolution: the same to bf16 rounding.
    assert (out.float() - conv.float()).abs().max().item() <= 1e-2 * conv.float().abs().max().item()


def test_channels_last_input_gives_channels_last_output():
    x = torch.randn(2, 3, 16, 16).to(BF16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 3, 4, 4).to(BF16)
    out = _patch_embed.patch_conv(x, w, None)
    ref = F.conv2d(x, w, stride=4)
    assert out.is_contiguous(memory_format=torch.channels_last) == ref.is_contiguous(memory_format=torch.channels_last)
    assert (out.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item()


@pytest.mark.parametrize("conv,expected", [
    (torch.nn.Conv2d(3, 8, 16, stride=16), True),
    (torch.nn.Conv2d(3, 8, (4, 2), stride=(4, 2)), True),
    (torch.nn.Conv2d(3, 8, 3, stride=1), False),
    (torch.nn.Conv2d(3, 8, 1, stride=1), False),           # a 1x1 conv: no patches to unfold
    (torch.nn.Conv2d(3, 8, 4, stride=2), False),           # overlapping windows
    (torch.nn.Conv2d(3, 8, 4, stride=4, padding=1), False),
    (torch.nn.Conv2d(3, 8, 4, stride=4, dilation=2), False),
    (torch.nn.Conv2d(4, 8, 4, stride=4, groups=2), False),
    (torch.nn.Conv2d(3, 8, 4, stride=4, padding_mode="reflect"), False),
    (torch.nn.Conv1d(3, 8, 4, stride=4), False),
])
def test_which_convolutions_route(conv, expected):
    assert cp.routes_patch_embedding(conv) is expected


def test_other_inputs_take_the_class_forward():
    conv = torch.nn.Conv2d(3, 8, 4, stride=4).to(BF16)
    handle = _patch_embed.swap(conv)
    calls = []
    original = _patch_embed.patch_conv
    _patch_embed.patch_conv = lambda *a: calls.append(1) or original(*a)
    try:
        x = torch.randn(3, 16, 16).to(BF16)                   # unbatched: conv2d takes it, the GEMM does not
        assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, stride=4)) and not calls
        conv.float()
        x = torch.randn(1, 3, 16, 16)                          # fp32: the convolution
        assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, stride=4)) and not calls
        conv.to(BF16)
        conv(x.to(BF16))
        assert calls == [1]
    finally:
        _patch_embed.patch_conv = original
        handle.remove()
    assert "forward" not in vars(conv)


class _PatchNet(torch.nn.Module):
    """A ViT-style stem: patch embedding, flatten to tokens, a linear head."""

    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 32, 8, stride=8)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(tokens).mean(1))


def _train(model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_optimize_native_routes_and_trains_like_the_convolution():
    torch.manual_seed(0)
    model = _PatchNet()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    routed, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                      bf16_compute="native")
    assert "forward" in vars(routed.patch) and not cp.routes_patch_embedding(routed.patch)
    calls = []
    original = _patch_embed.patch_conv
    _patch_embed.patch_conv = lambda *a: calls.append(1) or original(*a)
    try:
        losses = _train(routed, opt)
    finally:
        _patch_embed.patch_conv = original
    assert calls == [1, 1, 1]
    # The same model with the route removed: the same losses to bf16 rounding.
    torch.manual_seed(0)
    plain = _PatchNet()
    plain.load_state_dict(state)
    plain, opt2 = ipex_train.optimize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), dtype=BF16,
                                      bf16_compute="native")
    del plain.patch.forward
    ref = _train(plain, opt2)
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 2e-2 * abs(b), (losses, ref)
    # Detach restores the class's forward; pickling the routed model works.
    copy = pickle.loads(pickle.dumps(routed))
    assert torch.isfinite(copy(torch.randn(1, 3, 32, 32)).float()).all()
    cp.attached(routed).remove()
    assert "forward" not in vars(routed.patch) and cp.routes_patch_embedding(routed.patch)


def test_emulated_policy_does_not_route():
    model = _PatchNet()
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16,
                                   bf16_compute="emulated")
    assert "forward" not in vars(model.patch)


def _vits():
    import torchvision

    transformers = pytest.importorskip("transformers")
    tv = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=32,
                                              mlp_dim=64, num_classes=10)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64,
        num_labels=10))
    return [("torchvision", tv, lambda m, x: m(x)), ("transformers", hf, lambda m, x: m(pixel_values=x).logits)]


def _steps(model, opt, call, x, y, steps=2):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(call(model, x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("index", [0, 1])
def test_library_vits_route_their_patch_embedding(index):
    # Models nobody here wrote: torchvision's VisionTransformer (conv_proj) and Hugging Face's ViT (projection).
    torch.manual_seed(0)
    name, model, call = _vits()[index]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = ipex_train.optimize(model.train(), torch.optim.SGD(model.parameters(), lr=0.05), dtype=BF16,
                                     bf16_compute="native")
    routed = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and "forward" in vars(m)]
    assert len(routed) == 1, name
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    emb, xb = routed[0], x.to(BF16)
    conv = F.conv2d(xb, emb.weight, emb.bias, stride=emb.stride)
    assert (emb(xb).float() - conv.float()).abs().max().item() <= 1e-2 * conv.float().abs().max().item(), name
    y = torch.tensor([1, 7])
    losses = _steps(model, opt, call, x, y)
    # The same model with only that route removed.
    _, plain, _ = _vits()[index]
    plain.load_state_dict(state)
    plain, opt2 = ipex_train.optimize(plain.train(), torch.optim.SGD(plain.parameters(), lr=0.05), dtype=BF16,
                                      bf16_compute="native")
    for m in plain.modules():
        if isinstance(m, torch.nn.Conv2d) and "forward" in vars(m):
            del m.forward
    ref = _steps(plain, opt2, call, x, y)
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 2e-2 * abs(b), (name, losses, ref)
