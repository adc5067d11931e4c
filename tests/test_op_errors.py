"""Bad arguments to the fused steps raise a Python exception naming the argument, and never kill the process.

On one machine (torch 2.11, the extension built with that machine's g++) an exception thrown inside the C++ ops
killed the process with SIGSEGV. So (1) the Python entry point of every fused step (optim.fused.fused_step, and
the SYCL one) checks its arguments before it enters C++ (shown here by making any C++ call fail the test), and
(2) the calls that crashed there run in a child process here, so a crash is a failed test, not a dead runner.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ipex_train.optim import _layouts, checks, fused, registry

SGD = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
ADAM = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
            decoupled_weight_decay=False)


class _NoKernels:
    """Stands in for torch.ops.ipex_train: reaching a kernel means the Python checks let a bad call through."""

    def __getattr__(self, name):
        def called(*args):
            raise AssertionError(f"ipex_train::{name} was called with arguments the Python checks should refuse")
        return called


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(fused, "ops", _NoKernels())


def _f32(n=2, shape=(4,)):
    return [torch.zeros(shape) for _ in range(n)]


def _bf16_split(n=2):
    return [torch.zeros(4, dtype=torch.bfloat16) for _ in range(n)], [torch.zeros(4, dtype=torch.int16)
                                                                      for _ in range(n)]


def _state_with(kind, params, **entry):
    state = collections.defaultdict(dict)
    state[params[0]].update(entry)
    return state


# (kind, make(), exception, message): make() returns fused_step's (group, state, params, aux, grads).
CASES = {
    "grads_length": ("sgd", lambda: (SGD, {}, _f32(), [None, None], _f32(1)), ValueError,
                     r"ipex_train::sgd_step: got 2 params but 1 grads"),
    "aux_length": ("adam", lambda: (ADAM, {}, _bf16_split()[0], _bf16_split(1)[1], _f32(2)), ValueError,
                   r"got 2 params but 1 aux entries"),
    "grad_dtype": ("adam", lambda: (ADAM, {}, _f32(), [None, None], [torch.zeros(4), torch.zeros(4).double()]),
                   TypeError, r"grads\[1\] has dtype torch.float64 but params\[1\] is stored as float32"),
    "grad_shape": ("sgd", lambda: (SGD, {}, _f32(), [None, None], [torch.zeros(4), torch.zeros(5)]), ValueError,
                   r"grads\[1\] has shape \(5,\) but params\[1\] has shape \(4,\)"),
    "bf16_without_aux": ("sgd", lambda: (SGD, {}, _bf16_split()[0], [None, None],
                                         [torch.zeros(4, dtype=torch.bfloat16)] * 2), TypeError,
                         r"params\[0\] has dtype torch.bfloat16; without aux\[0\]"),
    "aux_layout": ("sgd", lambda: (SGD, {}, _f32(1), [torch.zeros(4, dtype=torch.int16)], _f32(1)), TypeError,
                   r"params\[0\] \(torch.float32\) with aux\[0\] \(torch.int16\) is not a storage layout"),
    "meta_param": ("adam", lambda: (ADAM, {}, [torch.zeros(4, device="meta")], [None], _f32(1)), ValueError,
                   r"params\[0\] is on meta; kernels_cpu takes CPU tensors only"),
    "sparse_grad": ("sgd", lambda: (SGD, {}, _f32(1), [None], [torch.zeros(4).to_sparse()]), ValueError,
                    r"grads\[0\] is sparse"),
    "not_a_tensor": ("sgd", lambda: (SGD, {}, _f32(1), [None], [1.0]), TypeError,
                     r"grads\[0\] is a float, not a tensor"),
    # Optimizer state from a checkpoint of another model: torch.optim's load_state_dict does not check shapes.
    "state_shape": ("adam", lambda: (ADAM, None, _f32(1), [None], _f32(1)), ValueError,
                    r"exp_avgs\[0\] has shape \(3,\) but params\[0\] has shape \(4,\)"),
    "negative_step": ("adam", lambda: (ADAM, "step", _f32(1), [None], _f32(1)), ValueError,
                      r"state_steps\[0\] is 0.0; increment the step"),
}


def _fused_args(kind, make):
    group, state, params, aux, grads = make()
    if state is None:
        state = _state_with(kind, params, exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3),
                            step=torch.tensor(1.0))
    elif state == "step":
        state = _state_with(kind, params, step=torch.tensor(-1.0), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4))
    else:
        state = collections.defaultdict(dict)
    return registry.get(kind), dict(group), state, params, aux, grads


@pytest.mark.parametrize("case", CASES)
def test_fused_step_refuses_before_cpp(case, no_kernels):
    kind, make, exc, match = CASES[case]
    with pytest.raises(exc, match=match):
        fused.fused_step(*_fused_args(kind, make))


def test_good_call_reaches_the_kernel(no_kernels):
    with pytest.raises(AssertionError, match="ipex_train::adam_step was called"):
        fused.fused_step(registry.get("adam"), dict(ADAM), collections.defaultdict(dict), _f32(), [None, None],
                          _f32())


@pytest.mark.parametrize("steps,match", [
    ([torch.tensor(1.0)], r"got 2 params but 1 state_steps"),
    ([torch.tensor(1.0), torch.ones(2)], r"state_steps\[1\] must be a one-element CPU tensor"),
    ([torch.tensor(1.0), torch.tensor(float("nan"))], r"state_steps\[1\] is nan"),
    ([torch.tensor(2.0), torch.tensor([0.5])], r"state_steps\[1\] is 0.5"),
])
def test_step_counters(steps, match):
    with pytest.raises(ValueError, match=match):
        checks.check_step_args("op", _f32(), [], _f32(), {"exp_avgs": _f32()}, steps)


def test_layouts_of_every_storage():
    params = [torch.zeros(2), torch.zeros(2).double(), torch.zeros(2, dtype=torch.bfloat16),
              torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16)]
    aux = [None, None, torch.zeros(2, dtype=torch.int16), torch.zeros(2), torch.zeros(2)]
    grads = [torch.zeros(2, dtype=p.dtype) for p in params]
    states = {"s": [torch.zeros(2, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                    for p in params]}
    expected = [lay.code for lay in _layouts.LAYOUTS]
    assert checks.check_step_args("op", params, aux, grads, states) == expected
    # The named checks (taken when the quick pass sees a problem) find the same layouts.
    assert checks._named_checks("op", params, aux, grads, states, ("cpu", "", False)) == expected


# The raw-op calls that crashed the process on the lent Xeon, plus the same mistakes through fused_step.
_CHILD = textwrap.dedent("""
    import collections, json, sys, torch
    import ipex_train
    from ipex_train.optim import fused, registry
    ops = torch.ops.ipex_train
    f32 = lambda n=2: [torch.zeros(4) for _ in range(n)]
    def adam(params, aux, grads, m, v, steps):
        ops.adam_step(params, aux, grads, m, v, [], steps, 1e-3, 0.9, 0.999, 0.0, 1e-8, False, False, False)
    one = [torch.tensor(1.0)] * 2
    calls = {
        "sgd_grads": lambda: ops.sgd_step(f32(), [None, None], f32(1), f32(), [False, False], 0.1, 0.9, 0.0, 0.0,
                                          False, False),
        "sgd_fresh": lambda: ops.sgd_step(f32(), [None, None], f32(), f32(), [True], 0.1, 0.9, 0.0, 0.0, False,
                                          False),
        "adam_grads": lambda: adam(f32(), [None, None], f32(1), f32(), f32(), one),
        "adam_aux": lambda: adam(f32(), [None], f32(), f32(), f32(), one),
        "adam_exp_avgs": lambda: adam(f32(), [None, None], f32(), f32(1), f32(), one),
        "adam_exp_avg_sqs": lambda: adam(f32(), [None, None], f32(), f32(), f32(1), one),
        "adam_steps": lambda: adam(f32(), [None, None], f32(), f32(), f32(), one[:1]),
        "adam_step_zero": lambda: adam(f32(1), [None], f32(1), f32(1), f32(1), [torch.tensor(0.0)]),
        "fused_grads": lambda: fused.fused_step(registry.get("sgd"), dict(lr=0.1, momentum=0.9, dampening=0.0,
                                                                            weight_decay=0.0, nesterov=False,
                                                                            maximize=False),
                                                 collections.defaultdict(dict), f32(), [None, None], f32(1)),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no exception"
        except Exception as e:
            out[name] = type(e).__name__ + ": " + str(e).splitlines()[0]
        print(json.dumps({name: out[name]}), flush=True)  # what ran before a crash still shows
""")


def test_bad_calls_raise_in_a_child_process():
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ))
    assert child.returncode == 0, (f"the child died (return code {child.returncode}, negative = signal) after: "
                                   f"{child.stdout}\n{child.stderr[-2000:]}")
    got = {}
    for line in child.stdout.splitlines():
        got.update(json.loads(line))
    expected = {
        "sgd_grads": "ValueError: ipex_train::sgd_step: got 2 params but 1 grads",
        "sgd_fresh": "ValueError: ipex_train::sgd_step: got 2 params but 1 fresh_buffers flags",
        "adam_grads": "ValueError: ipex_train::adam_step: got 2 params but 1 grads",
        "adam_aux": "ValueError: ipex_train::adam_step: got 2 params but 1 aux entries",
        "adam_exp_avgs": "ValueError: ipex_train::adam_step: got 2 params but 1 exp_avgs",
        "adam_exp_avg_sqs": "ValueError: ipex_train::adam_step: got 2 params but 1 exp_avg_sqs",
        "adam_steps": "ValueError: ipex_train::adam_step: got 2 params but 1 state_steps",
        "adam_step_zero": "ValueError: ipex_train::adam_step: state_steps[0] is 0",
        "fused_grads": "ValueError: ipex_train::sgd_step: got 2 params but 1 grads",
    }
    assert set(got) == set(expected)
    for name, start in expected.items():
        assert got[name].startswith(start), (name, got[name])
