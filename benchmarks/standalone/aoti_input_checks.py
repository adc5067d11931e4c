"""What the input checks compiled into AOTInductor packages cost: a batch-1 ResNet-50 fp32 package built with them
(the default) and without (AOTIConfig(check_inputs=False), torch's stock package), loaded in one process and
called in interleaved rounds (benchmarks.common.timing), each round timing ``--calls`` back-to-back calls of
each. Reports per-call medians with their spread over rounds and the paired per-round ratios. The same
for a one-linear model (16 -> 16, batch 1; ``--calls`` x 100 calls a round), whose call is short enough to show
the checks' absolute cost.

    python -m benchmarks.standalone.aoti_input_checks --build DIR          # compile both packages (slow: C++)
    python -m benchmarks.standalone.aoti_input_checks --time DIR [--rounds N] [--calls N] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from ..common import report as report_writer
from ..common.timing import interleaved

PACKAGES = {"checks": True, "no_checks": False}
MODELS = {"resnet50": (1, 3, 224, 224), "linear": (1, 16)}


def build(folder: str) -> None:
    import torchvision

    from ipex_train import inference
    from ipex_train.inference import input_checks

    torch.manual_seed(0)
    models = {"resnet50": torchvision.models.resnet50().eval(), "linear": torch.nn.Linear(16, 16).eval()}
    os.makedirs(folder, exist_ok=True)
    for model_name, model in models.items():
        for name, checks in PACKAGES.items():
            path = os.path.join(folder, f"{model_name}_{name}.pt2")
            if not os.path.exists(path):  # kept from an earlier --build
                inference.export(model, torch.randn(MODELS[model_name]), backend="aoti", path=path,
                                 config=inference.AOTIConfig(check_inputs=checks))
            assert input_checks.verify(path) == checks, path


def time_packages(folder: str, model_name: str, rounds: int, calls: int) -> dict:
    packages = {name: torch._inductor.aoti_load_package(os.path.join(folder, f"{model_name}_{name}.pt2"))
                for name in PACKAGES}
    x = torch.randn(MODELS[model_name])
    with torch.no_grad():
        timed = interleaved({name: (lambda p=p: p(x)) for name, p in packages.items()}, rounds, repeats=calls,
                            warmup=3)
    checks, plain = timed.summary("checks"), timed.summary("no_checks")
    return {"model": model_name, "input": list(MODELS[model_name]), "rounds": rounds, "calls_per_round": calls,
            "threads": torch.get_num_threads(),
            "checks": checks.as_dict(), "no_checks": plain.as_dict(),
            "checks_minus_no_checks_us": 1e6 * (checks.median - plain.median),
            "checks_over_no_checks_per_round": timed.paired("checks", "no_checks").as_dict(unit="x")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", metavar="DIR")
    parser.add_argument("--time", metavar="DIR")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.build:
        build(args.build)
    if args.time:
        report = {"resnet50": time_packages(args.time, "resnet50", args.rounds, args.calls),
                  "linear": time_packages(args.time, "linear", args.rounds, args.calls * 100)}
        print(json.dumps(report, indent=1))
        report_writer.write(args.json, report, indent=1)


if __name__ == "__main__":
    main()
