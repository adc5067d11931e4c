"""IPEX's graph-optimization flow after optimize(): the user's own torch.jit.trace + torch.jit.freeze fuse into oneDNN
Graph groups, and ipex_train.enable_onednn_fusion(False) / IPEX_TRAIN_ONEDNN_FUSION=0 turn that off."""
import logging
import warnings

import pytest
import torch
import torchvision
from torch import nn

import ipex_train
from ipex_train.inference import jit

GROUP = "prim::oneDNNFusionGroup"


@pytest.fixture(autouse=True)
def fresh_switches(monkeypatch):
    """Each test starts as a new process would: no enable_onednn_fusion() call, no env var, torch's switch off;
    torch's switch is put back afterwards."""
    before = torch.jit.onednn_fusion_enabled()
    monkeypatch.delenv(jit.FUSION_ENV, raising=False)
    monkeypatch.setattr(jit, "_choice", None)
    torch.jit.enable_onednn_fusion(False)
    yield
    torch.jit.enable_onednn_fusion(before)


def _conv_bn_relu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.eval(), torch.randn(2, 3, 16, 16)


def _resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval(), torch.randn(1, 3, 32, 32)


def _seed_flow(model, x):
    """Seed 000 as a user writes it (trace, freeze, graph_for), with the call that TorchScript's profiling executor
    needs before it optimises: groups are formed on the second run at a shape."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
        traced = torch.jit.trace(model, x, check_trace=False).eval()
        frozen = torch.jit.freeze(traced)
        frozen(x)
        graph = str(frozen.graph_for(x))
        return frozen, graph


@pytest.mark.parametrize("make", [_conv_bn_relu, _resnet], ids=["conv_bn_relu", "resnet18"])
def test_seed_flow_fuses_after_optimize(make, caplog):
    model, x = make()
    with torch.no_grad():
        expected = model(x)
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        optimized = ipex_train.optimize(model, dtype=torch.float32)
    assert torch.jit.onednn_fusion_enabled()
    assert any("turned torch.jit.enable_onednn_fusion on" in r.getMessage() for r in caplog.records)
    scripted, graph = _seed_flow(optimized, x)
    assert graph.count(GROUP) >= 2
    convs = [g for g in jit.fused_groups(scripted, x) if "aten::_convolution" in g]
    assert any("aten::relu" in g for g in convs), convs  # conv + relu in one group, as IPEX's ConvReLU
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["call", "env"])
def test_opting_out_leaves_torch_switch_off(how, monkeypatch, caplog):
    model, x = _conv_bn_relu()
    if how == "call":
        ipex_train.enable_onednn_fusion(False)
    else:
        monkeypatch.setenv(jit.FUSION_ENV, "0")
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        optimized = ipex_train.optimize(model, dtype=torch.float32)
    assert not torch.jit.onednn_fusion_enabled() and not ipex_train.onednn_fusion_enabled()
    assert not any("enable_onednn_fusion on" in r.getMessage() for r in caplog.records)
    scripted, graph = _seed_flow(optimized, x)
    assert GROUP not in graph
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), rtol=1e-5, atol=1e-5)


def test_switch_stays_on_until_turned_off():
    model, x = _conv_bn_relu()
    ipex_train.optimize(model, dtype=torch.float32)
    assert torch.jit.onednn_fusion_enabled()
    ipex_train.enable_onednn_fusion(False)
    assert not torch.jit.onednn_fusion_enabled()
    ipex_train.optimize(model, dtype=torch.float32)  # the user's choice holds for later calls
    assert not torch.jit.onednn_fusion_enabled()
    ipex_train.enable_onednn_fusion(True)
    assert torch.jit.onednn_fusion_enabled() and ipex_train.onednn_fusion_enabled()


def test_already_on_is_not_logged_again(caplog):
    model, _ = _conv_bn_relu()
    torch.jit.enable_onednn_fusion(True)
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        ipex_train.optimize(model, dtype=torch.float32)
    assert torch.jit.onednn_fusion_enabled()
    assert not any("enable_onednn_fusion on" in r.getMessage() for r in caplog.records)


def test_training_optimize_leaves_switch_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).train()
    ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    assert not torch.jit.onednn_fusion_enabled()


def test_argument_and_environment_errors(monkeypatch):
    assert ipex_train.enable_onednn_fusion is jit.enable_onednn_fusion
    for bad in (1, None, "on"):
        with pytest.raises(TypeError, match="enabled must be a bool"):
            ipex_train.enable_onednn_fusion(bad)
    model, _ = _conv_bn_relu()
    monkeypatch.setenv(jit.FUSION_ENV, "sometimes")
    weight = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"IPEX_TRAIN_ONEDNN_FUSION='sometimes' is not accepted"):
        ipex_train.optimize(model, dtype=torch.float32, inplace=True)
    assert isinstance(model[1], nn.BatchNorm2d) and torch.equal(model[0].weight, weight)  # nothing was changed
    assert not torch.jit.onednn_fusion_enabled()
