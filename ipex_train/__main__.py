"""Command line: ``python -m ipex_train info`` (also installed as ``ipex-train info``)."""
from __future__ import annotations

import argparse
import json
import sys


def _sycl_device_line(d: dict) -> str:
    usm = [kind for kind in ("shared", "device", "host") if d[f"usm_{kind}"]]
    return (f"{d['filter_string']}  {d['name']} ({d['device_type']}, {d['backend']}; USM: {', '.join(usm) or 'none'})"
            f"{'  <- default' if d['default'] else ''}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ipex_train``."""
    parser = argparse.ArgumentParser(prog="ipex_train")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="torch version, CPU, ISA features, kernel variant, threads, backends")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    if args.command == "info":
        from .reports.info import info

        data = info()
        if args.json:
            print(json.dumps(data, indent=2))
            return 0
        for key, value in data.items():
            if key == "isa":
                value = " ".join(f"{k}{'' if v else '(no)'}" for k, v in value.items())
            if key == "sycl_devices":
                lines = [_sycl_device_line(d) for d in value] or ["(none)"]
                value = ("\n" + " " * 28).join(lines)
            print(f"{key:>26}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
