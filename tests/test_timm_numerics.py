"""A timm model trained through optimize(): fp32 against plain torch, bf16 against the plain-torch emulation of
bf16 training (tests/bf16_reference.py). Built from its config (pretrained=False), nothing downloaded.

A ViT shrunk to run in seconds (2 blocks of width 48 on 32x32 images in 8x8 patches), without qkv biases: the key
bias gets no gradient in exact arithmetic, so Adam turns its rounding-noise gradient into full-size steps of
arbitrary sign, which no tolerance below the lr could compare."""
import copy

import pytest
import torch
from bf16_reference import Bf16Emulation, assert_moved
from torch import nn

import ipex_train
from ipex_train import compute_policy

timm = pytest.importorskip("timm")

FP32_TOL = 1e-5  # measured 1.5e-8
BF16_TOL = 2e-5  # measured 7.5e-9 (native), 4.1e-6 (emulated policy)


def make():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             embed_dim=48, num_heads=3, mlp_ratio=2.0, qkv_bias=False, num_classes=5).train()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(3)]


def train(model, opt):
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()


def assert_matches(got, want, initial, tol):
    assert got.keys() == want.keys()
    assert_moved(want, initial, tol)
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_vit_adamw_matches_plain_torch(dtype):
    initial = dict(make().named_parameters())
    model = make()
    if dtype is None:
        ref = copy.deepcopy(model)
        ref_opt = adamw(ref.parameters())
        train(ref, ref_opt)
        want, tol = ref.state_dict(), FP32_TOL
    else:
        emulation = Bf16Emulation(model, adamw, compute_policy.resolve())
        train(emulation.model, emulation)
        want, tol = emulation.state_dict(), BF16_TOL
    model, opt = ipex_train.optimize(model, adamw(model.parameters()), dtype=dtype)
    if dtype is not None:
        assert model.blocks[0].attn.qkv.weight.dtype == dtype and model.pos_embed.dtype == torch.float32
    train(model, opt)
    assert_matches(model.state_dict(), want, initial, tol)
