"""Which weights optimize(dtype=bf16) converts, and that every model still runs with the rest left fp32:
nn.MultiheadAttention (packed and separate projections, TransformerEncoder in train and eval), transformers'
Conv1D (GPT-2), and modules that keep bare fp32 weight matrices. Each against fp32 training on the same data."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ipex_train
from ipex_train import compute_policy
from ipex_train.precision.casts import upcast_inputs

BF16 = torch.bfloat16


def train_pair(make, inputs, targets, steps=3, loss=None, dtype=BF16):
    """Losses and final fp32 state_dicts of (plain fp32 AdamW, optimize(dtype) AdamW) on the same batches; the
    reference model carries its initial state_dict as ``ref.initial``."""
    loss = loss or (lambda out, y: F.cross_entropy(out.float().flatten(0, -2), y.flatten()))
    torch.manual_seed(0)
    ref = make().train()
    model = copy.deepcopy(ref)
    ref.initial = copy.deepcopy(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dtype=dtype)
    losses = ([], [])
    for _ in range(steps):
        for i, (m, o) in enumerate(((ref, ref_opt), (model, opt))):
            o.zero_grad()
            value = loss(m(*inputs), targets)
            value.backward()
            o.step()
            losses[i].append(value.item())
    return losses, ref, model


def assert_tracks_fp32(losses, ref, model, tol=0.02):
    """bf16 training follows fp32 training: losses and weights within ``tol``, and the updates themselves (final
    minus initial weights, which the weight comparison alone cannot see at this lr) agree: over all parameters
    within 20% of the fp32 update's norm, each tensor within 75% (an attention key bias has no gradient in exact
    arithmetic, so its bf16 update is mostly rounding noise; a tensor left unstepped is off by 100%)."""
    assert losses[1] == pytest.approx(losses[0], rel=tol)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k  # state_dict keeps the fp32 truth
        torch.testing.assert_close(got[k], want[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")
    params = dict(ref.named_parameters())
    errors, sizes = [], []
    for k in params:
        update, want_update = got[k] - ref.initial[k], want[k] - ref.initial[k]
        assert want_update.abs().mean() > 1e-4, f"{k}: the fp32 reference did not move"
        errors.append((update - want_update).norm())
        sizes.append(want_update.norm())
        assert errors[-1] < 0.75 * sizes[-1], f"{k}: update off by {errors[-1] / sizes[-1]:.0%} of fp32's"
    total = torch.stack(errors).norm() / torch.stack(sizes).norm()
    assert total < 0.2, f"updates off by {total:.0%} of fp32's"


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x, mask=None, padding=None):
        return self.head(self.encoder(x, mask=mask, src_key_padding_mask=padding))


def encoder_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 6, 16, generator=g), torch.randint(0, 5, (3, 6), generator=g)


def test_multihead_attention_goes_bf16_and_trains_like_fp32():
    x, y = encoder_data()
    mask = nn.Transformer.generate_square_subsequent_mask(6)  # an fp32 additive mask, as users build it
    losses, ref, model = train_pair(Encoder, (x, mask), y)
    assert {n: p.dtype for n, p in model.named_parameters() if p.dtype != BF16} == {
        n: torch.float32 for n, _ in model.named_parameters() if ".norm" in n}
    assert_tracks_fp32(losses, ref, model)


@pytest.mark.parametrize("grad", [False, True])
def test_transformer_encoder_eval_matches_fp32(grad, bf16_activations):
    # Eval under no_grad is where nn.TransformerEncoderLayer would take its fused fast path.
    x, _ = encoder_data()
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 4:] = True
    torch.manual_seed(0)
    ref = Encoder()
    model, _ = ipex_train.optimize(ref, torch.optim.SGD(ref.parameters(), lr=0.1), dtype=BF16)
    # Same (bf16-rounded) weights on both sides, so the comparison sees activations, not weight rounding.
    ref.load_state_dict({k: v.to(BF16).float() for k, v in ref.state_dict().items()})
    model.load_state_dict(ref.state_dict())
    ref.eval()
    model.eval()
    with torch.set_grad_enabled(grad):
        got, want = model(x, padding=padding), ref(x, padding=padding)
    assert got.dtype == bf16_activations
    keep = ~padding
    torch.testing.assert_close(got.float()[keep], want[keep], atol=0.05, rtol=0.05)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with kdim/vdim != embed_dim: separate q/k/v projection weights, bias_k/bias_v."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, kdim=8, vdim=12, add_bias_kv=True, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, q, k, v):
        return self.head(self.attn(q, k, v, need_weights=False)[0])


def test_multihead_attention_with_separate_projections():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 4, 16, generator=g), torch.randn(3, 7, 8, generator=g), torch.randn(3, 7, 12, generator=g)
    y = torch.randint(0, 5, (3, 4), generator=g)
    losses, ref, model = train_pair(CrossAttention, (q, k, v), y)
    attn = model.attn
    assert attn.in_proj_weight is None
    for p in (attn.q_proj_weight, attn.k_proj_weight, attn.v_proj_weight, attn.bias_k, attn.bias_v,
              attn.in_proj_bias, attn.out_proj.weight):
        assert p.dtype == BF16
    assert_tracks_fp32(losses, ref, model)


def test_mha_converts_all_or_nothing():
    # out_proj's weight tied to an fp32-only owner keeps the whole attention fp32 (its forward uses both).
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.scale = nn.Module()
            self.scale.weight = self.attn.out_proj.weight  # an owner that is no matmul module
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(self.attn(x, x, x)[0])

    torch.manual_seed(0)
    model = Tied()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
    assert {p.dtype for p in model.attn.parameters()} == {torch.float32}
    assert model.lin.weight.dtype == BF16
    model(torch.randn(2, 3, 8)).float().sum().backward()
    opt.step()


class BareLayer(nn.Module):
    """A custom layer with bare fp32 Parameters (a weight matrix and a scale vector) and its own matmul."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.tanh(x @ self.weight) * self.scale


def bare_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), BareLayer(), nn.Linear(8, 5))


def nested_bare_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.LayerNorm(8), BareLayer()), nn.ReLU(), nn.Linear(8, 5))


@pytest.mark.parametrize("make", [bare_model, nested_bare_model], ids=["flat", "nested"])
def test_bare_fp32_weights_take_bf16_activations(make):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 5, (4,), generator=g)
    losses, ref, model = train_pair(make, (x,), y)
    bare = next(m for m in model.modules() if isinstance(m, BareLayer))
    assert bare.weight.dtype == torch.float32 and bare.weight.grad.dtype == torch.float32
    # Only the module with the weight matrix casts up; the LayerNorm (fp32 vectors) takes bf16 as it is.
    assert [m for m in model.modules() if upcast_inputs in m._forward_pre_hooks.values()] == [bare]
    assert model[0].weight.dtype == BF16
    assert_tracks_fp32(losses, ref, model)


def test_inference_bf16_with_bare_fp32_weights():
    ref = bare_model().eval()
    model = ipex_train.optimize(ref, dtype=BF16)
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(x).float(), ref(x), atol=0.05, rtol=0.05)


def test_fp32_optimize_adds_no_input_casts():
    model = bare_model()
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float32)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_library_classes_are_matched_by_name(bf16_activations):
    # transformers' Conv1D is recognised by its module and name (so transformers is never imported for it), also
    # through a subclass.
    class Conv1D(nn.Module):
        def __init__(self, nx, nf):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    Conv1D.__module__, Conv1D.__qualname__ = "transformers.pytorch_utils", "Conv1D"

    class Mine(Conv1D):
        pass

    model = nn.Sequential(Conv1D(6, 4), nn.ReLU(), Mine(4, 3))
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
    assert {p.dtype for p in model.parameters()} == {BF16}
    assert model(torch.randn(2, 6)).dtype == bf16_activations


def test_gpt2_trains_in_bf16_like_fp32():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, embd_pdrop=0.0,
                                     resid_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))

    def make():
        return transformers.GPT2LMHeadModel(config)

    losses, ref, model = train_pair(make, (ids,), ids, loss=lambda out, y: F.cross_entropy(
        out.logits[:, :-1].float().flatten(0, 1), y[:, 1:].flatten()))
    conv1d = [m for m in model.modules() if type(m).__name__ == "Conv1D"]
    assert conv1d and all(m.weight.dtype == BF16 and m.bias.dtype == BF16 for m in conv1d)
    assert {n for n, p in model.named_parameters() if p.dtype != BF16} == {
        n for n, _ in model.named_parameters() if ".ln_" in n}
    assert_tracks_fp32(losses, ref, model)

    # Conv1D's bf16 addmm, forward and backward, is computed in fp32 by the emulated policy: no bf16 matmul kernel.
    from benchmarks.standalone.coverage import MatmulFlops

    compute_policy.attach(model, "emulated")
    with MatmulFlops() as counted:
        model(ids).logits.float().sum().backward()
    assert counted.flops["other"] > 0 and counted.flops["bf16"] == 0


def test_coverage_audit_counts_bf16_matmul_flops():
    from benchmarks.standalone.coverage import audit

    encoder = audit("encoder", Encoder, lambda: (encoder_data()[0],), lambda out: out.flatten(0, 1))
    assert encoder["trains"] and encoder["matmul_flops_bf16_share"] == 1.0
    assert set(encoder["left_fp32"]) == {"LayerNorm.weight", "LayerNorm.bias"}
    bare = audit("bare", bare_model, lambda: (torch.randn(4, 6),), lambda out: out)
    assert 0.0 < bare["matmul_flops_bf16_share"] < 1.0  # BareLayer's own matmul runs in fp32
    assert bare["left_fp32"]["BareLayer.weight"]["reason"].startswith("bare parameter")
