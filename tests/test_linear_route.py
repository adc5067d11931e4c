"""The native compute policy's routing of nn.Linear modules with a bias (and of the linears other routes compute
themselves) to ipex_train.linear. The op is F.linear bit for bit, so a routed model trains exactly as the same model
with the route switched off: the same losses and parameters (torch.equal), on a Hugging Face BERT (its own routes on)
and on torchvision's ViT (its MultiheadAttention and patch-embedding routes call the op for their projections)."""
import copy

import pytest
import torch
from op_names import OpNames
from route_checks import detach_restores_and_attach_again, emulated_does_not_route, native, optimized, train

import ipex_train.compute_policy as cp
import ipex_train.linear as lin
from ipex_train.compute_policy import _linear

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    # Small models: the route otherwise takes layers of 512 features or more only, and linear() leaves outputs under
    # MIN_OUTPUT_ELEMENTS to F.linear.
    monkeypatch.setattr(lin, "MIN_OUTPUT_ELEMENTS", 0)
    monkeypatch.setattr(_linear, "MIN_OUT_FEATURES", 0)
OURS = "ipex_train.linear_bias"
LAYERS = 2
pytestmark = pytest.mark.skipif(not lin._probe(), reason="ipex_train.linear is F.linear here (no oneDNN bf16 linear "
                                "with a bias epilogue, or one that differs from F.linear)")


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config).train()


def _vit():
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=32, patch_size=8, num_layers=LAYERS, num_heads=4, hidden_dim=64, mlp_dim=128,
                             num_classes=5).train()


IDS = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
IMAGES = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _bert_loss(model):
    return model(input_ids=IDS, labels=torch.tensor([0, 1])).loss


def _vit_loss(model):
    return model(IMAGES).float().pow(2).mean()


def _biased_linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]


@native
@pytest.mark.parametrize("build,loss_fn", [(_bert, _bert_loss), (_vit, _vit_loss)], ids=["bert", "vit"])
def test_routed_trains_exactly_as_unrouted(build, loss_fn, monkeypatch):
    base = build()
    ref_base = copy.deepcopy(base)
    model, opt = optimized(base)
    assert cp.routed_modules(model).get("linear") == sum(type(m).forward is torch.nn.Linear.forward
                                                         for m in _biased_linears(model))
    with OpNames() as ops:
        routed = train(model, opt, loss_fn, 1)
    assert OURS in ops.names
    routed += train(model, opt, loss_fn, 2)

    monkeypatch.setattr(lin, "_probe", lambda: False)  # every F.linear again, the other routes unchanged
    ref_model, ref_opt = optimized(ref_base)
    with OpNames() as ops:
        unrouted = train(ref_model, ref_opt, loss_fn, 3)
    assert OURS not in ops.names
    assert routed == unrouted
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name


@native
def test_hooks_on_a_routed_linear_still_run():
    model, _ = optimized(_bert())
    layer = model.bert.encoder.layer[0].attention.self.query
    assert "forward" in vars(layer)
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.no_grad():
        model(input_ids=IDS)
    assert seen == [BF16]


def test_which_modules_route(monkeypatch):
    monkeypatch.setattr(_linear, "MIN_OUT_FEATURES", 512)
    assert _linear.routable(torch.nn.Linear(4, 512))
    assert not _linear.routable(torch.nn.Linear(4, 511))  # narrow layers: the call would only cost
    assert not _linear.routable(torch.nn.Linear(4, 512, bias=False))
    assert _linear.routable(torch.nn.modules.linear.NonDynamicallyQuantizableLinear(4, 512))
    monkeypatch.setattr(_linear, "MIN_OUT_FEATURES", 0)

    class Custom(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    assert not _linear.routable(Custom(4, 3))
    swapped = torch.nn.Linear(4, 3)
    swapped.forward = lambda x: x
    assert not _linear.routable(swapped)


@native
def test_detach_restores_and_pickled_copy_runs():
    model, _ = optimized(_bert())
    modules = [m for m in _biased_linears(model) if "forward" in vars(m)]
    detach_restores_and_attach_again(model, modules, cp.routes_linear, OURS,
                                     lambda m: m(input_ids=IDS).logits)


@native
def test_attach_runs_the_probe_before_any_forward():
    lin._probe.cache_clear()
    try:
        cp.attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), "native")
        assert lin._probe.cache_info().currsize == 1  # its ops never land inside a model's forward
    finally:
        lin._probe()


def test_emulated_policy_does_not_route():
    emulated_does_not_route(_bert(), _biased_linears, lambda m, opt: train(m, opt, _bert_loss, 1), OURS)
