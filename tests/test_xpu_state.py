"""Reduced-byte optimizer state (bf16 with stochastic rounding, block-wise int8) in the SYCL kernels, on a real
SYCL device (here the SYCL CPU device: Intel's OpenCL CPU driver from intel-opencl-rt).

Compared with
  - the CPU kernels, for the same rounding key: bit-identical params, residuals/masters and state codes for the
    elementwise steps (SGD momentum, Adam/AdamW, Adagrad) and Lamb's state; Lamb's params within rtol = atol =
    1e-6, as tests/test_xpu.py holds the fp32 steps of Lamb and Lars (norms summed in another order). Lars' local
    lr then differs in the last bits, and so does the momentum it scales: a stored momentum value can round the
    other way (within one int8 code or one bf16 step of the CPU's), and the param it moves with it (at most 0.1%
    of the elements outside 1e-6, none by more than 1e-3 of the largest |param|);
  - the plain PyTorch reference, with tests/test_state_formats.py's check and tolerances;
  - optimize(sycl=False) end to end, including a state_dict round trip, which on the SYCL path also moves the
    re-encoded state into USM.

Needs dpctl and intel-opencl-rt (the `xpu` extra). The reduced-state kernels are a bundle of their own, compiled
once per process on first use (~15-30 s here); every test shares the one runtime of sx.default_queue().
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from sycl_required import need_sycl_device
from test_kernels import make_group, op_kind, to_storage, working
from test_state_formats import FORMATS, SHAPES, STATE_CASES, _mlp, _train, check_against_reference

import ipex_train
import ipex_train.xpu as sx
from ipex_train.optim import fused, registry
from ipex_train.optim import state_formats as sf

need_sycl_device(module=True)

EXACT = ("sgd", "adam", "adamw", "adagrad")  # elementwise steps: every bit as the CPU kernels
# Every case in the fp32 and split-bf16 layouts; the master layouts (the same staging, another storage access) and
# the reference check (the CPU kernels pass it in tests/test_state_formats.py) for one case per optimizer and amsgrad
# (three state lists), to keep the file fast.
FIRST_CASES = [c for i, c in enumerate(STATE_CASES) if i == 0 or c[0] != STATE_CASES[i - 1][0] or c[1] == "amsgrad"]
CPU_CASES = [pytest.param(*c, layout, id=f"{c[0]}-{c[1]}-{layout}")
             for layout in ("fp32", "split_bf16", "bf16_master", "fp16_master")
             for c in (STATE_CASES if layout in ("fp32", "split_bf16") else FIRST_CASES)]
REFERENCE_CASES = [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in FIRST_CASES]


@pytest.fixture(scope="module")
def queue():
    return sx.default_queue()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _within_one_code(dev: torch.Tensor, cpu: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether two int8 state tensors of ``p`` have scales within 1e-5 and codes at most one apart, or two bf16
    states are one bf16 step apart at most (2^-7 relative) but for 0.1% of the elements, which stay within one bf16
    step of the largest value: a value that rounded the other way one step earlier moves the next step's value by
    that much, which can be far more than its own step where the new value nearly cancels."""
    if dev.dtype == torch.bfloat16:
        d, c = dev.float(), cpu.float()
        top = float(c.abs().max())
        off = (d - c).abs() > c.abs() * 2**-7 + 1e-6 * top
        return float(off.float().mean()) <= 1e-3 and float((d - c).abs().max()) <= 2**-8 * top
    nb = 4 * -(-p.numel() // sf.Q8_BLOCK)
    scales_close = torch.allclose(dev[:nb].view(torch.float32), cpu[:nb].view(torch.float32), rtol=1e-5, atol=0)
    return scales_close and int((dev[nb:].int() - cpu[nb:].int()).abs().max()) <= 1


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind,name,overrides,layout", CPU_CASES)
def test_sycl_matches_cpu_kernels(queue, kind, name, overrides, layout, fmt):
    group = make_group(kind, name, **overrides)
    group.update({sf.GROUP_KEY: FORMATS[fmt], sf.SEED_KEY: 11})
    cpu_group, dev_group = dict(group), dict(group)  # each counts its own steps into the rounding key
    gen = torch.Generator().manual_seed(7)
    cpu = [to_storage(layout, torch.randn(s, generator=gen)) for s in SHAPES]
    dev = [(sx.to_usm(p, queue), None if a is None else sx.to_usm(a, queue)) for p, a in cpu]
    cpu_state, dev_state = collections.defaultdict(dict), collections.defaultdict(dict)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p, _ in cpu]
        fused.fused_step(registry.get(op_kind(kind)), cpu_group, cpu_state, *map(list, zip(*cpu)), grads)
        sx.fused_step(op_kind(kind), dev_group, dev_state, *map(list, zip(*dev)),
                      [sx.to_usm(g, queue) for g in grads], queue)
    assert dev_group[sf.ROUNDS_KEY] == cpu_group[sf.ROUNDS_KEY] == 3
    for i, ((cp, ca), (dp, da)) in enumerate(zip(cpu, dev)):
        if kind in EXACT:
            assert torch.equal(_bytes(dp), _bytes(cp)), f"params[{i}] differs from the CPU kernel"
            if ca is not None:
                assert torch.equal(_bytes(da), _bytes(ca)), f"aux[{i}] differs from the CPU kernel"
        elif kind == "lamb" or cp.numel() < sf.MIN_NUMEL:
            torch.testing.assert_close(working(layout, dp, da), working(layout, cp, ca), rtol=1e-6, atol=1e-6,
                                       msg=lambda m, i=i: f"params[{i}]: {m}")
        else:
            # Lars with reduced momentum: where a momentum value rounded the other way (one code or bf16 step
            # apart, see below), the param moved by that much more or less.
            w, ref = working(layout, dp, da), working(layout, cp, ca)
            off = ~torch.isclose(w, ref, rtol=1e-6, atol=1e-6)
            assert float(off.float().mean()) <= 1e-3, f"params[{i}]: {int(off.sum())} elements differ"
            assert float((w - ref).abs().max()) <= 1e-3 * float(ref.abs().max()), f"params[{i}]"
        for spec in registry.get(op_kind(kind)).state:
            c, d = cpu_state[cp].get(spec.key), dev_state[dp].get(spec.key)
            if c is None:
                assert d is None
                continue
            assert d.dtype == c.dtype and d.shape == c.shape, (spec.key, i)
            assert sx.usm_kind(d, queue) == "shared", f"{spec.key}[{i}] is not in USM"
            if cp.numel() >= sf.MIN_NUMEL:
                assert sf.public(sf.format_of(d)) == FORMATS[fmt], (spec.key, i)
            if kind == "lars" and sf.format_of(d) is not None:
                assert _within_one_code(d, c, cp), (spec.key, i)
            elif kind == "lars":
                torch.testing.assert_close(d, c, rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(_bytes(d), _bytes(c)), f"{spec.key}[{i}] differs from the CPU kernel"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind,name,overrides", REFERENCE_CASES)
def test_sycl_matches_reference(queue, kind, name, overrides, fmt):
    def step(*args):
        sx.fused_step(*args, queue)

    check_against_reference(kind, name, overrides, "split_bf16", fmt, step_fn=step,
                            place=lambda t: sx.to_usm(t, queue))


def test_int8_state_codes_survive_a_step_that_changes_nothing(queue):
    # lr 0, zero grads, momentum 1: the kernel must store exactly the codes and scales it read.
    p = sx.to_usm(torch.randn(10_000), queue)
    buf = sx.to_usm(sf.encode(torch.randn(10_000) * torch.logspace(-6, 2, 10_000), p, sf.StateFormat.INT8, True), queue)
    before = buf.clone()
    group = dict(lr=0.0, momentum=1.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                 state_dtype="int8")
    state = collections.defaultdict(dict, {p: {"momentum_buffer": buf}})
    sx.fused_step("sgd", group, state, [p], [None], [sx.to_usm(torch.zeros(10_000), queue)], queue)
    assert state[p]["momentum_buffer"] is buf
    assert torch.equal(buf, before)


def test_host_refuses_bad_state_formats_naming_the_argument(queue):
    # The Python step converts every state of a parameter to one format; the host refuses a call that mixes them.
    from ipex_train.xpu import _runtime

    p, g = sx.to_usm(torch.randn(5000), queue), sx.to_usm(torch.randn(5000), queue)
    m = sx.usm_tensor((5000,), torch.bfloat16, queue)
    v = sx.usm_tensor((5000,), torch.float32, queue)
    slot = (0, 5000, p.data_ptr(), 0, g.data_ptr(), m.data_ptr(), v.data_ptr(), 0, (sf.CODECS[torch.bfloat16], 0, 0))
    rt = _runtime.runtime(queue)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] and exp_avgs\[0\] mix fp32 and reduced-byte state"):
        rt.adam([slot], [1.0], 1e-3, 0.9, 0.999, 0.0, 1e-8, False, False, True, 1)
    slot = (0, 5000, p.data_ptr(), 0, g.data_ptr(), m.data_ptr(), 0, 0, (7, 0, 0))
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] has unknown state format 7"):
        rt.sgd([slot], [False], 0.1, 0.9, 0.0, 0.0, False, False, 1)


# ---------------------------------------------------------------------------------------------------------------
# optimize(sycl=True, optimizer_state_dtype=...) against optimize(sycl=False), with a state_dict round trip

def _optimized(opt_name, fmt, sycl, dtype=torch.bfloat16):
    model = _mlp()  # an 8192-element weight with reduced state; the rest keeps fp32 state
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01) if opt_name == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return ipex_train.optimize(model, opt, dtype=dtype, sycl=sycl, optimizer_state_dtype=FORMATS[fmt])


def _same(model, opt, ref_model, ref_opt):
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(_bytes(p), _bytes(q)), name
        for key, t in opt.state[p].items():
            assert torch.equal(_bytes(t), _bytes(ref_opt.state[q][key])), (name, key)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_optimize_sycl_reduced_state_matches_cpu_and_round_trips(queue, opt_name, fmt):
    model, opt = _optimized(opt_name, fmt, sycl=True)
    ref_model, ref_opt = _optimized(opt_name, fmt, sycl=False)
    _train(model, opt, 3, seed=0)
    _train(ref_model, ref_opt, 3, seed=0)
    _same(model, opt, ref_model, ref_opt)
    state_tensors = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    assert all(sx.usm_kind(t, queue) == "shared" for t in state_tensors)
    assert {sf.public(sf.format_of(t)) for t in state_tensors} == {None, FORMATS[fmt]}  # the biases keep fp32 state

    sd = opt.state_dict()
    assert all(t.dtype == torch.float32 for st in sd["state"].values() for k, t in st.items() if k != "step")
    for st, ref_st in zip(sd["state"].values(), ref_opt.state_dict()["state"].values()):
        for key, t in st.items():
            assert torch.equal(t, ref_st[key]), key  # the SYCL path saves what the CPU path saves

    # A fresh SYCL pair loads the fp32 checkpoint back into the same reduced state and steps on alike.
    model2, opt2 = _optimized(opt_name, fmt, sycl=True)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(sd))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key, t in opt.state[p].items():
            assert torch.equal(_bytes(t), _bytes(opt2.state[p2][key])), key
            if key != "step":
                assert sx.usm_kind(opt2.state[p2][key], queue) == "shared", key
    _train(model, opt, 2, seed=5)
    _train(model2, opt2, 2, seed=5)
    _same(model2, opt2, model, opt)


def test_optimize_sycl_loads_a_vanilla_checkpoint_into_reduced_usm_state(queue):
    # The loading optimizer's own format (not the checkpoint's, which has none): encoded at load, then put in USM.
    model = _mlp()
    vanilla = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    _train(model, vanilla, 2, seed=0)
    model2, opt2 = _optimized("adamw", "int8", sycl=True)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(vanilla.state_dict()))
    big = model2[0].weight
    assert opt2.state[big]["exp_avg"].dtype == torch.int8 and opt2.state[big]["exp_avg_sq"].dtype == torch.uint8
    assert all(sx.usm_kind(t, queue) == "shared" for st in opt2.state.values() for k, t in st.items() if k != "step")
    _train(model2, opt2, 1, seed=5)
    assert opt2.state[big]["exp_avg"].dtype == torch.int8
