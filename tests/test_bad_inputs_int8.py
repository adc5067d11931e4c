"""Bad and unusual inputs to INT8 quantization: what each one gives (docs/quantization_bad_inputs.md).

Sections, one per stage; add a case to the parametrize list of its section, or a test under the matching header:
  1. calibration data      non-finite values, a zero observed range, a batch that raises
  2. qconf summary scales  the accepted range, the one check shared by load_qconf_summary / save / convert()
  3. inputs of the int8 model  unbatched and wrong-rank conv inputs, NaN and infinite values
"""
import copy
import json
import warnings

import pytest
import torch
from int8_helpers import Residual, cos, quantize, residual_data
from torch import nn

from ipex_train import quantization as q

SCALE_RANGE = r"is not a positive number in \[2\*\*-42, 2\*\*42\]"


@pytest.fixture
def residual():
    torch.manual_seed(0)
    return Residual().eval(), residual_data()


def _calibrated(model, data, qconfig=q.default_static_qconfig):
    prepared = q.prepare(model, qconfig, example_inputs=data[0])
    with torch.no_grad():
        for x in data:
            prepared(x)
    return prepared


class LogThenLinear(nn.Module):
    """fc reads log(x): a zero in a finite input becomes -inf inside the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.log(x))


class FailsOnFlag(nn.Module):
    """Two convs; the forward raises between them (after conv1 was observed) when ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.fail = nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 1), False

    def forward(self, x):
        y = self.conv1(x)
        if self.fail:
            raise RuntimeError("the model's own error")
        return self.conv2(y)


# 1. calibration data ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, counts", [(float("nan"), "1 NaN and 0 infinite"),
                                           (float("inf"), "0 NaN and 1 infinite"),
                                           (float("-inf"), "0 NaN and 1 infinite")], ids=["nan", "inf", "-inf"])
def test_non_finite_calibration_value_raises_naming_op_and_batch(residual, value, counts):
    model, data = residual
    prepared = _calibrated(model, data[:1])
    before = copy.deepcopy(prepared.qconf_summary())
    bad = data[1].clone()
    bad[0, 0, 0, 0] = value
    message = rf"calibration batch 2 \(after 1 accepted\): input 0 of op 'conv1' \(conv2d\) holds {counts} values"
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        prepared(bad)
    assert prepared.calibration_batches == 1 and prepared.qconf_summary() == before  # the batch changed nothing
    with torch.no_grad():
        prepared(data[2])  # calibration goes on, as if the bad batch had never been offered
        clean = _calibrated(model, [data[0], data[2]])
        assert torch.equal(q.convert(prepared)(data[1]), q.convert(clean)(data[1]))


def test_non_finite_value_made_inside_the_model_names_that_op():
    torch.manual_seed(0)
    model = LogThenLinear().eval()
    x = torch.rand(2, 8) + 0.1
    prepared = q.prepare(model, example_inputs=x)
    x0 = x.clone()
    x0[1, 3] = 0.0
    with torch.no_grad(), pytest.raises(ValueError, match=r"calibration batch 1 \(after 0 accepted\): input 0 "
                                                          r"of op 'fc' \(linear\) holds 0 NaN and 1 infinite"):
        prepared(x0)
    with pytest.raises(RuntimeError, match="no calibration batch"):
        prepared.qconf_summary()


@pytest.mark.parametrize("observer", ["minmax", "histogram"])
def test_calibration_batch_that_raises_changes_nothing(observer):
    torch.manual_seed(0)
    model = FailsOnFlag().eval()
    data = residual_data()
    prepared = _calibrated(model, data[:1], q.QConfig(observer=observer))
    before = copy.deepcopy(prepared.qconf_summary())
    prepared.model.fail = True
    with torch.no_grad(), pytest.raises(RuntimeError, match="the model's own error"):
        prepared(data[1] * 10)  # conv1 observes a 10x wider range before the model raises
    assert prepared.qconf_summary() == before and prepared.calibration_batches == 1


def test_zero_range_calibration_warns_naming_the_ops(residual, tmp_path):
    model, data = residual
    zeros = torch.zeros_like(data[0])
    prepared = _calibrated(model, [zeros])
    with pytest.warns(UserWarning, match=r"a single value \(a zero range\) at conv1 \(conv2d\) input 0;"):
        q.convert(prepared)
    with pytest.warns(UserWarning, match=r"conv1 \(conv2d\) input 0"):
        prepared.save_qconf_summary(tmp_path / "zeros.json")
    good = _calibrated(model, data)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*zero range.*")
        q.convert(good)  # representative data: no warning


# 2. qconf summary scales -----------------------------------------------------------------------------------------

def _edited(tmp_path, prepared, op, key, value):
    summary = copy.deepcopy(prepared.qconf_summary())
    summary[op][key] = [[value] * len(summary[op][key][0])] if key == "weight_scales" else [value]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(summary))
    return path


@pytest.mark.parametrize("key, index", [("input_scales", r"\[0\]"), ("output_scales", r"\[0\]"),
                                        ("weight_scales", r"\[0\]\[0\]")], ids=["input_scales", "output_scales",
                                                                                  "weight_scales"])
@pytest.mark.parametrize("value", [1e30, 1e-30, 1e-45, 2.0 ** 42 * 1.001, float("inf")])
def test_hand_edited_scale_out_of_range_is_refused(residual, tmp_path, key, index, value):
    model, data = residual
    prepared = _calibrated(model, data)
    before = prepared.qconf_summary()
    with pytest.raises(ValueError, match=rf"op 0 \('conv1'\): {key}{index} = {value!r} {SCALE_RANGE}".replace(
            "+", r"\+")):
        prepared.load_qconf_summary(_edited(tmp_path, prepared, 0, key, value))
    assert prepared.qconf_summary() is not None and prepared.qconf_summary() == before  # nothing loaded


@pytest.mark.parametrize("value", [2.0 ** -42, 2.0 ** 42])
def test_scales_at_the_range_ends_load_and_run(residual, tmp_path, value):
    model, data = residual
    prepared = _calibrated(model, data)
    prepared.load_qconf_summary(_edited(tmp_path, prepared, 3, "output_scales", value))
    with torch.no_grad():
        assert torch.isfinite(q.convert(prepared)(data[1])).all()


@pytest.mark.parametrize("magnitude, shown", [(3e38, "inf"), (1e20, r"7\.84\d*e\+17")],
                         ids=["infinite_scale", "scale_past_2**42"])
def test_convert_and_save_refuse_what_load_refuses(tmp_path, magnitude, shown):
    # Finite calibration values whose range gives an infinite scale (3e38 - -3e38 overflows float32) or one past
    # 2**42: convert() and save_qconf_summary() run load_qconf_summary's check, with the same message.
    model = nn.Sequential(nn.Linear(4, 2)).eval()
    with torch.no_grad():
        model[0].weight.fill_(0.1)
    x = torch.tensor([[magnitude, -magnitude, 0.0, 0.0]])
    prepared = _calibrated(model, [x])
    problem = rf"op 0 \('0'\): input_scales\[0\] = {shown} {SCALE_RANGE}"
    with pytest.raises(ValueError, match=rf"^convert\(\): {problem}"):
        q.convert(prepared)
    path = tmp_path / "qconf.json"
    with pytest.raises(ValueError, match=rf"^save_qconf_summary: {problem}"):
        prepared.save_qconf_summary(path)
    assert not path.exists()
    path.write_text(json.dumps(prepared.qconf_summary()))  # what an unchecked save would have written
    with pytest.raises(ValueError, match=problem):
        q.prepare(model, example_inputs=x).load_qconf_summary(path)


# 3. inputs of the int8 model -------------------------------------------------------------------------------------

@pytest.mark.parametrize("conv, batched", [(nn.Conv1d, (2, 3, 12)), (nn.Conv2d, (2, 3, 8, 8)),
                                           (nn.Conv3d, (2, 3, 4, 6, 6))], ids=["conv1d", "conv2d", "conv3d"])
def test_unbatched_conv_input_runs_as_in_fp32(conv, batched):
    torch.manual_seed(0)
    model = nn.Sequential(conv(3, 4, 3), nn.ReLU(), conv(4, 4, 1)).eval()
    x = torch.randn(batched)
    _, int8 = quantize(model, x, [x])
    with torch.no_grad():
        one = int8(x[0])
        assert one.shape == model(x[0]).shape
        assert torch.equal(one, int8(x[:1])[0])  # the same kernels, on a batch of one
        assert cos(one, model(x[0])) >= 0.999


def test_wrong_rank_conv_input_names_op_shape_and_accepted_ranks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    x = torch.randn(2, 3, 8, 8)
    _, int8 = quantize(model, x, [x])
    with torch.no_grad(), pytest.raises(ValueError, match=r"int8 Conv2d '0': input of shape \(2, 3, 1, 8, 8\); "
                                                          r"accepted are 4-D batched .* and 3-D unbatched"):
        int8(x.unsqueeze(2))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_input_gives_nan_output(residual, value):
    model, data = residual
    _, int8 = quantize(model, data[0], data)
    x = data[1].clone()
    with torch.no_grad():
        clean = int8(x)
        x[2, 1, 3, 3] = value
        assert not torch.isfinite(model(x)).all()  # what fp32 gives
        assert torch.isnan(int8(x)).all()  # int8: the whole output of that call (docs/quantization_bad_inputs.md)
        assert torch.equal(int8(data[1]), clean)  # a clean call is not affected
        traced = torch.jit.trace(int8, data[1], check_trace=False)  # the check is tensor ops: a trace keeps it
        assert torch.equal(traced(data[1]), clean)
        assert torch.isnan(traced(x)).all()


def test_non_finite_value_made_by_an_fp32_op_before_an_int8_layer_gives_nan_output():
    torch.manual_seed(0)
    model = LogThenLinear().eval()
    x = torch.rand(3, 8) + 0.1
    _, int8 = quantize(model, x, [x])
    x[1, 2] = 0.0  # log(0) = -inf reaches fc's quantization
    with torch.no_grad():
        assert not torch.isfinite(model(x)).all()
        assert torch.isnan(int8(x)).all()
