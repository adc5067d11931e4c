"""Bad and unusual environment variables: one test per case. Every variable is read case-insensitively, a bad value
never breaks ``import ipex_train`` (it is a ValueError naming the variable and the accepted values where the value
is used), optimize() honours every documented variable, and its precedence is keyword or config field > environment
> default, with a keyword and a config field that disagree refused. Extend by adding a case."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ipex_train
from ipex_train import OptimizeConfig
from ipex_train.base import envvars as _envvars

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_options_in_environment(monkeypatch):
    """The cases set what they test; nothing from the caller's environment (CI sets IPEX_TRAIN_BF16_COMPUTE)."""
    for variable in _envvars.OPTIONS.values():
        monkeypatch.delenv(variable.name, raising=False)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose environment is this one's plus ``env``."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


# --------------------------------------------------------------------------- import is never broken


@pytest.mark.parametrize("value", ["AVX2", "sse9", " Scalar "])
def test_kernel_variable_never_breaks_import(value):
    out = _run("import ipex_train; print('imported')", IPEX_TRAIN_KERNEL=value)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr


@pytest.mark.parametrize("value, variant", [("AVX2", "avx2"), ("Scalar", "scalar"), (" scalar ", "scalar")])
def test_kernel_variable_is_case_insensitive(value, variant):
    out = _run("from ipex_train.base import ops as _ops; print(_ops.kernel_variant())", IPEX_TRAIN_KERNEL=value)
    assert out.returncode == 0 and out.stdout.strip() == variant, out.stderr


def test_bad_kernel_variable_is_raised_at_optimize_and_first_kernel_call():
    code = """
import torch, ipex_train
from ipex_train.base import ops as _ops
m = torch.nn.Linear(4, 4)
for call in (lambda: ipex_train.optimize(m, torch.optim.SGD(m.parameters(), lr=0.1)),
             lambda: _ops.split_bf16(torch.ones(8)), _ops.kernel_variant):
    try:
        call()
        print("no error")
    except ValueError as e:
        print("ValueError", e)
print("unchanged", m.weight.dtype)
_ops.set_kernel_variant("auto")  # an explicit choice replaces the bad request
print("then", _ops.kernel_variant() in _ops.supported_kernel_variants())
"""
    out = _run(code, IPEX_TRAIN_KERNEL="sse9")
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert len(lines) == 5 and all(line.startswith("ValueError IPEX_TRAIN_KERNEL='sse9'") for line in lines[:3])
    assert all("auto, avx512, avx2, scalar" in line for line in lines[:3])
    assert lines[3:] == ["unchanged torch.float32", "then True"]


def test_bad_bf16_compute_variable_never_breaks_import_and_is_raised_by_optimize():
    code = """
import torch, ipex_train
m = torch.nn.Linear(4, 4)
try:  # fp32 training too: the variable is read (and checked) when optimize() starts
    ipex_train.optimize(m, torch.optim.SGD(m.parameters(), lr=0.1))
except ValueError as e:
    print("ValueError", e)
"""
    out = _run(code, IPEX_TRAIN_BF16_COMPUTE="fast")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ValueError IPEX_TRAIN_BF16_COMPUTE='fast'") and "auto, native, emulated" in out.stdout


# --------------------------------------------------------------------------- bad values name the variable


@pytest.mark.parametrize("name, value, accepted", [
    ("step_in_backward", "maybe", "1, true, yes, on, 0"),
    ("optimizer_state_dtype", "int4", "bf16, bfloat16, int8"),
    ("dtype", "half-ish", "'bf16'"),
    ("level", "O2", "auto, O0, O1"),
    ("fuse_update_step", "sometimes", "1, true, yes, on"),
    ("sycl", "perhaps", "1, true, yes, on"),
    ("bf16_compute", "fast", "auto, native, emulated"),
])
def test_bad_option_variable_is_a_value_error_at_optimize(monkeypatch, name, value, accepted):
    variable = _envvars.OPTIONS[name].name
    monkeypatch.setenv(variable, value)
    model, opt = _pair()
    with pytest.raises(ValueError, match=rf"{variable}='{value}'.*{accepted}"):
        ipex_train.optimize(model, opt)
    assert model[0].weight.dtype == torch.float32  # nothing changed


# --------------------------------------------------------------------------- case-insensitive


@pytest.mark.parametrize("name, value, check", [
    ("step_in_backward", "TRUE", lambda model, opt: opt.step_in_backward),
    ("step_in_backward", " On ", lambda model, opt: opt.step_in_backward),
    ("optimizer_state_dtype", "INT8", lambda model, opt: opt.param_groups[0]["state_dtype"] == "int8"),
    ("optimizer_state_dtype", "BF16", lambda model, opt: opt.param_groups[0]["state_dtype"] is torch.bfloat16),
    ("dtype", "BFloat16", lambda model, opt: model[0].weight.dtype == torch.bfloat16),
    ("level", "o0", lambda model, opt: opt._ipex_fuse is False),
    ("fuse_update_step", "OFF", lambda model, opt: opt._ipex_fuse is False),
])
def test_option_variables_are_read_by_optimize_in_any_case(monkeypatch, name, value, check):
    monkeypatch.setenv(_envvars.OPTIONS[name].name, value)
    assert check(*ipex_train.optimize(*_pair()))


@pytest.mark.parametrize("variable, value, expected", [
    (_envvars.ONEDNN_FUSION, "OFF", False), (_envvars.SYCL_DEVICE, "OpenCL:CPU", "opencl:cpu"),
    (_envvars.XPU_VERBOSE_BUILD, "Yes", True), (_envvars.KERNEL, "AVX512", "avx512"),
])
def test_process_variables_are_case_insensitive(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable.name, value)
    assert variable.read() == expected


# --------------------------------------------------------------------------- optimize() honours the variables


def test_step_in_backward_variable_is_honoured_by_optimize(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_STEP_IN_BACKWARD", "1")
    model, opt = ipex_train.optimize(*_pair(), dtype=torch.bfloat16)
    assert opt.step_in_backward
    model(torch.randn(4, 64)).float().sum().backward()
    assert all(p.grad is None for p in model.parameters())  # stepped and freed inside backward
    # A training-only variable does not apply to an inference optimize() in the same process ...
    assert isinstance(ipex_train.optimize(_pair()[0].eval()), nn.Module)
    with pytest.raises(ValueError, match="step_in_backward=True needs an optimizer"):
        ipex_train.optimize(_pair()[0].eval(), step_in_backward=True)  # ... where the keyword is still refused


def test_optimizer_state_dtype_variable_is_honoured_by_optimize(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_OPTIMIZER_STATE_DTYPE", "int8")
    model, opt = ipex_train.optimize(*_pair(), dtype=torch.bfloat16)
    assert all(g["state_dtype"] == "int8" for g in opt.param_groups)
    model(torch.randn(4, 64)).float().sum().backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.int8


def test_level_and_dtype_variables_are_honoured_by_optimize(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_DTYPE", "bf16")
    monkeypatch.setenv("IPEX_TRAIN_FUSE_UPDATE_STEP", "0")
    model, opt = ipex_train.optimize(*_pair())
    assert model[0].weight.dtype == torch.bfloat16 and opt._ipex_fuse is False


# --------------------------------------------------------------------------- precedence


def test_keyword_wins_over_environment(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_STEP_IN_BACKWARD", "1")
    monkeypatch.setenv("IPEX_TRAIN_LEVEL", "O0")
    _, opt = ipex_train.optimize(*_pair())
    assert opt.step_in_backward and opt._ipex_fuse is False  # the environment, without keywords
    _, opt = ipex_train.optimize(*_pair(), step_in_backward=False, level="O1")
    assert not opt.step_in_backward and opt._ipex_fuse is True


def test_config_field_wins_over_environment(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_STEP_IN_BACKWARD", "1")
    monkeypatch.setenv("IPEX_TRAIN_OPTIMIZER_STATE_DTYPE", "int8")
    _, opt = ipex_train.optimize(*_pair(), config=OptimizeConfig())
    assert opt.step_in_backward and all(g["state_dtype"] == "int8" for g in opt.param_groups)  # fields left None
    config = OptimizeConfig(step_in_backward=False, optimizer_state_dtype="bf16")
    _, opt = ipex_train.optimize(*_pair(), config=config)
    assert not opt.step_in_backward and all(g["state_dtype"] is torch.bfloat16 for g in opt.param_groups)


def test_environment_fills_the_config_fields_left_unset(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_STEP_IN_BACKWARD", "yes")
    _, opt = ipex_train.optimize(*_pair(), config=OptimizeConfig(dtype=torch.bfloat16))
    assert opt.step_in_backward


def test_keyword_equal_to_the_default_conflicting_with_config_is_refused():
    model, opt = _pair()
    with pytest.raises(ValueError, match=r"level='O1' conflicts with config.level='O0'"):
        ipex_train.optimize(model, opt, level="O1", config=OptimizeConfig(level="O0"))
    with pytest.raises(ValueError, match=r"step_in_backward=False conflicts with config.step_in_backward=True"):
        ipex_train.optimize(model, opt, step_in_backward=False, config=OptimizeConfig(step_in_backward=True))
    assert model[0].weight.dtype == torch.float32 and type(opt) is torch.optim.AdamW


def test_keyword_equal_to_config_is_accepted(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_LEVEL", "O0")
    monkeypatch.setenv("IPEX_TRAIN_STEP_IN_BACKWARD", "1")
    _, opt = ipex_train.optimize(*_pair(), level="O1", optimizer_state_dtype="INT8",
                                 config=OptimizeConfig(level="O1", optimizer_state_dtype="int8"))
    assert opt._ipex_fuse is True and all(g["state_dtype"] == "int8" for g in opt.param_groups)
    assert opt.step_in_backward  # set by neither: the environment


def test_plugin_argument_conflicting_with_its_config_is_refused():
    pytest.importorskip("accelerate")
    from ipex_train.integrations.accelerate import IpexTrainPlugin

    with pytest.raises(ValueError, match=r"level='O1' conflicts with config.level='O0'"):
        IpexTrainPlugin(level="O1", config=OptimizeConfig(level="O0"))
    assert IpexTrainPlugin(level="o0", config=OptimizeConfig(level="O0")).level == "O0"


# --------------------------------------------------------------------------- one owner, documented


def test_every_variable_is_documented_with_its_reader():
    text = (ROOT / "docs" / "environment.md").read_text()
    for variable in _envvars.VARIABLES:
        assert f"`{variable.name}`" in text, variable.name
    names = {v.name for v in _envvars.VARIABLES}
    for path in (ROOT / "ipex_train").rglob("*.py"):
        if path.name != "envvars.py":
            source = path.read_text()
            assert not any(f'"{name}"' in source for name in names), f"{path} names a variable itself"
