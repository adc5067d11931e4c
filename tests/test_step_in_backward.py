"""optimize(step_in_backward=True): each parameter stepped inside backward, against the normal step."""
import copy

import pytest
import torch
from torch import nn

import ipex_train
from ipex_train.optim import Lamb, Lars

STEPS = 3
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "lamb": (Lamb, dict(lr=1e-2, weight_decay=1e-2)),
    "lars": (Lars, dict(lr=1e-1, momentum=0.9)),
    "rmsprop (no fused step)": (torch.optim.RMSprop, dict(lr=1e-3)),
}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 5))


def batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def train(model, opt, data, scheduler=None):
    for x, y in data:
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def pair(name, dtype, **kwargs):
    """(model, optimizer) optimized normally and the same with step_in_backward=True."""
    cls, hyper = OPTIMIZERS[name]
    out = []
    for release in (False, True):
        model = make_model()
        out.append(ipex_train.optimize(model, cls(model.parameters(), **hyper), dtype=dtype,
                                       step_in_backward=release, **kwargs))
    return out


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "split_bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bit_identical_to_the_normal_step(name, dtype):
    # The same per-element math on the same values: one parameter per kernel call changes nothing (Lamb's and
    # Lars' norms are per tensor).
    (model, opt), (rmodel, ropt) = pair(name, dtype)
    data = batches()
    train(model, opt, data)
    train(rmodel, ropt, data)
    assert_same(model, rmodel)
    assert_same_state(opt, ropt)
    assert all(p.grad is None for p in rmodel.parameters())


def assert_same_state(opt, ropt):
    sa, sb = opt.state_dict()["state"], ropt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key, value in sa[i].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[i][key])), (i, key)


def test_bf16_masters_and_scheduler():
    (model, opt), (rmodel, ropt) = pair("adamw", torch.bfloat16, split_master_weight_for_bf16=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ropt)]
    data = batches(4)
    train(model, opt, data, scheds[0])
    train(rmodel, ropt, data, scheds[1])
    assert ropt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
    assert_same(model, rmodel)


def test_grads_released_during_backward():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), dtype=torch.bfloat16,
                                     step_in_backward=True)
    seen = []
    last = model[-1].weight
    # When the first layer's grad arrives, the last layer has been stepped and its grad freed already.
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(last.grad))
    before = copy.deepcopy(model.state_dict())
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    assert seen == [None]
    assert all(p.grad is None for p in model.parameters())
    assert not torch.equal(before["5.weight"], model.state_dict()["5.weight"])  # stepped by backward alone
    after = copy.deepcopy(model.state_dict())
    assert opt.step() is None
    opt.zero_grad()
    assert all(torch.equal(after[k], v) for k, v in model.state_dict().items())  # step() stepped nothing


@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
def test_clipping_is_refused_while_stepping_in_backward(clip):
    model = make_model()
    other = torch.nn.Linear(3, 2)
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), step_in_backward=True)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    for fn in (getattr(torch.nn.utils, clip), getattr(torch.nn.utils.clip_grad, clip)):
        with pytest.raises(RuntimeError, match=rf"{clip}: these parameters are stepped inside backward.*"
                                               r"set_step_in_backward\(False\)"):
            fn(model.parameters(), 1.0)
    # Other parameters clip as before; so do these once the mode is off.
    other(torch.ones(1, 3)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0) > 0
    opt.set_step_in_backward(False)
    loss_of(model, x, y).backward()
    getattr(torch.nn.utils, clip)(model.parameters(), 1e-3)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (grads.norm() if clip == "clip_grad_norm_" else grads.abs().max()) <= 1e-3 * (1 + 1e-5)


def test_step_with_closure_returns_loss():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), step_in_backward=True)
    x, y = batches(1)[0]

    def closure():
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert opt.step(closure) < first


def test_state_dict_loads_into_vanilla_torch():
    model, opt = pair("adamw", torch.bfloat16)[1]
    train(model, opt, batches())
    plain = make_model()
    plain.load_state_dict(model.state_dict())
    vanilla = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=1e-2)
    vanilla.load_state_dict(opt.state_dict())
    assert vanilla.state[plain[0].weight]["exp_avg"].dtype == torch.float32
    # And back: a release optimizer resumes from a vanilla checkpoint exactly as a normal one does.
    model2, opt2 = pair("adamw", torch.bfloat16)[1]
    model2.load_state_dict(plain.state_dict())
    opt2.load_state_dict(copy.deepcopy(vanilla.state_dict()))
    model3, opt3 = pair("adamw", torch.bfloat16)[0]
    model3.load_state_dict(plain.state_dict())
    opt3.load_state_dict(copy.deepcopy(vanilla.state_dict()))
    train(model2, opt2, batches())
    train(model3, opt3, batches())
    assert_same(model2, model3)


def test_turn_off_and_on():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), step_in_backward=True)
    assert opt.step_in_backward
    opt.set_step_in_backward(False)
    assert not opt.step_in_backward
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks gone: torch's behaviour
    opt.step()
    opt.zero_grad()
    opt.set_step_in_backward(True)
    loss_of(model, x, y).backward()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="enabled"):
        opt.set_step_in_backward(1)


def test_added_param_group_is_stepped_in_backward():
    model = make_model()
    head = model[-1]
    body = [p for m in list(model)[:-1] for p in m.parameters()]
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(body), step_in_backward=True, inplace=True)
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.5})
    before = head.weight.detach().clone()
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    assert head.weight.grad is None and not torch.equal(before, head.weight)


def test_second_backward_before_step_is_refused():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), step_in_backward=True)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        loss_of(model, x, y).backward()


def test_grads_at_step_are_refused():
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), step_in_backward=True)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(RuntimeError, match="have a .grad at optimizer.step"):
        opt.step()


def test_refusals():
    model = make_model()
    with pytest.raises(ValueError, match="LBFGS cannot step inside backward"):
        ipex_train.optimize(model, torch.optim.LBFGS(model.parameters()), step_in_backward=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="needs an optimizer"):
        ipex_train.optimize(make_model().eval(), step_in_backward=True)
    with pytest.raises(TypeError, match="step_in_backward"):
        ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), step_in_backward="yes please")


def test_config_field():
    cfg = ipex_train.OptimizeConfig.from_env({"IPEX_TRAIN_STEP_IN_BACKWARD": "1"})
    assert cfg.step_in_backward is True and cfg.to_dict()["step_in_backward"] is True
    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    assert opt.step_in_backward
    assert "SGD: fused sgd step inside backward" in str(ipex_train.summary(model, opt))
    assert ipex_train.summary(model, opt).to_dict()["step_in_backward"] is True


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"], ids=["bf16_state", "int8_state"])
@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb", "lars"])
def test_reduced_state_with_split_bf16(name, state_dtype):
    # Reduced-byte state in this mode, on split bf16 weights. int8 state rounds to nearest: every bit as the normal
    # step. bf16 state rounds stochastically with a key counted per fused call (one per parameter here, one per
    # group there): other draws. Where a second moment is tiny, another draw moves an Adam-style update by a good
    # part of lr, so each weight may differ by up to one lr (measured: at most 0.6 lr) and the mean difference stays
    # below lr / 100 (measured: at most 0.002 lr).
    cls, hyper = OPTIMIZERS[name]
    runs = []
    for release in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 512), nn.ReLU(), nn.Linear(512, 5))  # 6144 elements: reduced state
        runs.append(ipex_train.optimize(model, cls(model.parameters(), **hyper), dtype=torch.bfloat16,
                                        step_in_backward=release, optimizer_state_dtype=state_dtype))
    (model, opt), (rmodel, ropt) = runs
    data = batches()
    train(model, opt, data)
    train(rmodel, ropt, data)
    assert all(p.grad is None for p in rmodel.parameters())
    key = "momentum_buffer" if name in ("sgd", "lars") else "exp_avg"
    assert ropt.state[rmodel[0].weight][key].dtype == (torch.bfloat16 if state_dtype is torch.bfloat16 else torch.int8)
    if state_dtype == "int8":
        assert_same(model, rmodel)
        assert_same_state(opt, ropt)
    else:
        diff = torch.cat([(b.float() - a.float()).abs().flatten() for a, b in zip(model.parameters(),
                                                                                   rmodel.parameters())])
        assert diff.max() <= hyper["lr"] and diff.mean() <= hyper["lr"] / 100, (diff.max(), diff.mean())


def test_norm_query_without_clipping_is_allowed(caplog):
    # clip_grad_norm_ with max_norm=inf clips nothing (trainers log grad_norm this way): it runs, sees no grads,
    # and says once that the norm it returns is not the gradient's.
    from ipex_train.training import step_in_backward as _release

    model = make_model()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), step_in_backward=True)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    _release._warn_norm_query.cache_clear()
    with caplog.at_level("WARNING", logger="ipex_train"):
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) == 0
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")) == 0
    assert sum("already freed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), float("inf"))


def test_heap_released_while_the_first_step_creates_state(monkeypatch):
    # The first backward creates each parameter's state between grads freed at once; the holes they leave in the C
    # heap are given back as each state appears (ipex_train.base.heap), and later steps, which create none, skip it.
    from ipex_train.base import heap as _heap
    from ipex_train.training import step_in_backward as _step_in_backward

    calls = []
    monkeypatch.setattr(_step_in_backward._heap, "release_free_memory", lambda: calls.append(1) or True)
    model = make_model()
    n = len(list(model.parameters()))
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), dtype=torch.bfloat16,
                                     step_in_backward=True, optimizer_state_dtype="int8")
    data = batches(2)
    train(model, opt, data[:1])
    assert len(calls) == n
    train(model, opt, data[1:])
    assert len(calls) == n
    monkeypatch.undo()
    assert isinstance(_heap.release_free_memory(), bool)
