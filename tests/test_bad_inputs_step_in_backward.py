"""optimize(step_in_backward=True) given what it cannot do or a backward that fails: a consistent state (each
parameter stepped once per optimizer step), no stray grads, and refusals before anything changes. Add a case as a
test of its own."""
import logging

import pytest
import torch
from torch import nn

import ipex_train

X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def released(opt_class=torch.optim.SGD, model=None, **hyper):
    model = make() if model is None else model
    hyper = hyper or dict(lr=0.1)
    return ipex_train.optimize(model, opt_class(model.parameters(), **hyper), step_in_backward=True)


def fail_once(model):
    """A tensor hook on the first layer's output that raises at the first backward only."""
    calls = []

    def hook(grad):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("hook failed")

    def attach(module, args, out):
        out.register_hook(hook)

    return model[0].register_forward_hook(attach)


def sgd_by_hand(model, layers, lr=0.1):
    model.zero_grad()
    model(X).sum().backward()
    with torch.no_grad():
        for i in layers:
            for p in model[i].parameters():
                p -= lr * p.grad


def test_retry_after_a_backward_that_raised_steps_each_parameter_once():
    model, opt = released()
    handle = fail_once(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="hook failed"):
        model(X).sum().backward()
    # The last layer's grads were ready before the error and it was stepped; the first layer was not reached.
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert moved == [False, False, True, True]
    assert all(p.grad is None for p in model.parameters())
    model(X).sum().backward()  # the retry completes the step instead of being refused as a second backward
    opt.step()
    handle.remove()
    # Reference: the last layer stepped from the first attempt's grads, the first layer from the retry's.
    ref = make()
    sgd_by_hand(ref, [2])
    sgd_by_hand(ref, [0])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # The next step is a normal one: one backward, every parameter stepped, a second backward refused.
    before = [p.detach().clone() for p in model.parameters()]
    model(X).sum().backward()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        model(X).sum().backward()


def test_step_after_a_backward_that_raised_ends_the_step_and_says_so(caplog):
    model, opt = released()
    handle = fail_once(model)
    with pytest.raises(ValueError, match="hook failed"):
        model(X).sum().backward()
    with caplog.at_level(logging.WARNING, logger="ipex_train"):
        opt.step()
    assert "after a backward that raised: it had stepped 2 parameter(s)" in caplog.text
    handle.remove()
    before = [p.detach().clone() for p in model.parameters()]
    model(X).sum().backward()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_refused_second_backward_leaves_no_grad_for_step_to_blame():
    model, opt = released()
    model(X).sum().backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        model(X).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # not "grads set by hand"


def test_parameters_unfrozen_after_optimize_are_stepped_then_hooked():
    """Frozen when the hooks were made, so not hooked: step() steps them from the grads backward left (as the
    normal step would) and hooks them for the next steps."""
    results = []
    for release in (False, True):
        model = make()
        model[0].weight.requires_grad_(False)
        model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                         step_in_backward=release)
        model[0].weight.requires_grad_(True)
        for _ in range(3):
            opt.zero_grad()
            model(X).sum().backward()
            if release:
                assert model[0].bias.grad is None
            opt.step()
        if release:
            assert model[0].weight.grad is None  # hooked since the first step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


class GlobalNormSGD(torch.optim.Optimizer):
    """Scales every update by the global grad norm: stepping it one parameter at a time would change it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p -= group["lr"] * p.grad / norm


class AdamWWithOwnStep(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


class AdamWKeepingItsStep(torch.optim.AdamW):
    pass


class DeclaredPerParameter(GlobalNormSGD):
    per_parameter_step = True


@pytest.mark.parametrize("cls", [GlobalNormSGD, AdamWWithOwnStep])
def test_optimizer_with_its_own_step_is_refused(cls):
    model = make()
    opt = cls(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"{cls.__name__} has its own step, which may read several parameters' "
                                         r"grads at once.*per_parameter_step = True"):
        ipex_train.optimize(model, opt, step_in_backward=True)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    model, opt = ipex_train.optimize(model, opt)
    with pytest.raises(ValueError, match="has its own step"):
        opt.set_step_in_backward(True)
    assert not opt.step_in_backward


@pytest.mark.parametrize("cls", [AdamWKeepingItsStep, DeclaredPerParameter, torch.optim.RMSprop])
def test_per_parameter_optimizers_are_accepted(cls):
    model, opt = released(cls, lr=0.01)
    model(X).sum().backward()
    opt.step()
    assert opt.step_in_backward
