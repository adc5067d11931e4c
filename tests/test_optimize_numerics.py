"""optimize() training numerics: grids over each fused optimizer's hyper-parameters (in the style of IPEX's own
tests), bf16 training against a plain-torch emulation of the same arithmetic (tests/bf16_reference.py), fp16
training against fp32 training, fp32 optimize() against plain torch, and exact checkpoint continuation.

Every comparison also checks that each parameter moved from its initial value by many times the tolerance, so an
optimizer step that does nothing, or a wrong one, cannot pass."""
import copy
import io
import itertools

import pytest
import torch
from bf16_reference import Bf16Emulation, assert_moved
from torch import nn

import ipex_train
from ipex_train import compute_policy
from ipex_train.optim import Lamb, Lars

STEPS = 3
# optimize(bf16) against the emulation: the same bf16 values meet the same kernels, so only the order of fp32
# accumulations inside a matmul (and a bf16 rounding it flips now and then) differs. Measured at most 3.3e-6 under
# the emulated policy, 7.5e-9 under native, over these grids.
BF16_TOL = 2e-5
# Each parameter's mean move over the run must exceed this many tolerances.
MOVES = 10


def make_model(seed=0):
    torch.manual_seed(seed)
    # No conv bias before BatchNorm: its grad is rounding noise, which Adam would amplify into noise updates.
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 5))


def batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, 6, 6, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(n)]


def train(model, opt, data, set_to_none=True):
    for x, y in data:
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()


def fp32_values(model):
    return {k: v.float() for k, v in model.state_dict().items()}


def run_pair(opt_class, kwargs, dtype, set_to_none=True, **optimize_kwargs):
    """(optimized model after training, reference fp32 model after the same training)."""
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = opt_class(ref.parameters(), **kwargs)
    model, opt = ipex_train.optimize(model, opt_class(model.parameters(), **kwargs), dtype=dtype,
                                     **optimize_kwargs)
    data = batches()
    train(ref, ref_opt, data, set_to_none)
    train(model, opt, data, set_to_none)
    return model, ref


def run_bf16(opt_class, kwargs, set_to_none=True, reference_kwargs=None, **optimize_kwargs):
    """(fp32 values of optimize(bf16) after training, those of the plain-torch emulation of it, whose optimizer
    takes ``reference_kwargs`` when given)."""
    model = make_model()
    emulation = Bf16Emulation(model, lambda params: opt_class(params, **(reference_kwargs or kwargs)),
                              compute_policy.resolve())
    model, opt = ipex_train.optimize(model, opt_class(model.parameters(), **kwargs), dtype=torch.bfloat16,
                                     **optimize_kwargs)
    data = batches()
    train(model, opt, data, set_to_none)
    for x, y in data:
        emulation.zero_grad()
        nn.functional.cross_entropy(emulation.model(x).float(), y).backward()
        emulation.step()
    return fp32_values(model), emulation.state_dict()


def assert_close(model, ref, tol, moved=True):
    assert_values_close(fp32_values(model), fp32_values(ref), tol, moved)


def assert_values_close(got, want, tol, moved=True):
    assert got.keys() == want.keys()
    if moved:
        assert_moved(want, dict(make_model().named_parameters()), tol, MOVES)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")


def assert_bf16(opt_class, kwargs, set_to_none=True, reference_kwargs=None):
    got, want = run_bf16(opt_class, kwargs, set_to_none, reference_kwargs)
    assert_values_close(got, want, BF16_TOL)


SGD_GRID = [dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
            for m, d, n, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.1), (False, True), (0.0, 0.01),
                                                     (False, True))
            if not n or (m > 0 and d == 0)]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kw", SGD_GRID, ids=str)
def test_sgd_grid(kw, set_to_none):
    kw = dict(kw, lr=0.02)
    assert_bf16(torch.optim.SGD, kw, set_to_none)
    model, ref = run_pair(torch.optim.SGD, kw, None, set_to_none)
    assert_close(model, ref, 1e-5)


ADAM_GRID = [(cls, dict(amsgrad=a, betas=b, weight_decay=wd, maximize=mx))
             for cls, a, b, wd, mx in itertools.product((torch.optim.Adam, torch.optim.AdamW), (False, True),
                                                        ((0.9, 0.999), (0.8, 0.9)), (0.0, 0.1), (False, True))]


@pytest.mark.parametrize("cls,kw", ADAM_GRID, ids=str)
def test_adam_grid(cls, kw):
    kw = dict(kw, lr=1e-3)
    assert_bf16(cls, kw)
    model, ref = run_pair(cls, kw, None)
    assert_close(model, ref, 1e-5)


def test_adam_decoupled_weight_decay_matches_adamw():
    kw = dict(lr=1e-3, weight_decay=0.5)
    model, _ = run_pair(torch.optim.Adam, dict(kw, decoupled_weight_decay=True), None)
    _, ref = run_pair(torch.optim.AdamW, kw, None)
    assert_close(model, ref, 1e-5)


@pytest.mark.parametrize("kw", [dict(lr=3e-3), dict(lr=3e-3, lr_decay=0.1, weight_decay=0.01),
                                dict(lr=3e-3, initial_accumulator_value=0.1, maximize=True)], ids=str)
def test_adagrad(kw):
    assert_bf16(torch.optim.Adagrad, kw)
    model, ref = run_pair(torch.optim.Adagrad, kw, None)
    assert_close(model, ref, 1e-5)


LAMB_LARS = [(Lamb, dict(lr=1e-2)), (Lamb, dict(lr=1e-2, weight_decay=0.01, bias_correction=False)),
             (Lars, dict(lr=2.0, momentum=0.9)), (Lars, dict(lr=1.0, momentum=0.0, weight_decay=1e-3, eeta=1e-2))]


@pytest.mark.parametrize("cls,kw", LAMB_LARS, ids=str)
def test_lamb_lars(cls, kw):
    # Reference: the same optimizer class running its plain PyTorch rule (tests/test_optim_lamb_lars.py checks that
    # rule against the papers').
    assert_bf16(cls, kw, reference_kwargs=dict(kw, fused=False))
    model, ref = run_pair(cls, dict(kw, fused=False), None)
    assert_close(model, ref, 1e-5)


@pytest.mark.parametrize("optimize_kwargs", [dict(dtype=torch.float16),
                                             dict(dtype=torch.bfloat16, split_master_weight_for_bf16=False),
                                             dict(dtype=torch.bfloat16, fuse_update_step=False),
                                             dict(dtype=torch.bfloat16, level="O0")], ids=str)
def test_other_storage_modes(optimize_kwargs):
    kw = dict(lr=1e-3, weight_decay=0.1)
    model, ref = run_pair(torch.optim.AdamW, kw, **optimize_kwargs)
    low = [p for p in model.parameters() if p.dtype != torch.float32]
    assert low and {p.dtype for p in low} == {optimize_kwargs["dtype"]}
    assert_close(model, ref, 1e-2, moved=False)  # a sanity bound: fp16 has no tighter reference here
    if optimize_kwargs["dtype"] == torch.bfloat16:
        # An fp32 master rounds to nearest-even where split storage rounds ties away: only exact ties differ, which
        # the tolerance covers.
        optimize_kwargs = {k: v for k, v in optimize_kwargs.items() if k != "dtype"}
        got, want = run_bf16(torch.optim.AdamW, kw, **optimize_kwargs)
        assert_values_close(got, want, BF16_TOL)


def test_split_weights_are_round_to_nearest():
    model = make_model()
    weight = model[4].weight.detach().clone()
    model, _ = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    assert torch.equal(model[4].weight, weight.to(torch.bfloat16))
    assert torch.equal(model.state_dict()["4.weight"], weight)


@pytest.mark.parametrize("cls,kw", [(torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                                    (torch.optim.AdamW, dict(lr=1e-3)), (torch.optim.Adagrad, dict(lr=0.05)),
                                    (Lamb, dict(lr=1e-3)), (torch.optim.RMSprop, dict(lr=1e-3))], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_checkpoint_continuation_is_bitwise(cls, kw, dtype):
    model = make_model()
    model, opt = ipex_train.optimize(model, cls(model.parameters(), **kw), dtype=dtype)
    data = batches(6)
    train(model, opt, data[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, data[2:])
    expected = fp32_values(model)

    buf.seek(0)
    ckpt = torch.load(buf)
    assert all(v.dtype != torch.bfloat16 for v in ckpt["model"].values())
    assert all(v.dtype == torch.float32 for st in ckpt["opt"]["state"].values() for v in st.values()
               if torch.is_tensor(v))
    fresh = make_model(seed=5)
    fresh, fresh_opt = ipex_train.optimize(fresh, cls(fresh.parameters(), **kw), dtype=dtype)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    train(fresh, fresh_opt, data[2:])
    got = fp32_values(fresh)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
