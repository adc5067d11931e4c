"""The SYCL tests' check for a SYCL device: without one they skip, unless IPEX_TRAIN_REQUIRE_SYCL=1 (set by .ci/run,
whose environment installs the [xpu] extra: dpctl and the OpenCL CPU runtime) makes that a failure, so that a broken
runtime cannot pass as a machine without the device."""
import os

import pytest

import ipex_train.xpu as sx

ENV_VAR = "IPEX_TRAIN_REQUIRE_SYCL"


def required() -> bool:
    """Whether IPEX_TRAIN_REQUIRE_SYCL asks for the device ("1"; "0" or unset: skip without it)."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR} must be 1 (fail without a SYCL device) or 0/unset (skip), got {value!r}")
    return value == "1"


def need_sycl_device(module=False):
    """Skip the calling test (its whole module with ``module=True``) when no SYCL device is available; fail it
    instead when IPEX_TRAIN_REQUIRE_SYCL=1."""
    if sx.is_available():
        return
    reason = f"no SYCL device: {sx.unavailable_reason()}"
    if required():
        pytest.fail(f"{reason} ({ENV_VAR}=1 requires one)", pytrace=False)
    pytest.skip(reason, allow_module_level=module)
