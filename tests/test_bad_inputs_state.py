"""Bad optimizer state, in a checkpoint or edited by hand: never made up, refused naming the key, and a refused
load or step changes nothing. Add a case by adding a parameter to the lists below."""
import copy
import math

import pytest
import torch
from torch import nn

import ipex_train
from ipex_train.optim import Lamb, Lars

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3)),
    "amsgrad": (torch.optim.Adam, dict(lr=1e-3, amsgrad=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "lamb": (Lamb, dict(lr=1e-3)),
    "lars": (Lars, dict(lr=0.1)),
}


def trained(name="adamw", state_dtype=None, steps=2, optimize=True, nonfinite_grads=None):
    """A (model, optimizer) pair after ``steps`` steps; parameter 0 is a 64x128 weight (int8/bf16 state applies)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4))
    cls, hyper = OPTIMIZERS[name]
    opt = cls(model.parameters(), **hyper)
    if optimize:
        model, opt = ipex_train.optimize(model, opt, optimizer_state_dtype=state_dtype,
                                         nonfinite_grads=nonfinite_grads)
    for i in range(steps):
        step(model, opt, seed=i)
    return model, opt


def step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 128, generator=g)).square().mean().backward()
    opt.step()


def snapshot(model, opt):
    """Everything a refused call must leave as it was: parameter values and the optimizer's state_dict."""
    return copy.deepcopy((model.state_dict(), opt.state_dict()))


def assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        sa, sb = oa["state"][i], ob["state"][i]
        assert sa.keys() == sb.keys(), i
        for k in sa:
            va, vb = sa[k], sb[k]
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), (i, k)


def checkpoint(opt):
    """A checkpoint as it comes back from disk: nothing shared with the live optimizer."""
    return copy.deepcopy(opt.state_dict())


# (optimizer, key removed from parameter 0's entry, through optimize() or as ipex_train's own optimizer alone)
MISSING = [("adamw", "exp_avg_sq"), ("adamw", "exp_avg"), ("adamw", "step"), ("amsgrad", "max_exp_avg_sq"),
           ("adagrad", "sum"), ("adagrad", "step"), ("lamb", "exp_avg_sq"), ("lamb", "step")]
MISSING = [(n, k, True) for n, k in MISSING] + [("lamb", "exp_avg_sq", False), ("lamb", "step", False)]


@pytest.mark.parametrize("name,key,optimize", MISSING,
                         ids=[f"{n}-{k}" + ("" if o else "-plain") for n, k, o in MISSING])
def test_missing_state_is_refused_at_load(name, key, optimize):
    model, opt = trained(name, optimize=optimize)
    ck = checkpoint(opt)
    del ck["state"][0][key]
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"state\[0\] holds .* but not '{key}'"):
        opt.load_state_dict(ck)
    assert_same(before, snapshot(model, opt))
    step(model, opt, seed=5)  # the optimizer keeps stepping from its own state


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_wrong_shape_state_is_refused_at_load_and_changes_nothing(state_dtype):
    model, opt = trained("adamw", state_dtype)
    twin_model, twin = trained("adamw", state_dtype)
    ck = checkpoint(opt)
    ck["state"][0]["exp_avg"] = torch.zeros(7, 3)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] is of shape \(7, 3\); expected .* \(64, 128\)"):
        opt.load_state_dict(ck)
    assert_same(before, snapshot(model, opt))
    step(model, opt, seed=5)
    step(twin_model, twin, seed=5)
    assert_same(snapshot(twin_model, twin), snapshot(model, opt))


@pytest.mark.parametrize("bad", [-5, float("nan"), math.inf, "3", torch.tensor([1.0, 2.0]), True],
                         ids=["negative", "nan", "inf", "str", "two_elements", "bool"])
def test_bad_step_count_is_refused_at_load(bad):
    model, opt = trained("adamw")
    ck = checkpoint(opt)
    ck["state"][0]["step"] = bad
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"state\[0\]\['step'\] is .*finite number >= 0"):
        opt.load_state_dict(ck)
    assert_same(before, snapshot(model, opt))


def test_non_tensor_state_is_refused_at_load():
    _, opt = trained("adamw")
    ck = checkpoint(opt)
    ck["state"][0]["exp_avg_sq"] = [0.0] * 8
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg_sq'\] is a list"):
        opt.load_state_dict(ck)


def test_fresh_entry_loads_and_starts_afresh():
    """An empty entry is a parameter that has not stepped: allowed, its state is created at its first step."""
    model, opt = trained("adamw")
    ck = checkpoint(opt)
    ck["state"][0] = {}
    opt.load_state_dict(ck)
    step(model, opt, seed=5)
    assert float(opt.state[model[0].weight]["step"]) == 1
    assert float(opt.state[model[0].bias]["step"]) == 3


def test_sgd_without_momentum_buffer_starts_from_the_grad_as_torch_does():
    model, opt = trained("sgd")
    ref_model, ref = trained("sgd", optimize=False)
    for o in (opt, ref):
        ck = checkpoint(o)
        del ck["state"][0]["momentum_buffer"]
        o.load_state_dict(ck)
    step(model, opt, seed=5)
    step(ref_model, ref, seed=5)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_missing_state_edited_by_hand_is_refused_at_step():
    model, opt = trained("adamw")
    del opt.state[model[0].weight]["exp_avg_sq"]
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"parameter 0 of its param group holds .* but not 'exp_avg_sq'"):
        step(model, opt)
    assert_same(before, snapshot(model, opt))  # no step counted, nothing created


def test_amsgrad_switched_on_after_steps_is_refused_at_step():
    """torch's Adam raises KeyError for the max_exp_avg_sq it never created; a zero one would be made up."""
    model, opt = trained("adamw")
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="but not 'max_exp_avg_sq'"):
        step(model, opt)


@pytest.mark.parametrize("state_dtype,match", [
    (None, r"exp_avgs\[0\] has shape \(7, 3\) but params\[0\] has shape \(64, 128\)"),
    ("int8", r"parameter 0 of its param group: 'exp_avg' \(torch.float32, shape \(7, 3\)\) cannot be stored as int8 "
             r"state of a parameter of shape \(64, 128\)")], ids=["fp32", "int8"])
def test_wrong_shape_state_edited_by_hand_is_refused_at_step(state_dtype, match):
    model, opt = trained("adamw", state_dtype)
    opt.state[model[0].weight]["exp_avg"] = torch.zeros(7, 3)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        step(model, opt)
    assert_same(before, snapshot(model, opt))  # no step counted


def test_refused_step_counts_no_step():
    """A step refused by the kernel checks (a negative count, then a state tensor of the wrong dtype, both set by
    hand) leaves the counters and the state as they were, however often it is retried."""
    model, opt = trained("adamw")
    state = opt.state[model[0].weight]
    state["step"] = torch.tensor(-5.0)
    for _ in range(2):
        with pytest.raises(ValueError, match="state_steps"):
            step(model, opt)
    assert float(state["step"]) == -5
    state["step"] = torch.tensor(2.0)
    state["exp_avg"] = state["exp_avg"].double()
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] has dtype torch.float64"):
        step(model, opt)
    assert_same(before, snapshot(model, opt))


def test_refused_first_step_creates_no_state():
    model = nn.Linear(64, 64)
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()))
    opt.state[model.bias].update(step=torch.tensor(1.0), exp_avg=torch.zeros(64, dtype=torch.float64),
                                 exp_avg_sq=torch.zeros(64))
    model(torch.randn(2, 64)).sum().backward()
    with pytest.raises(TypeError, match=r"exp_avgs\[1\] has dtype torch.float64"):
        opt.step()
    assert not opt.state[model.weight] and float(opt.state[model.bias]["step"]) == 1


def test_int8_state_nan_grad_poisons_its_block():
    """Documented (docs/bad_inputs.md), with the non-finite-gradient guard off: int8 state keeps one scale per block
    of 256 elements, so a NaN grad element makes its whole block of state NaN, and the next step turns the block's
    256 weights NaN, where fp32 state (as torch) keeps it to that one element. The other blocks stay finite. (With
    the guard on, the default, that step is skipped: tests/test_nonfinite_guard.py.)"""
    nans = {}
    for state_dtype in (None, "int8"):
        model, opt = trained("adamw", state_dtype, steps=1, nonfinite_grads="off")
        w = model[0].weight
        g = torch.Generator().manual_seed(3)
        for bad in (True, False):  # one step with a NaN grad element, then a clean one
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 1e-3
            if bad:
                w.grad[3, 5] = float("nan")
            opt.step()
        nans[state_dtype] = torch.isnan(w.detach()).flatten()
    assert nans[None].sum() == 1 and nans[None][3 * 128 + 5]
    block = (3 * 128 + 5) // 256
    assert nans["int8"].view(-1, 256)[block].all() and nans["int8"].sum() == 256
