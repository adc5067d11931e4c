"""ipex_train.optim.Lamb and Lars as torch.optim optimizers: fused vs reference, state_dict, closures, zero_grad,
argument checks, the fused=None fallback, and LR schedulers."""
from __future__ import annotations

import copy

import pytest
import torch

from ipex_train.optim import Lamb, Lars

OPTIMIZERS = {
    "lamb": (Lamb, dict(lr=1e-2, betas=(0.85, 0.99), eps=1e-6, weight_decay=1e-2)),
    "lars": (Lars, dict(lr=0.1, momentum=0.9, weight_decay=1e-3, eeta=1e-2, epsilon=1e-8)),
}
# the second group overrides one hyper-parameter of each optimizer
GROUP2 = {"lamb": dict(lr=3e-3, bias_correction=False, weight_decay=0.0), "lars": dict(lr=0.02, momentum=0.5)}
SHAPES = ((17,), (31, 33), (4, 3, 5, 7), (70_001,))
# Fused and reference differ only in the norms (fp32 lane sums vs double), a relative 1e-6 of the update at most.
TOL = dict(rtol=1e-6, atol=1e-6)


def make_params(dtype=torch.float32, seed=0, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def grads_for(params, seed) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def build(name, params, fused, groups=True):
    cls, hp = OPTIMIZERS[name]
    if groups:
        half = len(params) // 2
        params = [{"params": params[:half]}, {"params": params[half:], **GROUP2[name]}]
    return cls(params, fused=fused, **hp)


def run_steps(opt, params, steps, seed=100):
    for s in range(steps):
        for p, g in zip(params, grads_for(params, seed + s)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_matches_reference_with_param_groups(name, dtype, variant):
    a, b = make_params(dtype), make_params(dtype)
    opt_a, opt_b = build(name, a, fused=True), build(name, b, fused=False)
    run_steps(opt_a, a, 5)
    run_steps(opt_b, b, 5)
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, **tol)
        for key, value in opt_b.state[pb].items():
            torch.testing.assert_close(opt_a.state[pa][key], value, **tol)
    # the groups really differ: the same start and grads end elsewhere under the other group's settings
    c = make_params(dtype)
    run_steps(build(name, c, fused=True, groups=False), c, 5)
    assert not torch.equal(c[-1], a[-1])


@pytest.mark.parametrize("fused", (True, False))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_round_trip_continues_identically(name, fused):
    params = make_params()
    opt = build(name, params, fused)
    run_steps(opt, params, 3)
    saved = copy.deepcopy(opt.state_dict())

    clones = [p.detach().clone().requires_grad_() for p in params]
    restored = build(name, clones, fused)
    restored.load_state_dict(saved)
    run_steps(opt, params, 3, seed=200)
    run_steps(restored, clones, 3, seed=200)
    for p, q in zip(params, clones):
        assert torch.equal(p, q)
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer" if name == "lars" else "exp_avg"],
                       restored.state_dict()["state"][0]["momentum_buffer" if name == "lars" else "exp_avg"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_moves_between_fused_and_reference(name):
    # Both paths keep the same state (torch.optim's names and dtypes), so a checkpoint taken with one continues
    # under the other.
    params = make_params()
    opt = build(name, params, fused=True)
    run_steps(opt, params, 3)
    clones = [p.detach().clone().requires_grad_() for p in params]
    other = build(name, clones, fused=False)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    run_steps(opt, params, 2, seed=300)
    run_steps(other, clones, 2, seed=300)
    for p, q in zip(params, clones):
        torch.testing.assert_close(p, q, **TOL)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_closure(name):
    w = torch.randn(5, 3, requires_grad=True)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    opt = build(name, [w], fused=True, groups=False)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        return loss

    before = w.detach().clone()
    loss = opt.step(closure)
    assert calls == [True]  # called once, with grad enabled although step runs under no_grad
    assert torch.equal(loss, ((x @ before - y) ** 2).mean())
    assert not torch.equal(w, before)


@pytest.mark.parametrize("fused", (True, False))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_grad_set_to_none_skips_params(name, fused):
    params = make_params(shapes=((6,), (7,)))
    opt = build(name, params, fused, groups=False)
    run_steps(opt, params, 1)
    opt.zero_grad()  # set_to_none=True by default: no grad, so the next step leaves the params alone
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for i, st in state_before.items():
        for key, value in st.items():
            assert torch.equal(opt.state_dict()["state"][i][key], value)
    # only the param with a grad moves, and only its state is created
    fresh = make_params(shapes=((6,), (7,)), seed=1)
    opt2 = build(name, fresh, fused, groups=False)
    fresh[0].grad = torch.randn(6)
    before = fresh[1].detach().clone()
    opt2.step()
    assert torch.equal(fresh[1], before) and fresh[1] not in opt2.state and fresh[0] in opt2.state


@pytest.mark.parametrize("fused", (True, False))
def test_zero_grad_to_zeros_still_steps(fused):
    # set_to_none=False leaves zero grads: Lamb still runs (step counts advance, weight decay moves the params).
    params = make_params(shapes=((6,), (7,)))
    opt = build("lamb", params, fused, groups=False)
    run_steps(opt, params, 1)
    opt.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(float(opt.state[p]["step"]) == 2 for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("cls,kwargs,match", [
    (Lamb, dict(lr=-1.0), r"lr must be a number >= 0, got -1.0"),
    (Lamb, dict(eps=-1e-8), r"eps must be"),
    (Lamb, dict(weight_decay=-0.1), r"weight_decay must be"),
    (Lamb, dict(lr=float("nan")), r"lr must be"),
    (Lamb, dict(lr="0.1"), r"lr must be"),
    (Lamb, dict(betas=(1.0, 0.9)), r"betas must be a pair of numbers in \[0, 1\)"),
    (Lamb, dict(betas=(0.9, -0.1)), r"betas must be"),
    (Lamb, dict(betas=(0.9,)), r"betas must be"),
    (Lamb, dict(betas="ab"), r"betas must be"),
    (Lamb, dict(fused="x"), r"fused must be None, True or False, got 'x'"),
    (Lars, dict(lr=-0.1), r"lr must be"),
    (Lars, dict(momentum=-0.9), r"momentum must be"),
    (Lars, dict(weight_decay=-1.0), r"weight_decay must be"),
    (Lars, dict(eeta=-1e-3), r"eeta must be"),
    (Lars, dict(epsilon=-1.0), r"epsilon must be"),
    (Lars, dict(fused="yes"), r"fused must be"),
])
def test_argument_validation(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.zeros(3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_true_rejects_low_precision_params(name, dtype):
    p = torch.randn(8, dtype=dtype, requires_grad=True)
    p.grad = torch.randn(8, dtype=dtype)
    opt = build(name, [p], fused=True, groups=False)
    with pytest.raises(RuntimeError, match=r"fused=True\) takes dense CPU float32/float64.*fused=None"):
        opt.step()


def test_fused_true_rejects_sparse_grad():
    p = torch.randn(8, requires_grad=True)
    p.grad = torch.randn(8).to_sparse()
    with pytest.raises(RuntimeError, match=r"fused=True\) takes dense CPU float32/float64 parameters with dense"):
        Lamb([p], fused=True).step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_none_falls_back_to_reference_for_bf16(name):
    a = make_params(torch.bfloat16, shapes=((9,), (40, 3)))
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_a = build(name, a, fused=None, groups=False)
    opt_b = build(name, b, fused=False, groups=False)
    run_steps(opt_a, a, 3)
    run_steps(opt_b, b, 3)
    for p, q in zip(a, b):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_lr_scheduler_changes_the_lr_used(name):
    # Three copies: A follows StepLR, B keeps the initial lr, C gets A's lr written into its group by hand.
    runs = [make_params(shapes=((50,), (3, 7))) for _ in range(3)]
    opts = [build(name, p, fused=True, groups=False) for p in runs]
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.1)
    for s in range(5):
        for params in runs:
            for p, g in zip(params, grads_for(params, s)):
                p.grad = g
        for opt in opts:
            opt.step()
        sched.step()
        opts[2].param_groups[0]["lr"] = opts[0].param_groups[0]["lr"]
    assert opts[0].param_groups[0]["lr"] == pytest.approx(OPTIMIZERS[name][1]["lr"] * 0.01)
    a, b, c = runs
    assert all(torch.equal(p, q) for p, q in zip(a, c))
    assert not torch.equal(a[0], b[0])
