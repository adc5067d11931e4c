"""Reduced-byte optimizer state (``state_dtype``) under torch.optim's semantics: checkpoints loaded across formats
(and from vanilla torch), the rounding seed, add_param_group, LR schedulers, closures and zero_grad."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from test_state_formats import _mlp, _train

import ipex_train
from ipex_train.optim import state_formats as sf

# fp32 state, bf16, int8: what optimize(optimizer_state_dtype=...) takes, and the state dtype of a big weight.
FORMATS = {"fp32": (None, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16), "int8": ("int8", torch.int8)}


def _optimized(fmt: str, dtype=torch.bfloat16, opt_class=torch.optim.AdamW, **hyper):
    model = _mlp()  # model[0].weight: 8192 elements, reduced; the rest keeps fp32 state (small)
    opt = opt_class(model.parameters(), lr=1e-2, **hyper)
    return ipex_train.optimize(model, opt, dtype=dtype, optimizer_state_dtype=FORMATS[fmt][0])


@pytest.mark.parametrize("dst", list(FORMATS))
@pytest.mark.parametrize("src", ["vanilla", *FORMATS])
def test_load_keeps_the_loading_optimizers_format(src, dst):
    # The checkpoint holds fp32 state whatever it was saved from; the optimizer loading it keeps the format it was
    # created with (torch's load replaces the group dicts with the checkpoint's, state_dtype key included or not).
    if src == "vanilla":
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model, opt = _optimized(src)
    _train(model, opt)
    sd = opt.state_dict()
    model2, opt2 = _optimized(dst)
    opt2.load_state_dict(copy.deepcopy(sd))
    assert all(g.get(sf.GROUP_KEY) == FORMATS[dst][0] for g in opt2.param_groups)
    big = model2[0].weight
    for key in ("exp_avg", "exp_avg_sq"):
        got = opt2.state[big][key]
        want = torch.uint8 if (key, dst) == ("exp_avg_sq", "int8") else FORMATS[dst][1]
        assert got.dtype == want, key  # encoded at load, before any step
        saved = sd["state"][0][key]
        # What the loading optimizer stores is the checkpoint's fp32 state in its own format.
        torch.testing.assert_close(sf.decode(got, big), sf.decode(sf.convert(saved, big, sf.wanted(
            opt2.param_groups[0], big), key == "exp_avg"), big), rtol=0, atol=0)
    assert opt2.state[model2[0].bias]["exp_avg"].dtype == torch.float32
    model2.load_state_dict(model.state_dict())
    _train(model2, opt2, seed=3)
    assert opt2.state[big]["exp_avg"].dtype == FORMATS[dst][1]


@pytest.mark.parametrize("dst", ["bf16", "int8"])
def test_lamb_loads_an_fp32_checkpoint_into_its_own_format(dst):
    lin = nn.Linear(100, 100)
    src = ipex_train.optim.Lamb(lin.parameters(), lr=1e-2)
    lin.weight.grad, lin.bias.grad = torch.randn(100, 100), torch.randn(100)
    src.step()
    lamb = ipex_train.optim.Lamb(lin.parameters(), lr=1e-2, state_dtype=FORMATS[dst][0])
    lamb.load_state_dict(src.state_dict())
    assert lamb.state[lin.weight]["exp_avg"].dtype == FORMATS[dst][1]
    fp32 = ipex_train.optim.Lamb(lin.parameters(), lr=1e-2)
    fp32.load_state_dict(lamb.state_dict())
    assert fp32.state[lin.weight]["exp_avg"].dtype == torch.float32
    assert sf.GROUP_KEY not in fp32.param_groups[0]


def _seeded_run(seed: int | None):
    model = _mlp()
    group = {"params": list(model.parameters())}
    if seed is not None:
        group[sf.SEED_KEY] = seed
    model, opt = ipex_train.optimize(model, torch.optim.AdamW([group], lr=1e-2), dtype=torch.bfloat16,
                                     optimizer_state_dtype=torch.bfloat16)
    _train(model, opt, steps=2)
    return model, opt


def test_stochastic_rounding_is_reproducible_from_the_group_seed():
    def state(opt, model):
        return opt.state[model[0].weight]["exp_avg"].view(torch.int16)

    (m1, o1), (m2, o2), (m3, o3) = _seeded_run(5), _seeded_run(5), _seeded_run(6)
    assert torch.equal(state(o1, m1), state(o2, m2))  # same seed, same bits
    assert not torch.equal(state(o1, m1), state(o3, m3))  # another seed, other draws
    assert o1.param_groups[0][sf.ROUNDS_KEY] == 2
    # The seed and the rounding count travel with the checkpoint, so a resumed run draws as the original does.
    model, opt = _seeded_run(None)
    assert opt.param_groups[0].get(sf.SEED_KEY) is None
    opt.load_state_dict(copy.deepcopy(o1.state_dict()))
    model.load_state_dict(m1.state_dict())
    assert opt.param_groups[0][sf.SEED_KEY] == 5 and opt.param_groups[0][sf.ROUNDS_KEY] == 2
    _train(model, opt, seed=9)
    _train(m1, o1, seed=9)
    assert torch.equal(state(opt, model), state(o1, m1))
    # A checkpoint without a seed (vanilla torch's) leaves the optimizer's own.
    vanilla = torch.optim.AdamW(_mlp().parameters(), lr=1e-2)
    seeded = _seeded_run(7)[1]
    seeded.load_state_dict(vanilla.state_dict())
    assert seeded.param_groups[0][sf.SEED_KEY] == 7


def test_add_param_group_takes_the_format_and_checks_it():
    model = _mlp()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model[0].parameters(), lr=1e-2), inplace=True,
                                     optimizer_state_dtype="int8")
    big, kept = nn.Linear(100, 100), nn.Linear(100, 100)
    opt.add_param_group({"params": list(big.parameters())})  # optimize's choice is the default of a new group
    opt.add_param_group({"params": list(kept.parameters()), "state_dtype": torch.float32})
    for bad in ("int4", torch.float16):
        with pytest.raises(ValueError, match="add_param_group.*'state_dtype'"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(5000))], "state_dtype": bad})
    assert len(opt.param_groups) == 3
    opt.zero_grad()
    x = torch.randn(4, 100)
    (model(torch.randn(4, 64)).sum() + big(x).sum() + kept(x).sum()).backward()
    opt.step()
    assert opt.state[big.weight]["exp_avg"].dtype == torch.int8
    assert opt.state[kept.weight]["exp_avg"].dtype == torch.float32
    # An optimizer without a fused step cannot keep reduced state: refused when the group is added, not ignored.
    model = _mlp()
    model, rms = ipex_train.optimize(model, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="add_param_group.*needs the fused step"):
        rms.add_param_group({"params": list(big.parameters()), "state_dtype": "int8"})
    assert len(rms.param_groups) == 1
    # Lamb/Lars check a group's key when constructed, naming it.
    with pytest.raises(ValueError, match="Lars: param group key 'state_dtype'"):
        ipex_train.optim.Lars([{"params": list(big.parameters()), "state_dtype": "int4"}])


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_scheduler_closure_and_zero_grad(fmt):
    model, opt = _optimized(fmt, opt_class=torch.optim.SGD, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1], gamma=0.0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor) and opt.state[model[0].weight]["momentum_buffer"].dtype == FORMATS[fmt][1]
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    momentum = sf.decode(opt.state[model[0].weight]["momentum_buffer"], model[0].weight).clone()
    opt.step(closure)  # lr 0 from the scheduler: the step reads the group's lr, so nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not torch.equal(momentum, sf.decode(opt.state[model[0].weight]["momentum_buffer"], model[0].weight))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.step()  # zero grads: steps, no error


def test_optimize_again_in_place_applies_the_state_dtype():
    # optimize(inplace=True) on a pair it returned changes nothing else, but the state format asked for applies.
    model, opt = _optimized("fp32")
    _train(model, opt)
    same_model, same_opt = ipex_train.optimize(model, opt, inplace=True, optimizer_state_dtype="int8")
    assert same_opt is opt and same_model is model
    _train(model, opt)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.int8
