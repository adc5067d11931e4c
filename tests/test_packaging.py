"""What a non-editable install (a wheel) carries besides the Python package: the SYCL path compiles its kernels at
run time from kernels_xpu/ and the kernels_cpu headers, so setup.py's build_py copies them into the package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ipex_train.xpu import _runtime

REPO = Path(__file__).resolve().parent.parent


def test_build_py_ships_every_sycl_source(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=REPO,
                   check=True, capture_output=True)
    package = tmp_path / "ipex_train"
    shipped = package / "_sources"
    # everything the runtime reads: the kernel source, the host glue, and each header the kernel source includes
    needed = ["kernels_xpu/rtc/steps.cpp", "kernels_xpu/host/module.cpp"]
    needed += [f"kernels_cpu/{rel}" for rel in _runtime._INCLUDES.values()]
    for rel in needed:
        assert (shipped / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    # a package with no source tree beside it reads the shipped copies; this editable install reads the repository
    assert Path(_runtime.source_root(str(package))) == shipped
    assert Path(_runtime.source_root()) == REPO
