"""Calling AOTInductor packages the way a deployment does: in a fresh interpreter that has only torch."""
import os
import subprocess
import sys
import textwrap

import torch

# Loads the package with torch alone; per input tuple saves ("ok", outputs) or ("error", message).
_CALL = textwrap.dedent("""
    import sys, torch
    package = torch._inductor.aoti_load_package(sys.argv[1])
    results = []
    with torch.no_grad():
        for args in torch.load(sys.argv[2]):
            try:
                results.append(("ok", package(*args)))
            except RuntimeError as e:
                results.append(("error", str(e)))
    assert "transformers" not in sys.modules and "ipex_train" not in sys.modules, "the package imported them"
    torch.save(results, sys.argv[3])
""")


def call_fresh(package, inputs, tmp_path):
    """[("ok", outputs) or ("error", message)] of ``package`` on each tuple of ``inputs``, in a fresh interpreter
    with torch alone (no ipex_train, no transformers); fails the test when that process does not exit cleanly (an
    abort shows as -6, SIGABRT)."""
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _CALL, str(package), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "results.pt")], cwd=tmp_path, env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"the package process exited with {proc.returncode}: {proc.stderr[-2000:]}"
    return torch.load(tmp_path / "results.pt")
