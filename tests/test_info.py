"""ipex_train.info() and `python -m ipex_train info`: the SYCL devices (name, type, USM support) and why the SYCL
step cannot run, with and without dpctl, never raising."""
import json
import os
import subprocess
import sys

import pytest
import torch
from sycl_required import need_sycl_device

import ipex_train
from ipex_train import xpu

DEVICE_KEYS = {"name", "filter_string", "device_type", "backend", "usm_shared", "usm_device", "usm_host", "default"}


def _run(code: str):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                          timeout=300)


def test_info_lists_sycl_devices():
    need_sycl_device()
    data = ipex_train.info()
    assert data["sycl_available"] is True and data["sycl_unavailable_reason"] is None
    devices = data["sycl_devices"]
    assert devices and all(set(d) == DEVICE_KEYS for d in devices)
    assert [d["filter_string"] for d in devices if d["default"]] == [xpu.select_device().filter_string]
    default = next(d for d in devices if d["default"])
    assert default["usm_shared"] and default["device_type"] in ("cpu", "gpu", "accelerator")
    json.dumps(data)


def test_cli_prints_one_line_per_device():
    need_sycl_device()
    out = _run("import sys; from ipex_train.__main__ import main; sys.exit(main(['info']))")
    assert out.returncode == 0, out.stderr
    device = xpu.select_device()
    line = next(x for x in out.stdout.splitlines() if device.filter_string in x)
    assert device.name in line and "USM: shared" in line and line.endswith("<- default")
    as_json = _run("import sys; from ipex_train.__main__ import main; sys.exit(main(['info', '--json']))")
    assert json.loads(as_json.stdout)["sycl_devices"]


def test_without_dpctl():
    code = ("import sys; sys.modules['dpctl'] = None\n"
            "import json, ipex_train\n"
            "from ipex_train.__main__ import main\n"
            "d = ipex_train.info(); print(json.dumps({k: d[k] for k in ('sycl_available', 'sycl_devices', "
            "'sycl_unavailable_reason')}))\n"
            "main(['info'])")
    out = _run(code)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.splitlines()[0])
    assert data["sycl_available"] is False and data["sycl_devices"] == []
    assert "dpctl is not installed" in data["sycl_unavailable_reason"]
    assert any(x.strip() == "sycl_devices: (none)" for x in out.stdout.splitlines())


def test_broken_runtime_reads_as_no_device(monkeypatch):
    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(xpu, "devices", broken)
    data = ipex_train.info()
    assert data["sycl_available"] is False and data["sycl_devices"] == []
    assert data["sycl_unavailable_reason"] == "RuntimeError: driver exploded"


def test_unknown_device_selection_is_the_reason(monkeypatch):
    need_sycl_device()
    monkeypatch.setenv(xpu.DEVICE_ENV, "level_zero:gpu:7")
    data = ipex_train.info()
    assert data["sycl_available"] is False and "level_zero:gpu:7" in data["sycl_unavailable_reason"]
    assert data["sycl_devices"] and not any(d["default"] for d in data["sycl_devices"])


def test_one_openmp_runtime_shared_with_torch():
    # The kernels' OpenMP regions (at::parallel_for compiled into the extension) must run on torch's runtime.
    torch.ops.ipex_train.split_bf16(torch.randn(1 << 17))  # large enough for a parallel region
    runtimes = ipex_train.info()["openmp_runtimes"]
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this OS")
    torch_dir = os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__)))
    assert len(runtimes) == 1 and os.path.realpath(runtimes[0]).startswith(torch_dir), runtimes
