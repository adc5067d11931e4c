"""optimize(sycl=True): parameters, residuals/masters and optimizer state in SYCL USM shared memory, fused steps on
the dpctl queue, matching the CPU steps (bit-identical for the elementwise kernels, as tests/test_xpu.py checks).

Needs dpctl and intel-opencl-rt (the SYCL CPU device); the kernels are compiled once per process (~6 s).
"""
import io

import pytest
import torch
from sycl_required import need_sycl_device
from torch import nn

import ipex_train
import ipex_train.xpu as sx

need_sycl_device(module=True)

BF16 = torch.bfloat16
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),  # no fused step: torch's own, on the same memory
}


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def optimized(opt_name, dtype, sycl, seed=0):
    model = make(seed)
    return ipex_train.optimize(model, OPTIMIZERS[opt_name](model.parameters()), dtype=dtype, sycl=sycl)


def train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        # Alternate: new autograd grads (staged into USM) and grads kept from the previous step.
        opt.zero_grad(set_to_none=i % 2 == 0)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()


def usm_tensors(model, opt):
    """Every tensor that must live in USM: parameters, residuals/masters, optimizer state (not the step count)."""
    masters = model._ipex_train_masters
    state = [v for entry in opt.state.values() for k, v in entry.items() if k != "step" and torch.is_tensor(v)]
    return list(model.parameters()) + list(masters.aux.values()) + state


def assert_same_run(model, opt, ref_model, ref_opt):
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.dtype == q.dtype
        if p.dtype == BF16:
            assert torch.equal(p, q)  # the bf16 tops, bitwise
    masters, ref_masters = model._ipex_train_masters, ref_model._ipex_train_masters
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if p in masters.aux:
            assert torch.equal(masters.aux[p], ref_masters.aux[q])  # residuals, bitwise
    for (k, v), (k2, v2) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2, rtol=0, atol=1e-6)
    for entry, ref_entry in zip(opt.state.values(), ref_opt.state.values()):
        assert entry.keys() == ref_entry.keys()
        for k in entry:
            torch.testing.assert_close(entry[k], ref_entry[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("opt_name,dtype", [("adamw", BF16), ("adamw", None), ("sgd", BF16), ("sgd", None),
                                            ("rmsprop", BF16)])
def test_matches_cpu_step_and_lives_in_usm(opt_name, dtype):
    model, opt = optimized(opt_name, dtype, sycl=True)
    ref_model, ref_opt = optimized(opt_name, dtype, sycl=False)
    assert opt._ipex_sycl is not None and ref_opt._ipex_sycl is None
    assert all(sx.is_usm(t) for t in usm_tensors(model, opt))
    train(model, opt, 5)
    train(ref_model, ref_opt, 5)
    assert_same_run(model, opt, ref_model, ref_opt)
    if opt_name != "rmsprop":  # torch's own step creates its state with torch's allocator
        assert all(sx.is_usm(t) for t in usm_tensors(model, opt))
        assert opt._ipex_sycl._staging  # the SYCL step ran, on grads staged from autograd's memory
    assert not any(sx.is_usm(t) for t in usm_tensors(ref_model, ref_opt))


def test_env_var_turns_it_on(monkeypatch):
    monkeypatch.setenv(sx.ENABLE_ENV, "1")
    model, opt = optimized("sgd", BF16, sycl=None)
    assert opt._ipex_sycl is not None and all(sx.is_usm(p) for p in model.parameters())
    model, opt = optimized("sgd", BF16, sycl=False)
    assert opt._ipex_sycl is None and not any(sx.is_usm(p) for p in model.parameters())


@pytest.mark.parametrize("inplace", [False, True])
def test_bad_argument_or_unavailable_device_changes_nothing(monkeypatch, inplace):
    model = make()
    opt = OPTIMIZERS["adamw"](model.parameters())
    before = [(p, p.detach().clone()) for p in model.parameters()]
    with pytest.raises(TypeError, match="sycl must be True, False or None"):
        ipex_train.optimize(model, opt, dtype=BF16, inplace=inplace, sycl="yes")
    with pytest.raises(TypeError, match="sycl"):
        ipex_train.optimize(model.eval(), dtype=BF16, inplace=inplace, sycl=1)
    model.train()
    monkeypatch.setattr(sx, "is_available", lambda: False)
    monkeypatch.setattr(sx, "unavailable_reason", lambda: "no device (test)")
    with pytest.raises(RuntimeError, match=r"sycl=True.*no device \(test\)"):
        ipex_train.optimize(model, opt, dtype=BF16, inplace=inplace, sycl=True)
    assert [p for p, _ in before] == list(model.parameters()) and type(opt) is torch.optim.AdamW
    for p, value in before:
        assert p.dtype == torch.float32 and torch.equal(p, value) and not sx.is_usm(p)
    assert not hasattr(model, "_ipex_train_masters")


def test_checkpoint_round_trip_keeps_state_in_usm():
    ref_model, ref_opt = optimized("adamw", BF16, sycl=True)
    train(ref_model, ref_opt, 5)

    model, opt = optimized("adamw", BF16, sycl=True)
    train(model, opt, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)  # plain CPU memory

    resumed, resumed_opt = optimized("adamw", BF16, sycl=True, seed=1)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    assert all(sx.is_usm(t) for t in usm_tensors(resumed, resumed_opt))
    opt.load_state_dict(opt.state_dict())  # round trip on the same optimizer
    assert all(sx.is_usm(t) for t in usm_tensors(model, opt))
    train(resumed, resumed_opt, 3, start=2)
    train(model, opt, 3, start=2)
    assert_same_run(resumed, resumed_opt, ref_model, ref_opt)
    assert_same_run(model, opt, ref_model, ref_opt)


def test_add_param_group_and_usm_grads():
    model, opt = optimized("sgd", BF16, sycl=True)
    extra = nn.Parameter(torch.randn(3, dtype=BF16))
    ref = nn.Parameter(extra.detach().float())
    opt.add_param_group({"params": [extra]})
    assert sx.is_usm(extra) and sx.is_usm(model._ipex_train_masters.aux[extra])
    # Grads given USM storage are used in place, without a staging copy.
    sx.usm_grads(list(model.parameters()) + [extra], opt._ipex_sycl.queue)
    extra.grad.fill_(1)
    opt.step()
    assert not opt._ipex_sycl._staging
    ref.grad = torch.ones(3)
    torch.optim.SGD([ref], **{k: v for k, v in opt.param_groups[-1].items() if k != "params"}).step()
    torch.testing.assert_close(model._ipex_train_masters.fp32(extra), ref.detach(), rtol=0, atol=1e-6)
