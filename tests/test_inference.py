"""ipex_train.inference: BatchNorm folding, dropout removal, export through the oneDNN Graph fuser."""
import copy
import logging

import pytest
import torch
from torch import nn

from ipex_train import inference
from ipex_train.inference import patterns

ATOL = 1e-5


def _randomize_bn(model):
    """Non-trivial running statistics and affine parameters, so that a wrong fold shows in the outputs."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.randn(m.num_features, generator=g))
                    m.bias.copy_(torch.randn(m.num_features, generator=g))
    return model.eval()


def _assert_same(model_a, model_b, *inputs):
    with torch.no_grad():
        torch.testing.assert_close(model_a(*inputs), model_b(*inputs), atol=ATOL, rtol=ATOL)


def _count(model, cls):
    return sum(type(m) is cls for m in model.modules())


CONV_CASES = [
    (nn.Conv1d, nn.BatchNorm1d, (2, 4, 10)),
    (nn.Conv2d, nn.BatchNorm2d, (2, 4, 6, 6)),
    (nn.Conv3d, nn.BatchNorm3d, (2, 4, 4, 4, 4)),
]


@pytest.mark.parametrize("conv, bn, shape", CONV_CASES, ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
def test_fold_conv_bn_in_sequential(conv, bn, shape, bias):
    torch.manual_seed(0)
    model = _randomize_bn(nn.Sequential(conv(4, 8, 3, padding=1, bias=bias), bn(8), nn.ReLU()))
    original = copy.deepcopy(model)
    weight = model[0].weight
    report = inference.fold_conv_bn(model)
    assert report == ["folded 0+1"]
    assert isinstance(model[1], nn.Identity) and model[0].weight is weight  # same Parameter, rewritten
    _assert_same(original, model, torch.randn(shape))


class _Block(nn.Module):
    """conv and bn are attributes of a plain module, consecutive in registration order but not in a Sequential."""

    def __init__(self, conv, bn):
        super().__init__()
        self.conv, self.bn = conv(4, 4, 3, padding=1), bn(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class _Residual(_Block):
    """The conv output is consumed by the BN and by a residual add: folding would change the add."""

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class _Branchy(_Block):
    """Input-dependent control flow: torch.fx cannot trace it, so only a sample input proves the pair."""

    def forward(self, x):
        y = self.bn(self.conv(x))
        return y if x.sum() > 0 else -y


@pytest.mark.parametrize("conv, bn, shape", CONV_CASES, ids=["1d", "2d", "3d"])
def test_fold_outside_sequential_is_proven_by_fx_trace(conv, bn, shape):
    torch.manual_seed(0)
    model = _randomize_bn(_Block(conv, bn))
    original = copy.deepcopy(model)
    assert inference.fold_conv_bn(model) == ["folded conv+bn"]
    assert _count(model, bn) == 0
    _assert_same(original, model, torch.randn(shape))


@pytest.mark.parametrize("conv, bn, shape", CONV_CASES, ids=["1d", "2d", "3d"])
def test_untraceable_model_needs_sample_input(conv, bn, shape, caplog):
    torch.manual_seed(0)
    model = _randomize_bn(_Branchy(conv, bn))
    original = copy.deepcopy(model)
    x = torch.randn(shape)
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        report = inference.fold_conv_bn(model)
    assert report[0].startswith("skipped conv+bn: torch.fx could not trace the model") and _count(model, bn) == 1
    assert len([r for r in caplog.records if r.name == "ipex_train"]) == 1
    assert inference.fold_conv_bn(model, sample_input=x) == ["folded conv+bn"]
    assert _count(model, bn) == 0
    _assert_same(original, model, x)
    _assert_same(original, model, -x.abs())


def test_unproven_pairs_are_summarised_in_one_short_line(caplog):
    model = _randomize_bn(nn.Sequential(*[_Branchy(nn.Conv2d, nn.BatchNorm2d) for _ in range(5)]))
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        report = inference.fold_conv_bn(model)
    assert len(report) == 5 and all(r.startswith("skipped") for r in report)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ipex_train"]
    assert line.startswith("BatchNorm folding left 5 pair(s) unfolded, first: 0.conv+0.bn")
    assert "2.conv+2.bn" in line and "3.conv+3.bn" not in line


def test_optimize_folds_every_resnet_bn_without_sample_input():
    torchvision = pytest.importorskip("torchvision")
    import ipex_train

    torch.manual_seed(0)
    model = _randomize_bn(torchvision.models.resnet18(weights=None))
    original = copy.deepcopy(model)
    optimized = ipex_train.optimize(model.eval())
    assert _count(original, nn.BatchNorm2d) == 20 and _count(optimized, nn.BatchNorm2d) == 0
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), original(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_sample", [True, False])
def test_shared_conv_output_is_not_folded(with_sample, caplog):
    torch.manual_seed(0)
    model = _randomize_bn(nn.Sequential(_Residual(nn.Conv2d, nn.BatchNorm2d), _Block(nn.Conv2d, nn.BatchNorm2d)))
    original = copy.deepcopy(model)
    x = torch.randn(2, 4, 6, 6)
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        report = inference.fold_conv_bn(model, sample_input=x if with_sample else None)
    lines = [r.getMessage() for r in caplog.records if r.name == "ipex_train"]
    assert len(lines) == 1 and "0.conv+0.bn" in lines[0]
    assert isinstance(model[0].bn, nn.BatchNorm2d)
    assert "folded 1.conv+1.bn" in report and isinstance(model[1].bn, nn.Identity)
    assert any(r.startswith("skipped 0.conv+0.bn: the layer output is also used elsewhere") for r in report)
    _assert_same(original, model, x)


def test_conv_output_returned_by_model_is_not_folded():
    class Both(_Block):
        def forward(self, x):
            y = self.conv(x)
            return y, self.bn(y)

    model = _randomize_bn(Both(nn.Conv2d, nn.BatchNorm2d))
    original = copy.deepcopy(model)
    x = torch.randn(1, 4, 5, 5)
    report = inference.fold_conv_bn(model, sample_input=x)
    assert report[0].startswith("skipped conv+bn") and isinstance(model.bn, nn.BatchNorm2d)
    _assert_same(original, model, x)


def test_fold_conv_bn_leaves_training_bn_and_hooked_layers_alone():
    model = _randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)))
    model[3].train()
    model[0].register_forward_hook(lambda m, i, o: None)
    stats = model[3].running_mean.clone()
    report = inference.fold_conv_bn(model, sample_input=torch.randn(1, 3, 4, 4))
    assert all(r.startswith("skipped") for r in report) and len(report) == 2
    assert torch.equal(model[3].running_mean, stats)  # no forward pass touched the training-mode statistics
    model[3].eval()
    assert inference.fold_conv_bn(model) == ["folded 2+3", "skipped 0+1: Conv2d has forward hooks, which would "
                                             "see different values"]


def test_fold_linear_bn_needs_sample_and_2d_output():
    torch.manual_seed(0)
    model = _randomize_bn(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))
    original = copy.deepcopy(model)
    x = torch.randn(5, 6)
    assert inference.fold_linear_bn(model)[0].startswith("skipped 0+1: needs sample_input")
    assert inference.fold_linear_bn(model, sample_input=x) == ["folded 0+1"]
    assert isinstance(model[1], nn.Identity)
    _assert_same(original, model, x)

    # 3-D output: BatchNorm1d normalises dim 1 (here 8 = the Linear's features only by coincidence).
    seq = _randomize_bn(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
    report = inference.fold_linear_bn(seq, sample_input=torch.randn(2, 8, 8))
    assert report[0].startswith("skipped 0+1: the layer output is 3-D")


def test_folding_on_transformer_without_fx():
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
            self.proj = nn.Linear(16, 8)
            self.norm = nn.BatchNorm1d(8)  # consumes proj's pooled output, not proj's output: not foldable

        def forward(self, tokens):
            h = self.encoder(self.embed(tokens))
            if tokens.shape[1] > 1:  # data-dependent Python control flow: fx symbolic tracing fails here
                h = h.mean(1)
            return self.norm(torch.relu(self.proj(h)))

    model = _randomize_bn(Tiny())
    original = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (3, 7))
    with pytest.raises(torch.fx.proxy.TraceError, match="control flow"):
        torch.fx.symbolic_trace(model)
    report = inference.fold_conv_bn(model, sample_input=tokens) + inference.fold_linear_bn(model, tokens)
    assert not any(r.startswith("folded") for r in report)
    assert isinstance(model.norm, nn.BatchNorm1d)
    _assert_same(original, model, tokens)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_fold_rejects_scripted_model():
    scripted = torch.jit.script(nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1)).eval())
    with pytest.raises(TypeError, match="model"):
        inference.fold_conv_bn(scripted)


def test_replace_dropout_every_variant():
    variants = [nn.Dropout(0.5), nn.Dropout1d(0.5), nn.Dropout2d(0.5), nn.Dropout3d(0.5), nn.AlphaDropout(0.5),
                nn.FeatureAlphaDropout(0.5)]
    model = nn.Sequential(nn.Linear(4, 4), *variants, nn.Sequential(nn.Dropout(0.1)))
    assert inference.replace_dropout(model) == len(variants) + 1
    assert not any("Dropout" in type(m).__name__ for m in model.modules())
    model.train()  # Identity stays an identity even in training mode
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), model[0](x))


def _assert_fused(groups, *ops):
    assert any(all(op in g.split(": ", 1)[1].split(", ") for op in ops) for g in groups), groups


def _seq_model():
    torch.manual_seed(0)
    return _randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                       nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 5)))


def test_export_fuses_and_restores_global_switch():
    model = _seq_model()
    x = torch.randn(2, 3, 6, 6)
    before = torch.jit.onednn_fusion_enabled()
    scripted = inference.export(model, x)
    assert torch.jit.onednn_fusion_enabled() == before
    assert isinstance(scripted, torch.jit.ScriptModule)
    groups = inference.fused_groups(scripted, x)
    _assert_fused(groups, "aten::_convolution", "aten::relu")
    assert not any("batch_norm" in g for g in groups)  # freezing folded it
    _assert_same(model, scripted, x)


def test_export_with_fusion_disabled_forms_no_groups():
    model = _seq_model()
    x = torch.randn(2, 3, 6, 6)
    before = torch.jit.onednn_fusion_enabled()
    try:
        inference.enable_onednn_fusion(False)
        assert not inference.onednn_fusion_enabled() and not torch.jit.onednn_fusion_enabled()
        scripted = inference.export(model, x)
        assert inference.fused_groups(scripted, x) == []
        _assert_same(model, scripted, x)
    finally:
        inference.enable_onednn_fusion(True)
        torch.jit.enable_onednn_fusion(before)
    assert inference.onednn_fusion_enabled()


def test_export_argument_errors():
    with pytest.raises(ValueError, match="training mode"):
        inference.export(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(TypeError, match="example_inputs"):
        inference.export(nn.Linear(2, 2).eval(), [1.0])
    with pytest.raises(TypeError, match="enabled"):
        inference.enable_onednn_fusion(1)


@pytest.mark.filterwarnings("ignore:`torch.jit.save` is deprecated")
def test_save_load_round_trip_keeps_fusion(tmp_path):
    model = _seq_model()
    x = torch.randn(2, 3, 6, 6)
    path = tmp_path / "model.pt"
    torch.jit.save(inference.export(model, x), str(path))
    before = torch.jit.onednn_fusion_enabled()
    loaded = inference.load(str(path), x)
    assert torch.jit.onednn_fusion_enabled() == before
    _assert_fused(inference.fused_groups(loaded, x), "aten::_convolution", "aten::relu")
    _assert_same(model, loaded, x)


def test_new_shape_gives_correct_output():
    model = _seq_model()
    scripted = inference.export(model, torch.randn(4, 3, 6, 6))
    for batch in (1, 3, 4):
        _assert_same(model, scripted, torch.randn(batch, 3, 6, 6))


def test_new_shape_under_global_switch_is_correct():
    model = _seq_model()
    scripted = inference.export(model, torch.randn(4, 3, 6, 6))
    before = torch.jit.onednn_fusion_enabled()
    x = torch.randn(2, 3, 6, 6)
    try:
        torch.jit.enable_onednn_fusion(True)
        for _ in range(3):  # the fallback is profiled, then fused for the new shape
            _assert_same(model, scripted, x)
    finally:
        torch.jit.enable_onednn_fusion(before)
    _assert_same(model, scripted, x)


# Measured with benchmarks/studies/onednn_pattern_survey.py (see the docstring of ipex_train/inference/jit.py): the FP32
# patterns of the IPEX list this torch's fuser puts into one group.
FUSED_ELTWISE = ["abs", "clamp", "elu", "exp", "gelu", "hardtanh", "hardswish", "log", "sigmoid", "relu", "round",
                 "sqrt", "square", "tanh", "leaky_relu", "silu"]
FP32_FUSED = ([f"{k}+{e}" for k in ("conv1d", "conv2d", "conv3d", "linear") for e in FUSED_ELTWISE + ["sigmoid+mul"]]
              + [f"{k}+add" for k in ("conv1d", "conv2d", "conv3d", "linear")]
              + [f"{k}+add+relu" for k in ("conv1d", "conv2d", "conv3d")])
_CATALOGUE = {p.name: p for p in patterns.catalogue()}


@pytest.mark.parametrize("name", FP32_FUSED)
def test_fp32_pattern_fused(name):
    pattern = _CATALOGUE[name]
    result = patterns.check(pattern, torch.float32)
    assert result["status"] == "fused", result
    _assert_fused(result["groups"], *pattern.expected_ops)
    assert result["max_abs_err"] <= ATOL * 10  # exp/log/square amplify the rounding of a reordered conv


@pytest.mark.parametrize("name", ["conv2d+relu", "linear+gelu", "conv2d+add+relu"])
def test_bf16_pattern_matches_cpu_support(name):
    """Measured here: without native bf16 the fuser forms no bf16 group and the export runs unfused, still correct.
    (What a bf16-capable CPU fuses was not measured: there only correctness is checked.)"""
    result = patterns.check(_CATALOGUE[name], torch.bfloat16)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert result["status"] == "not fused", result
    assert result["max_abs_err"] <= 0.05
