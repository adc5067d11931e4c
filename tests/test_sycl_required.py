"""IPEX_TRAIN_REQUIRE_SYCL: the SYCL tests skip without a device unless it is 1, and CI sets it."""
from pathlib import Path

import pytest
import sycl_required
from sycl_required import ENV_VAR, need_sycl_device

import ipex_train.xpu as sx


@pytest.fixture
def no_device(monkeypatch):
    monkeypatch.setattr(sx, "is_available", lambda: False)
    monkeypatch.setattr(sx, "unavailable_reason", lambda: "dpctl is not installed")
    monkeypatch.delenv(ENV_VAR, raising=False)
    return monkeypatch


def test_skips_without_device_by_default(no_device):
    for value in (None, "0"):
        if value is not None:
            no_device.setenv(ENV_VAR, value)
        with pytest.raises(pytest.skip.Exception, match="no SYCL device: dpctl is not installed"):
            need_sycl_device(module=True)


def test_fails_without_device_when_required(no_device):
    no_device.setenv(ENV_VAR, "1")
    for module in (False, True):
        with pytest.raises(pytest.fail.Exception, match=f"dpctl is not installed .*{ENV_VAR}=1"):
            need_sycl_device(module=module)


def test_other_values_are_refused(no_device):
    no_device.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match=ENV_VAR):
        need_sycl_device()


def test_passes_with_device(monkeypatch):
    monkeypatch.setattr(sx, "is_available", lambda: True)
    monkeypatch.setenv(ENV_VAR, "1")
    assert need_sycl_device() is None


def test_ci_requires_the_device():
    # .ci/run installs the [xpu] extra (dpctl and the OpenCL CPU runtime) through run.sh.
    ci = (Path(sycl_required.__file__).parent.parent / ".ci" / "run").read_text()
    assert f"{ENV_VAR}=1" in ci
