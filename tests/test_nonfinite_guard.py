"""The non-finite-gradient guard (optimize(nonfinite_grads=...)): a step with NaN/Inf grads changes nothing."""
import copy
import logging

import pytest
import torch
from torch import nn

import ipex_train
from ipex_train.base import ops as _ops

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop (unfused)": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


def make_model():
    torch.manual_seed(0)
    # 96 x 64 > MIN_NUMEL: the first layer's state can be int8.
    return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.ReLU(), nn.Linear(96, 5))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    return loss.item()


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    for pid, st in oa["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][pid][key])), (pid, key)


def poison(model, value=float("nan")):
    """A backward whose grads hold ``value`` in one element of the first layer's weight."""
    x, y = batches(1, seed=7)[0]
    nn.functional.cross_entropy(model(x).float(), y).backward()
    model[0].weight.grad[3, 4] = value


@pytest.mark.parametrize("name, state_dtype", [(name, None) for name in OPTIMIZERS] + [("adamw", "int8"),
                                                                                       ("sgd", "int8")])
def test_nonfinite_step_changes_nothing_and_is_counted(name, state_dtype, caplog):
    model = make_model()
    model, opt = ipex_train.optimize(model, OPTIMIZERS[name](model.parameters()), dtype=torch.bfloat16,
                                     optimizer_state_dtype=state_dtype)
    for x, y in batches(3):
        step(model, opt, x, y)
    before = snapshot(model, opt)
    with caplog.at_level(logging.WARNING, logger="ipex_train"):
        for value in (float("nan"), float("inf")):
            opt.zero_grad()
            poison(model, value)
            opt.step()
    same(before, snapshot(model, opt))
    warnings = [r for r in caplog.records if "NaN or Inf" in r.getMessage()]
    assert len(warnings) == 1 and "'0.weight'" in warnings[0].getMessage()  # logged once, with the name
    got = ipex_train.summary(model, opt)
    assert (got.nonfinite_grads, got.nonfinite_skipped_steps) == ("skip", 2)
    assert "2 steps and 0 parameter steps skipped" in str(got)
    step(model, opt, *batches(1, seed=3)[0])  # the next good step steps
    assert not torch.equal(before[0]["0.weight"], model.state_dict()["0.weight"])
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_guard_off_lets_nan_in():
    # What the guard prevents: without it one NaN grad reaches the weights.
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=torch.bfloat16,
                                     nonfinite_grads="off")
    poison(model)
    opt.step()
    assert torch.isnan(model.state_dict()["0.weight"]).any()
    assert ipex_train.summary(model, opt).nonfinite_grads is None


def test_raise_names_the_parameter_and_changes_nothing():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     config=ipex_train.OptimizeConfig(dtype=torch.bfloat16, nonfinite_grads="raise"))
    step(model, opt, *batches(1)[0])
    before = snapshot(model, opt)
    opt.zero_grad()
    poison(model)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\): the gradient of '0.weight' holds NaN or Inf"):
        opt.step()
    same(before, snapshot(model, opt))


def test_step_in_backward_skips_the_bad_parameter_only():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=torch.bfloat16,
                                     step_in_backward=True)
    step(model, opt, *batches(1)[0])
    before = copy.deepcopy(model.state_dict())
    x, y = batches(1, seed=5)[0]
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.step()
    after = model.state_dict()
    assert torch.equal(before["0.weight"], after["0.weight"])  # its grad was NaN: not stepped
    assert not torch.equal(before["3.weight"], after["3.weight"])  # the others were
    got = ipex_train.summary(model, opt)
    assert (got.nonfinite_skipped_steps, got.nonfinite_skipped_parameters) == (0, 1)


def test_a_nan_batch_mid_run_is_as_if_it_was_left_out():
    # The skipped step leaves weights, state and step counters alone, so training goes on exactly as without it.
    data = batches(12)
    bad = (data[6][0].clone(), data[6][1])
    bad[0][0, 0] = float("nan")  # one NaN "pixel"
    runs = []
    for with_bad in (True, False):
        model = make_model()
        model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                         dtype=torch.bfloat16, optimizer_state_dtype="int8")
        losses = [step(model, opt, x, y) for x, y in (data[:6] + [bad] + data[6:] if with_bad else data)]
        runs.append((losses, snapshot(model, opt)))
        assert ipex_train.summary(model, opt).nonfinite_skipped_steps == (1 if with_bad else 0)
    (with_losses, with_state), (without_losses, without_state) = runs
    same(with_state, without_state)
    assert with_losses[-1] == without_losses[-1]


def test_environment_and_config_spellings(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_NONFINITE_GRADS", "Raise")
    assert ipex_train.OptimizeConfig.from_env().nonfinite_grads == "raise"
    assert ipex_train.OptimizeConfig(nonfinite_grads="skip").nonfinite_grads is None
    with pytest.raises(ValueError, match="nonfinite_grads='never' is not accepted; use one of auto, skip, raise, off"):
        ipex_train.OptimizeConfig(nonfinite_grads="never")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_first_nonfinite_finds_every_position(dtype):
    base = [torch.zeros(5, dtype=dtype), torch.ones(300_001, dtype=dtype), torch.zeros(0, dtype=dtype)]
    assert _ops.first_nonfinite(base) == -1
    for where in (0, 150_000, 300_000):
        for value in (float("nan"), float("inf"), -float("inf")):
            ts = [t.clone() for t in base]
            ts[1][where] = value
            assert _ops.first_nonfinite(ts) == 1
    big = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max], dtype=dtype)
    assert _ops.first_nonfinite([big]) == -1  # the largest finite values are finite


def test_first_nonfinite_layouts():
    t = torch.zeros(4, 6, 5, 5).to(memory_format=torch.channels_last)
    t[1, 2, 3, 4] = float("nan")
    assert _ops.first_nonfinite([torch.zeros(3), t]) == 1
    strided = torch.zeros(10, 10)[:, ::3]
    strided[9, 3] = float("inf")
    assert _ops.first_nonfinite([strided]) == 0
    assert _ops.first_nonfinite([torch.zeros(3, dtype=torch.int64)]) == -1
