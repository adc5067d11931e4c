"""The one report writer of the benchmarks: a JSON file holding the benchmark's own fields and a ``report`` header
(date, machine, torch version, command line), so every kept report says where and how it was measured."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch


def machine() -> dict:
    """What a figure was measured on: CPU, cores, torch threads, torch and Python versions, the load, and
    ipex_train's view (ISA features, kernel variant, bf16 compute policy) where ipex_train imports."""
    out = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
           "load_average": os.getloadavg()}
    try:
        import ipex_train

        info = ipex_train.info()
        out.update(cpu=info["cpu"], isa=[k for k, v in info["isa"].items() if v],
                   kernel_variant=info["kernel_variant"], bf16_compute_policy=info["bf16_compute_policy"])
    except Exception as e:  # noqa: BLE001 - a report is still written where the extension is not built
        out["ipex_train"] = f"info() failed: {type(e).__name__}: {e}"
    return out


def header(argv: list[str] | None = None) -> dict:
    """The ``report`` field: UTC date and time, the machine, torch's version and the command line."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "torch": torch.__version__,
            "command": [Path(sys.executable).name, *(sys.argv if argv is None else argv)]}


def write(path: str | os.PathLike | None, payload: dict, indent: int = 2) -> dict:
    """Write ``payload`` with a ``report`` header (see :func:`header`) as JSON to ``path``; nothing when ``path``
    is None. Returns the payload with its header."""
    payload = {"report": header(), **payload}
    if path is not None:
        Path(path).write_text(json.dumps(payload, indent=indent, default=str))
        print(f"wrote {path}")
    return payload
