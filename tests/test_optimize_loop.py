"""The user's unchanged training loop after optimize(): tied/frozen/unused parameters, add_param_group, LR
schedulers, accumulation, clipping, sparse grads, closures, zero_grad, the non-fused path and checkpoints
exchanged with plain torch."""
import copy
import logging
import warnings

import pytest
import torch
from bf16_reference import Bf16Emulation, assert_moved, clip_grad_norm
from torch import nn

import ipex_train
from ipex_train import compute_policy
from ipex_train.training.optimizer import fused_entry

BF16 = torch.bfloat16
# optimize(bf16) against its plain-torch emulation (see tests/test_optimize_numerics.py's BF16_TOL).
BF16_TOL = 2e-5


class Net(nn.Module):
    def __init__(self, sparse=False, tie=False, unused=False):
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=sparse)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 20, bias=False)
        if tie:
            self.out.weight = self.emb.weight
        self.unused = nn.Linear(8, 8) if unused else None

    def forward(self, idx):
        return self.out(torch.relu(self.norm(self.fc(self.emb(idx).mean(1)))))


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def data(n=4, seed=1, vocab=20):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (6, 5), generator=g), torch.randint(0, 20, (6,), generator=g))
            for _ in range(n)]


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def train(model, opt, batches, clip=None, accumulate=1, sched=None, clipper=None):
    """Train; returns the grad norms clipping reported. ``clipper(max_norm)`` replaces
    torch.nn.utils.clip_grad_norm_ over the model's parameters."""
    norms = []
    for i, (x, y) in enumerate(batches):
        (loss_of(model, x, y) / accumulate).backward()
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            clipper = clipper or (lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            norms.append(float(clipper(clip)))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return norms


def values(model):
    return {k: v.float().clone() for k, v in model.state_dict().items()}


def assert_close(got, want, tol=1e-2):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")


def pair(opt_factory, dtype=BF16, inplace=False, **model_kw):
    """An fp32 reference (model, optimizer) and an optimized copy of it."""
    ref = make(**model_kw)
    model = copy.deepcopy(ref)
    model, opt = ipex_train.optimize(model, opt_factory(model), dtype=dtype, inplace=inplace)
    return (ref, opt_factory(ref)), (model, opt)


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)


def emulation(make_optimizer, **model_kw):
    """The plain-torch emulation of optimize(make(**model_kw), dtype=bf16) with ``make_optimizer(params)``."""
    return Bf16Emulation(make(**model_kw), make_optimizer, compute_policy.resolve())


def assert_tracks_emulation(model, emu, **model_kw):
    """The fp32 values of ``model`` equal the emulation's within BF16_TOL, and every parameter moved well past it."""
    want = emu.state_dict()
    assert_moved(want, dict(make(**model_kw).named_parameters(remove_duplicate=False)), BF16_TOL)
    assert_close(values(model), want, BF16_TOL)


def test_tied_weights_stay_tied_and_train():
    (ref, ref_opt), (model, opt) = pair(adamw, tie=True)
    assert model.out.weight is model.emb.weight and model.emb.weight.dtype == BF16
    train(ref, ref_opt, data())
    train(model, opt, data())
    sd = model.state_dict()
    assert sd["emb.weight"] is sd["out.weight"] and sd["emb.weight"].dtype == torch.float32
    assert_close(values(model), values(ref))
    # The tied weight sums both uses' grads and is stepped once per step, as in the emulation.
    emu = emulation(lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), tie=True)
    train(emu.model, emu, data())
    assert_tracks_emulation(model, emu, tie=True)
    fresh = make(seed=3, tie=True)
    fresh, _ = ipex_train.optimize(fresh, adamw(fresh), dtype=BF16)
    fresh.load_state_dict(sd)
    assert fresh.out.weight is fresh.emb.weight
    assert torch.equal(fresh.state_dict()["out.weight"], sd["out.weight"])


class Scaled(nn.Module):
    """Registers a Linear's weight a second time, in a module that is not converted."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin
        self.w = lin.weight

    def forward(self, x):
        return self.lin(x) + x @ self.w.t()


def test_parameter_shared_with_unconvertible_owner_stays_fp32():
    torch.manual_seed(0)
    model = Scaled(nn.Linear(4, 4))
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
    assert model.lin.weight.dtype == torch.float32 and model.lin.bias.dtype == torch.float32
    assert model.w is model.lin.weight
    model(torch.randn(3, 4)).float().sum().backward()
    opt.step()


def test_frozen_and_unused_parameters_are_untouched():
    (ref, _), (model, opt) = pair(adamw, unused=True)
    model.fc.weight.requires_grad_(False)
    before = values(model)
    train(model, opt, data())
    after = values(model)
    assert not model.fc.weight.requires_grad and model.fc.weight.dtype == BF16
    for k in ("fc.weight", "unused.weight", "unused.bias"):
        assert torch.equal(after[k], before[k]), k
    assert model.fc.weight not in opt.state and model.unused.weight not in opt.state
    assert not torch.equal(after["out.weight"], before["out.weight"])


def test_add_param_group_after_optimize():
    def first(m):
        return torch.optim.SGD([*m.emb.parameters(), *m.fc.parameters()], lr=0.05, momentum=0.9)

    (ref, ref_opt), (model, opt) = pair(first)
    for m, o in ((ref, ref_opt), (model, opt)):
        o.add_param_group({"params": [*m.norm.parameters(), *m.out.parameters()], "lr": 0.1})
        train(m, o, data())
    assert len(opt.param_groups) == 2 and model.out.weight in opt.state
    assert_close(values(model), values(ref))


def test_add_param_group_with_tensor_outside_the_model():
    (_, _), (model, opt) = pair(adamw)
    extra = torch.zeros(3, requires_grad=True)
    opt.add_param_group({"params": [extra]})
    x, y = data(1)[0]
    (loss_of(model, x, y) + (extra - 1).pow(2).sum()).backward()
    opt.step()
    assert extra.abs().min() > 0


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("created", ["before", "after"])
def test_lr_scheduler(created, inplace, caplog):
    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    ref = make()
    ref_opt = sgd(ref)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    model = copy.deepcopy(ref)
    user_opt = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(user_opt, step_size=1, gamma=0.5) if created == "before" else None
    with caplog.at_level(logging.WARNING, logger="ipex_train"):
        model, opt = ipex_train.optimize(model, user_opt, dtype=BF16, inplace=inplace)
    if created == "before" and not inplace:
        assert "scheduler" in caplog.text
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if sched is None:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        train(ref, ref_opt, data(), sched=ref_sched)
        train(model, opt, data(), sched=sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    assert_close(values(model), values(ref))


CLIP_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
}


@pytest.mark.parametrize("name", CLIP_OPTIMIZERS)
def test_gradient_accumulation_and_clipping(name):
    factory = CLIP_OPTIMIZERS[name]
    (ref, ref_opt), (model, opt) = pair(lambda m: factory(m.parameters()))
    train(ref, ref_opt, data(8), clip=0.05, accumulate=4)
    norms = train(model, opt, data(8), clip=0.05, accumulate=4)
    assert opt.state[model.fc.weight].get("step", 2) == 2
    assert_close(values(model), values(ref))

    # Against the emulation: grads summed in bf16 over 4 micro-batches, clipped by their global norm.
    emu = emulation(factory)
    want_norms = train(emu.model, emu, data(8), clip=0.05, accumulate=4, clipper=emu.clip_grad_norm_)
    assert len(norms) == 2 and min(norms) > 0.05 * 5  # clipping scales the grads down, by 5x at least
    assert norms == pytest.approx(want_norms, rel=1e-4)
    assert_tracks_emulation(model, emu)

    # Neither clipping nor accumulation is a no-op here: leaving either out moves the result beyond the tolerance
    # (AdamW is nearly invariant to the grads' scale: without clipping it differs by ~10 tolerances, SGD by far more).
    for kw in (dict(accumulate=4), dict(clip=0.05)):
        (_, _), (other, other_opt) = pair(lambda m: factory(m.parameters()))
        train(other, other_opt, data(8), **kw)
        got = values(other)
        assert max((got[k] - v).abs().max().item() for k, v in values(model).items()) > 5 * BF16_TOL, kw


@pytest.mark.parametrize("name", CLIP_OPTIMIZERS)
def test_fp32_accumulation_and_clipping_match_torch(name):
    factory = CLIP_OPTIMIZERS[name]
    (ref, ref_opt), (model, opt) = pair(lambda m: factory(m.parameters()), dtype=None)
    want_norms = train(ref, ref_opt, data(8), clip=0.05, accumulate=4,
                       clipper=lambda max_norm: clip_grad_norm(ref.parameters(), max_norm))
    norms = train(model, opt, data(8), clip=0.05, accumulate=4)
    assert norms == pytest.approx(want_norms, rel=1e-6) and min(norms) > 0.05 * 5
    want = values(ref)
    assert_moved(want, dict(make().named_parameters()), 1e-5)
    assert_close(values(model), want, tol=1e-5)


@pytest.mark.parametrize("factory", [lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
                                     lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
                                     lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05)],
                         ids=["sgd", "sgd-momentum", "adagrad"])
def test_sparse_grads(factory):
    (ref, ref_opt), (model, opt) = pair(factory, sparse=True)
    train(ref, ref_opt, data(vocab=12))  # rows 12..19 get no grad
    train(model, opt, data(vocab=12))
    got, want = values(model), values(ref)
    assert_close(got, want)
    # The sparse rows were updated in fp32 and re-split: top and residual agree with the fp32 value.
    top, _ = ipex_train.base.ops.split_bf16(got["emb.weight"])
    assert torch.equal(top, model.emb.weight)
    changed = (got["emb.weight"] != make().emb.weight).any(1)
    assert changed.any() and not changed.all()
    assert (got["emb.weight"][changed] != model.emb.weight[changed].float()).any()


def test_non_fused_optimizer_trains_on_fp32_values(caplog):
    def rmsprop(m):
        return torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5)

    with caplog.at_level(logging.INFO, logger="ipex_train"):
        (ref, ref_opt), (model, opt) = pair(rmsprop)
    assert "RMSprop has no fused step" in caplog.text
    assert isinstance(opt, torch.optim.RMSprop)
    train(ref, ref_opt, data())
    train(model, opt, data())
    assert all(v.dtype == torch.float32 for st in opt.state.values() for v in st.values())
    assert model.fc.weight.dtype == BF16 and model.fc.weight.grad is None
    assert_close(values(model), values(ref))


def test_subclass_that_overrides_step_keeps_its_step():
    class Frozen(torch.optim.SGD):
        def step(self, closure=None):
            return None

    class Plain(torch.optim.SGD):
        pass

    (_, _), (model, opt) = pair(lambda m: Frozen(m.parameters(), lr=1.0))
    before = values(model)
    train(model, opt, data(1))
    assert_close(values(model), before, tol=0)
    (ref, ref_opt), (model, opt) = pair(lambda m: Plain(m.parameters(), lr=0.1))
    assert fused_entry(opt).name == "sgd"
    train(ref, ref_opt, data())
    train(model, opt, data())
    assert_close(values(model), values(ref))


def test_closure_and_zero_grad():
    (_, _), (model, opt) = pair(adamw)
    x, y = data(1)[0]

    calls = []

    def closure():
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        calls.append(loss)
        return loss

    assert opt.step(closure) is calls[0] and len(calls) == 1
    assert opt.state[model.fc.weight]["step"] == 1
    opt.zero_grad(set_to_none=False)
    assert model.fc.weight.grad.dtype == BF16 and not model.fc.weight.grad.any()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", [BF16, torch.float16, None])
def test_state_dict_round_trip_loses_nothing(dtype):
    (_, _), (model, opt) = pair(adamw, dtype=dtype)
    (_, _), (twin, twin_opt) = pair(adamw, dtype=dtype)
    train(model, opt, data(2))
    train(twin, twin_opt, data(2))
    opt.load_state_dict(opt.state_dict())  # what Accelerate does at prepare time
    model.load_state_dict(model.state_dict())
    state = opt.state[model.fc.weight]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    train(model, opt, data(3, seed=7))
    train(twin, twin_opt, data(3, seed=7))
    assert_close(values(model), values(twin), tol=0)


def test_vanilla_checkpoint_into_optimized_and_back():
    vanilla = make()
    vanilla_opt = adamw(vanilla)
    train(vanilla, vanilla_opt, data(2))
    ckpt = copy.deepcopy({"model": vanilla.state_dict(), "opt": vanilla_opt.state_dict()})
    train(vanilla, vanilla_opt, data(2, seed=9))

    model = make(seed=4)
    model, opt = ipex_train.optimize(model, adamw(model), dtype=BF16)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.state[model.fc.weight]["exp_avg"].dtype == torch.float32
    train(model, opt, data(2, seed=9))
    assert_close(values(model), values(vanilla))

    model = make(seed=4)
    model, opt = ipex_train.optimize(model, adamw(model))
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(model, opt, data(2, seed=9))
    back = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    plain = make(seed=5)
    plain_opt = adamw(plain)
    plain.load_state_dict(back["model"])
    plain_opt.load_state_dict(back["opt"])
    train(plain, plain_opt, data(2, seed=11))
    train(model, opt, data(2, seed=11))
    assert_close(values(plain), values(model), tol=1e-5)


def test_model_load_state_dict_keeps_strict_and_missing_keys():
    (ref, _), (model, _) = pair(adamw)
    sd = ref.state_dict()
    del sd["fc.bias"]
    with pytest.raises(RuntimeError, match="fc.bias"):
        model.load_state_dict(sd)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ref.load_state_dict(sd, strict=False).missing_keys == ["fc.bias"]
    with pytest.raises(RuntimeError, match="assign"):
        model.load_state_dict(ref.state_dict(), assign=True)


def test_pure_bf16_model_trains():
    ref = make()
    model = copy.deepcopy(ref).to(BF16)
    model, opt = ipex_train.optimize(model, adamw(model))
    assert model.norm.weight.dtype == BF16
    ref_opt = adamw(ref)
    train(ref, ref_opt, data())
    train(model, opt, data())
    assert_close(values(model), values(ref), tol=2e-2)
