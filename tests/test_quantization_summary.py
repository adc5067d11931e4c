"""ipex_train.quantization: qconfigs, the JSON qconf summary (round trip, edits, mismatches) and bad inputs."""
import copy
import json

import pytest
import torch
import torchvision
from int8_helpers import Residual, cos, quantize, residual_data
from torch import nn

from ipex_train import quantization as q


def test_symmetric_qconfig_and_histogram_observer():
    torch.manual_seed(0)
    model = Residual().eval()
    data = residual_data()
    _, sym = quantize(model, data[0], data, q.symmetric_static_qconfig)
    # torch's symmetric uint8 observers centre on (quant_min + quant_max) // 2 = 127 for the 0..255 range
    assert all(z == 127 for e in sym.qconf_summary() for z in e["input_zero_points"] + e["output_zero_points"])
    _, hist = quantize(model, data[0], data, q.QConfig(observer="histogram"))
    assert {e["algorithm"] for e in hist.qconf_summary()} == {"histogram"}
    with torch.no_grad():
        for int8 in (sym, hist):
            assert cos(int8(data[1]), model(data[1])) >= 0.999


def test_json_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, 32, 32)
    prepared, int8 = quantize(model, x, [torch.randn(2, 3, 32, 32)])
    path = tmp_path / "qconf.json"
    prepared.save_qconf_summary(path)
    fresh = q.prepare(model, example_inputs=x)
    fresh.load_qconf_summary(path)
    reloaded = q.convert(fresh)
    assert reloaded.qconf_summary() == int8.qconf_summary()
    with torch.no_grad():
        assert torch.equal(reloaded(x), int8(x))


def test_edited_summary_keeps_a_layer_fp32(tmp_path):
    torch.manual_seed(0)
    model = Residual().eval()
    data = residual_data()
    prepared, _ = quantize(model, data[0], data)
    path = tmp_path / "qconf.json"
    prepared.save_qconf_summary(path)
    summary = json.loads(path.read_text())
    [fc] = [e for e in summary if e["name"] == "fc"]
    fc["inputs_quantized"] = [False]
    path.write_text(json.dumps(summary, indent=1))
    fresh = q.prepare(model, example_inputs=data[0])
    fresh.load_qconf_summary(path)
    int8 = q.convert(fresh)
    assert type(int8.model.fc) is nn.Linear
    assert q.fp32_ops(int8) == ["fc (linear): inputs_quantized is false in the summary"]
    with torch.no_grad():
        assert cos(int8(data[1]), model(data[1])) >= 0.999


def _summary_file(tmp_path, summary, name="bad.json"):
    path = tmp_path / name
    path.write_text(json.dumps(summary))
    return path


def test_mismatching_summary_names_first_mismatch_and_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model = Residual().eval()
    data = residual_data()
    prepared, int8 = quantize(model, data[0], data)
    good = prepared.qconf_summary()
    other, _ = quantize(nn.Sequential(nn.Conv2d(8, 8, 1)).eval(), data[0], data[:1])
    with pytest.raises(ValueError, match=r"op 0 \('conv1'\): name is '0' in the file but 'conv1'"):
        prepared.load_qconf_summary(_summary_file(tmp_path, other.qconf_summary()))
    with pytest.raises(ValueError, match=r"has 3 ops, this model has 4; the first missing one is op 3 \('fc'\)"):
        prepared.load_qconf_summary(_summary_file(tmp_path, good[:3]))
    bad = copy.deepcopy(good)
    bad[2]["output_scales"] = [-1.0]
    with pytest.raises(ValueError, match=r"op 2 \('conv2\+add'\): output_scales\[0\] = -1.0 is not a positive"):
        prepared.load_qconf_summary(_summary_file(tmp_path, bad))
    bad = copy.deepcopy(good)
    bad[2]["inputs_flow"] = ["fc.output0", "conv1.output0"]
    with pytest.raises(ValueError, match=r"op 2 \('conv2\+add'\): inputs_flow is \['fc.output0'"):
        prepared.load_qconf_summary(_summary_file(tmp_path, bad))
    bad = copy.deepcopy(good)
    bad[0]["input_quantized_dtypes"] = ["int4"]
    with pytest.raises(ValueError, match=r"input_quantized_dtypes\[0\] = 'int4'"):
        prepared.load_qconf_summary(_summary_file(tmp_path, bad))
    bad = copy.deepcopy(good)
    bad[3]["weight_scales"] = [[0.1, 0.2]]
    with pytest.raises(ValueError, match=r"op 3 \('fc'\): weight_scales"):
        prepared.load_qconf_summary(_summary_file(tmp_path, bad))
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ValueError, match="not valid JSON"):
        prepared.load_qconf_summary(tmp_path / "broken.json")
    assert prepared.qconf_summary() == good  # nothing was loaded
    with torch.no_grad():
        assert torch.equal(q.convert(prepared)(data[1]), int8(data[1]))


def test_bad_inputs_leave_the_model_unchanged():
    torch.manual_seed(0)
    model = Residual()
    state = copy.deepcopy(model.state_dict())
    x = residual_data()[0]
    with pytest.raises(ValueError, match="training mode"):
        q.prepare(model, example_inputs=x)
    assert model.training
    model.eval()
    with pytest.raises(TypeError, match="qconfig must be"):
        q.prepare(model, qconfig="fbgemm", example_inputs=x)
    with pytest.raises(TypeError, match="example_inputs is required"):
        q.prepare(model)
    with pytest.raises(TypeError, match="example_inputs must be"):
        q.prepare(model, example_inputs=3)
    with pytest.raises(TypeError, match="model must be an eager"):
        q.prepare(torch.jit.script(nn.Linear(2, 2).eval()), example_inputs=torch.randn(1, 2))
    with pytest.raises(ValueError, match="activation_qscheme must be one of"):
        q.QConfig(activation_qscheme=torch.per_channel_affine)
    with pytest.raises(ValueError, match="activation_dtype must be torch.quint8"):
        q.QConfig(activation_dtype=torch.qint8)
    with pytest.raises(TypeError, match="weight_dtype must be a torch.dtype"):
        q.QConfig(weight_dtype="int8")
    with pytest.raises(ValueError, match="observer must be one of"):
        q.QConfig(observer="kl")
    with pytest.raises(ValueError, match="weight_bits must be None, 7 or 8"):
        q.QConfig(weight_bits=4)
    prepared = q.prepare(model, example_inputs=x)
    with pytest.raises(RuntimeError, match="no calibration batch"):
        q.convert(prepared)
    with pytest.raises(RuntimeError, match="no calibration batch"):
        prepared.save_qconf_summary("unused.json")
    with torch.no_grad():
        prepared(x)
    prepared.train()
    with pytest.raises(ValueError, match="training mode"):
        q.convert(prepared)
    prepared.eval()
    with pytest.raises(TypeError, match="convert\\(\\): prepared must be the PreparedModel"):
        q.convert(model)
    int8 = q.convert(prepared, inplace=True)
    with pytest.raises(TypeError, match="already converted"):
        q.convert(int8)
    with pytest.raises(RuntimeError, match="already converted in place"):
        q.convert(prepared)
    # The user's model: same type of every module (BatchNorm not folded away), same values, no hooks left.
    assert isinstance(model.bn1, nn.BatchNorm2d)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
