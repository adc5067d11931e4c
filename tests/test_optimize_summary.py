"""ipex_train.summary() and the one INFO line per optimize() call: what went low precision, what stayed fp32 and
why, the compute policy, the optimizer step."""
import json
import logging

import pytest
import torch
import torchvision
from sycl_required import need_sycl_device
from torch import nn

import ipex_train
from ipex_train.reports import summary as _summary


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ipex_train.optimize (")]


def _dtype_counts(model):
    low = [p for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    return len(low), sum(p.numel() for p in low), [p for p in model.parameters() if p.dtype == torch.float32]


def test_resnet_training_bf16_adamw(caplog):
    model = torchvision.models.resnet18(num_classes=10).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16)
    s = ipex_train.summary(model, opt)
    n_low, e_low, fp32 = _dtype_counts(model)
    assert (s.mode, s.dtype, s.low_precision_tensors, s.low_precision_elements) == ("training", "bfloat16", n_low,
                                                                                     e_low)
    assert n_low == 22 and len(fp32) == 40  # 20 conv weights, fc weight and bias; BatchNorm weights and biases
    reasons = {k.reason: k for k in s.kept}
    assert reasons[_summary.NORM].tensors == 40 and reasons[_summary.NORM].modules == ("BatchNorm2d",)
    assert s.kept_tensors == len(fp32) and s.kept_elements == sum(p.numel() for p in fp32)
    assert s.compute_policy in ("native", "emulated")
    assert (s.optimizer, s.fused_step, s.sycl, s.onednn_fusion) == ("AdamW", "adam", False, None)
    assert _lines(caplog) == [str(s)]
    assert "22 params bfloat16" in str(s) and "40 normalisation layer [BatchNorm2d]" in str(s)
    assert "AdamW: fused adam step" in str(s)


def test_linear_bias_converts_with_its_weight():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).train()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    s = ipex_train.summary(model, opt)
    assert s.low_precision_tensors == 4 and [(k.reason, k.tensors) for k in s.kept] == [(_summary.NORM, 2)]
    assert s.fused_step == "sgd"


class _Scaled(nn.Module):
    """A bare Parameter used outside any matmul-class module, and a weight tied between Embedding and Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.head(self.emb(x) * self.scale)


def test_reasons_for_fp32_parameters(caplog):
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1).eval()
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        out = ipex_train.optimize(enc, dtype=torch.bfloat16)
    s = ipex_train.summary(out)
    assert s.mode == "inference" and s.optimizer is None and s.fused_step is None
    assert s.onednn_fusion == torch.jit.onednn_fusion_enabled()
    by_reason = {k.reason: k for k in s.kept}
    assert by_reason[_summary.NORM].modules == ("LayerNorm",)
    n_low, _, fp32 = _dtype_counts(out)
    assert s.low_precision_tensors == n_low and s.kept_tensors == len(fp32)
    # Whatever the conversion rules make of nn.MultiheadAttention, every fp32 parameter has a reason.
    assert set(by_reason) <= {_summary.NORM, _summary.NOT_MATMUL, _summary.SIBLING}
    assert _lines(caplog) == [str(s)]

    scaled = ipex_train.optimize(_Scaled().eval(), dtype=torch.bfloat16)
    s = ipex_train.summary(scaled)
    assert s.low_precision_tensors == 1  # the tied weight, counted once
    assert [(k.reason, k.tensors, k.modules) for k in s.kept] == [(_summary.NOT_MATMUL, 1, ("_Scaled",))]


def test_fp32_and_unfused_optimizers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    m, opt = ipex_train.optimize(model, torch.optim.RMSprop(model.parameters()), dtype=torch.float16)
    s = ipex_train.summary(m, opt)
    assert (s.dtype, s.optimizer, s.fused_step, s.compute_policy) == ("float16", "RMSprop", None, None)
    assert "RMSprop: own (unfused) step" in str(s)
    m, opt = ipex_train.optimize(model, torch.optim.Adam(model.parameters()), fuse_update_step=False)
    s = ipex_train.summary(m, opt)
    assert s.dtype is None and s.low_precision_tensors == 0 and s.fused_step is None
    assert [(k.reason, k.tensors) for k in s.kept] == [(_summary.NOT_REQUESTED, 4)]
    m, opt = ipex_train.optimize(model, torch.optim.Adagrad(model.parameters()))
    assert ipex_train.summary(m, opt).fused_step == "adagrad"


def test_to_dict_is_json_and_matches_fields():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)).eval()
    s = ipex_train.summary(ipex_train.optimize(model, dtype=torch.bfloat16))
    data = json.loads(json.dumps(s.to_dict()))
    assert data["dtype"] == "bfloat16" and data["low_precision_tensors"] == 2
    assert data["kept"] == [{"reason": _summary.NORM, "tensors": 2, "elements": 8, "modules": ["LayerNorm"]}]
    with pytest.raises(AttributeError):
        s.dtype = None  # frozen


def test_plain_model_and_argument_errors():
    s = ipex_train.summary(nn.Linear(3, 3))
    assert s.mode == "inference" and s.dtype is None and s.kept_tensors == 2
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ipex_train.summary("model")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None"):
        ipex_train.summary(nn.Linear(3, 3), object())


def test_sycl_step_is_reported():
    need_sycl_device()
    model = nn.Linear(8, 8).train()
    m, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), sycl=True)
    s = ipex_train.summary(m, opt)
    assert s.sycl and s.fused_step == "sgd" and "fused sgd step on SYCL" in str(s)


def test_module_routes_are_counted(caplog):
    transformers = pytest.importorskip("transformers")
    import ipex_train.compute_policy as cp

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16)
    s = ipex_train.summary(model, opt)
    if s.compute_policy != "native":
        assert s.routed_modules == ()  # the emulated policy routes no modules
        return
    # 2 decoder layers: 2 RMSNorms each plus the final one; one MLP, one attention layer and one residual add +
    # post-attention norm each.
    assert s.routed_modules == (("rms_norm", 5), ("swiglu", 2), ("rope", 2), ("add_rms_norm", 2))
    assert "modules routed to fused kernels: 5 rms_norm, 2 swiglu, 2 rope, 2 add_rms_norm" in str(s)
    assert json.loads(json.dumps(s.to_dict()))["routed_modules"] == {"rms_norm": 5, "swiglu": 2, "rope": 2,
                                                                     "add_rms_norm": 2}
    assert _lines(caplog) == [str(s)]
    cp.attached(model).remove()  # detached: nothing routed any more, and the summary says so
    assert ipex_train.summary(model, opt).routed_modules == ()
