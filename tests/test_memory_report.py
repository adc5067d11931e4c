"""ipex_train.memory_report(): bytes per parameter, predicted before the first step and measured after."""
import json
import logging

import pytest
import torch
from torch import nn

import ipex_train


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))


def one_step(model, opt):
    opt.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(4, 64)).float(), torch.randint(0, 10, (4,))).backward()
    opt.step()


def state_tensor_bytes(opt, keys):
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k in keys)


def test_plain_torch_adamw_is_16_bytes_per_param():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    before = ipex_train.memory_report(model, opt)
    assert before.per_parameter() == {"weights": 4, "truth": 0, "grads": 4, "state": 8, "total": 16}
    assert before.state_predicted == 8 * before.parameters and before.state_measured == 0
    one_step(model, opt)
    after = ipex_train.memory_report(model, opt)
    assert after.state_predicted == 0
    assert after.state_measured == state_tensor_bytes(opt, {"exp_avg", "exp_avg_sq", "step"})


@pytest.mark.parametrize("split", [True, False])
def test_bf16_prediction_matches_the_state_created(split):
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), dtype=torch.bfloat16,
                                     split_master_weight_for_bf16=split)
    before = ipex_train.memory_report(model, opt)
    low = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    assert before.weights == 2 * low + 4 * (before.parameters - low)
    assert before.truth == (2 if split else 4) * low
    assert before.grads == before.weights
    one_step(model, opt)
    after = ipex_train.memory_report(model, opt)
    assert before.state_predicted == state_tensor_bytes(opt, {"exp_avg", "exp_avg_sq"})
    assert after.grads == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())


def test_step_in_backward_has_no_grads():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), dtype=torch.bfloat16,
                                     step_in_backward=True)
    report = ipex_train.memory_report(model, opt)
    assert report.grads == 0 and report.step_in_backward
    assert report.largest_grad == 2 * model[0].weight.numel()
    assert report.per_parameter()["total"] == pytest.approx(12, abs=0.1)
    assert "grads 0 (stepped in backward)" in str(report)


def test_optimizers_without_state_or_fused_step():
    model = make_model()
    sgd = ipex_train.memory_report(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert sgd.state == 0 and sgd.state_unknown_elements == 0
    rms = torch.optim.RMSprop(model.parameters())
    report = ipex_train.memory_report(model, rms)
    assert report.state == 0 and report.state_unknown_elements == report.parameters
    assert "known after the first step" in str(report)
    one_step(model, rms)
    assert ipex_train.memory_report(model, rms).state_measured == state_tensor_bytes(rms, {"square_avg", "step"})


def test_optimize_logs_the_memory_line(caplog):
    model = make_model()
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        model, opt = ipex_train.optimize(model, torch.optim.Adam(model.parameters()), dtype=torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ipex_train memory:")]
    assert lines == [str(ipex_train.memory_report(model, opt))]
    data = json.loads(json.dumps(ipex_train.memory_report(model, opt).to_dict()))
    assert data["total"] == data["weights"] + data["truth"] + data["grads"] + data["state"]


def test_argument_errors():
    with pytest.raises(TypeError, match="model must be"):
        ipex_train.memory_report(object())
    with pytest.raises(TypeError, match="optimizer must be"):
        ipex_train.memory_report(make_model(), object())


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_reduced_state_prediction_matches_the_state_created(state_dtype):
    # Layers above the size under which parameters keep fp32 state, and one below it (the bias).
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 10)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, optimizer_state_dtype=state_dtype,
                                     step_in_backward=True)
    before = ipex_train.memory_report(model, opt)
    fp32_state = 8 * before.parameters
    assert before.state_predicted < 0.6 * fp32_state
    opt.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(4, 128)).float(), torch.randint(0, 10, (4,))).backward()
    opt.step()
    after = ipex_train.memory_report(model, opt)
    steps = state_tensor_bytes(opt, {"step"})
    assert after.state_measured - steps == before.state_predicted
