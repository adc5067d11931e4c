"""optimize() given models, optimizers and options it cannot honour: refused before anything changes, with a
message naming the argument (or the module/parameter) and what is accepted. Add a case as a test of its own,
checking the model and optimizer with ``unchanged``."""
import copy
import logging

import pytest
import torch
from sycl_required import need_sycl_device
from torch import nn

import ipex_train


def snapshot(model, opt=None):
    """Parameter values, dtypes, hooks and optimizer state: what a refused call must leave as it was."""
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    params = [(p.dtype, p.detach().clone()) for p in model.parameters()]
    return params, hooks, None if opt is None else copy.deepcopy(opt.state_dict())


def unchanged(before, model, opt=None):
    params, hooks, state = snapshot(model, opt)
    assert hooks == before[1]
    assert [d for d, _ in params] == [d for d, _ in before[0]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params, before[0]))
    if opt is not None:
        assert state["param_groups"] == before[2]["param_groups"]
        assert state["state"].keys() == before[2]["state"].keys()
        for i, entry in state["state"].items():
            assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(before[2]["state"][i][k]))
                       for k, v in entry.items())


def scripted_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), torch.jit.script(nn.Linear(8, 8)))


@pytest.mark.parametrize("inplace", [True, False])
def test_scripted_child_with_bf16_is_refused_before_any_change(inplace):
    model = scripted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"submodule '1' is a TorchScript module; with dtype=torch.bfloat16"):
        ipex_train.optimize(model, opt, dtype=torch.bfloat16, inplace=inplace)
    unchanged(before, model, opt)
    model(torch.randn(2, 8)).sum().backward()  # still runs as it did


def test_scripted_child_copy_for_training_is_refused_not_a_key_error():
    model = scripted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"submodule '1' is a TorchScript module; the model copy of inplace=False"):
        ipex_train.optimize(model, opt)


def test_scripted_child_trains_in_fp32_inplace():
    model = scripted_model()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), inplace=True)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_bf16_compute_error_names_the_argument():
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"optimize\(\): bf16_compute='fast' is not accepted; use one of "
                                         r"auto, native, emulated"):
        ipex_train.optimize(model, opt, dtype=torch.bfloat16, bf16_compute="fast")
    unchanged(before, model, opt)


def test_differentiable_optimizer_is_refused():
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), differentiable=True)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"param group 0 has differentiable=True"):
        ipex_train.optimize(model, opt)
    unchanged(before, model, opt)


def test_differentiable_param_group_added_later_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model[0].parameters()))
    with pytest.raises(ValueError, match="'differentiable' is True"):
        opt.add_param_group({"params": list(model[1].parameters()), "differentiable": True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_lazy_module_is_refused_until_materialised(dtype):
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not materialised yet .* run one forward"):
        ipex_train.optimize(model, opt, dtype=dtype)
    model(torch.randn(2, 5))
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=dtype)
    model(torch.randn(2, 5)).float().sum().backward()
    opt.step()


def aliased_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = nn.Parameter(model[0].weight.data)  # a second Parameter on the first one's storage
    return model


@pytest.mark.parametrize("dtype,inplace", [(torch.bfloat16, True), (torch.bfloat16, False), (None, False)],
                         ids=["bf16-inplace", "bf16-copy", "fp32-copy"])
def test_aliased_parameters_are_refused_where_the_alias_would_be_lost(dtype, inplace):
    model = aliased_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"parameters '0.weight', '1.weight' are distinct Parameters sharing one "
                                         r"storage"):
        ipex_train.optimize(model, opt, dtype=dtype, inplace=inplace)
    unchanged(before, model, opt)
    assert model[0].weight.data_ptr() == model[1].weight.data_ptr()


def test_aliased_parameters_keep_the_alias_in_fp32_inplace():
    model = aliased_model()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), inplace=True)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert model[0].weight.data_ptr() == model[1].weight.data_ptr()


def _sycl():
    need_sycl_device()


def conv_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


def test_sycl_with_explicit_channels_last_is_refused():
    _sycl()
    model = conv_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="auto_channels_last=True cannot apply with the SYCL step"):
        ipex_train.optimize(model, opt, sycl=True, auto_channels_last=True)
    unchanged(before, model, opt)


def test_sycl_says_conv_weights_stay_contiguous(caplog):
    _sycl()
    model = conv_model()
    with caplog.at_level(logging.INFO, logger="ipex_train"):
        model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), sycl=True)
    assert "conv weights stay contiguous" in caplog.text
    assert model[0].weight.is_contiguous()
