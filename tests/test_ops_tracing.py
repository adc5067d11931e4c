"""The ops are visible to torch's tracing machinery: fake (meta) impls for FakeTensor / torch.compile,
torch.library.opcheck, torch.compile itself, and their names in the profiler."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ipex_train.base import ops as _ops  # noqa: F401  (registers the ops and their fake impls)

ops = torch.ops.ipex_train
SHAPE = (5, 3)


def _f32(n=2):
    return [torch.randn(SHAPE) for _ in range(n)]


def _pos(n=2):  # second-moment states must be >= 0
    return [torch.rand(SHAPE) for _ in range(n)]


def _steps(n=2):
    return [torch.tensor(1.0) for _ in range(n)]


def _layout(name: str, n=2):
    """(params, aux, grads) for two parameters in storage layout ``name``."""
    if name == "fp32":
        return _f32(n), [None] * n, _f32(n)
    tops, res = zip(*(ops.split_bf16(t) for t in _f32(n)))
    return list(tops), list(res), [t.bfloat16() for t in _f32(n)]


def step_args(op: str, layout: str) -> tuple:
    """Valid arguments of step op ``op`` for two small parameters stored in ``layout``."""
    p, a, g = _layout(layout)
    return {
        "sgd_step": lambda: (p, a, g, _f32(), [True, False], 0.1, 0.9, 0.0, 1e-3, False, False),
        "adam_step": lambda: (p, a, g, _f32(), _pos(), _pos(), _steps(), 1e-3, 0.9, 0.999, 1e-2, 1e-8, True, False,
                              False),
        "adagrad_step": lambda: (p, a, g, _pos(), _steps(), 0.1, 0.01, 1e-3, 1e-10, False),
        "lamb_step": lambda: (p, a, g, _f32(), _pos(), _steps(), 1e-3, 0.9, 0.999, 1e-2, 1e-6, True),
        "lars_step": lambda: (p, a, g, _f32(), 0.1, 0.9, 1e-3, 1e-3, 0.0),
    }[op]()


STEP_OPS = ("sgd_step", "adam_step", "adagrad_step", "lamb_step", "lars_step")


def test_fake_tensor_mode():
    real = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(real)
        top, res = ops.split_bf16(x)
        back = ops.combine_bf16(top, res)
        p, g, m, v = (mode.from_tensor(torch.randn(7)) for _ in range(4))
        ops.adam_step([p], [None], [g], [m], [v], [], [mode.from_tensor(torch.tensor(1.0))], 1e-3, 0.9, 0.999, 0.0,
                      1e-8, False, False, False)
    assert all(isinstance(t, FakeTensor) for t in (top, res, back))
    assert (top.dtype, res.dtype, back.dtype) == (torch.bfloat16, torch.int16, torch.float32)
    assert top.shape == res.shape == back.shape == real.shape
    assert top.stride() == res.stride() == back.stride() == real.stride()  # memory format carried through


@pytest.mark.parametrize("op", STEP_OPS)
@pytest.mark.parametrize("layout", ("fp32", "split_bf16"))
def test_opcheck_step_ops(op, layout):
    # fp32 params pass aux as an empty list (what fused.fused_step does): torch's auto_functionalize v2 (used by
    # test_aot_dispatch_dynamic and torch.compile) cannot handle a None inside a mutable Tensor?[] list, see the
    # xfail below.
    args = step_args(op, layout)
    if layout == "fp32":
        args = (args[0], []) + tuple(args[2:])
    torch.library.opcheck(getattr(ops, op).default, args)


@pytest.mark.xfail(strict=True, reason="torch 2.14 auto_functionalize v2 bug: a None entry in a mutable Tensor?[] "
                   "argument (aux for fp32/fp64 params) hits `dict.append` in "
                   "_do_auto_functionalize_v2_for_generic_mutable_operator")
@pytest.mark.parametrize("op", STEP_OPS)
def test_opcheck_aot_dispatch_with_none_aux(op):
    torch.library.opcheck(getattr(ops, op).default, step_args(op, "fp32"), test_utils=("test_aot_dispatch_dynamic",))


def test_opcheck_split_combine():
    torch.library.opcheck(ops.split_bf16.default, (torch.randn(SHAPE),))
    torch.library.opcheck(ops.combine_bf16.default, tuple(ops.split_bf16(torch.randn(SHAPE))))
    channels_last = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(ops.split_bf16.default, (channels_last,))


def test_torch_compile_fullgraph():
    # A whole split-bf16 Adam step compiled without graph breaks gives the eager result.
    def step(tops, res, grads, m, v, steps):
        ops.adam_step(tops, res, grads, m, v, [], steps, 1e-2, 0.9, 0.999, 1e-2, 1e-8, False, False, True)
        return [ops.combine_bf16(t, r) for t, r in zip(tops, res)]

    eager_args = step_args("adam_step", "split_bf16")
    tops, res, grads, m, v, _, steps = eager_args[:7]
    clone = lambda ts: [t.clone() for t in ts]  # noqa: E731
    args_a = (clone(tops), clone(res), grads, clone(m), clone(v), steps)
    args_b = (clone(tops), clone(res), grads, clone(m), clone(v), steps)
    expected = step(*args_a)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*args_b)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    for a, b in zip(args_a[:2] + args_a[3:5], args_b[:2] + args_b[3:5]):  # the mutations reached the inputs
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("op", STEP_OPS + ("split_bf16", "combine_bf16"))
def test_profiler_shows_op_names(op):
    if op == "split_bf16":
        args = (torch.randn(SHAPE),)
    elif op == "combine_bf16":
        args = tuple(ops.split_bf16(torch.randn(SHAPE)))
    else:
        args = step_args(op, "fp32")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        getattr(ops, op)(*args)
    assert f"ipex_train::{op}" in {e.name for e in prof.events()}
