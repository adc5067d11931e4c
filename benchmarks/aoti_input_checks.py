"""What the input checks compiled into AOTInductor packages cost: a batch-1 ResNet-50 fp32 package built with them
(the default) and without (AOTIConfig(check_inputs=False), torch's stock package), loaded in one process and
called in interleaved rounds (the order alternating each round), each round timing ``--calls`` back-to-back calls
of each. Reports per-call medians with their spread over rounds and the median of the per-round ratios. The same
for a one-linear model (16 -> 16, batch 1; ``--calls`` x 100 calls a round), whose call is short enough to show
the checks' absolute cost.

    python -m benchmarks.aoti_input_checks --build DIR          # compile both packages (slow: C++)
    python -m benchmarks.aoti_input_checks --time DIR [--rounds N] [--calls N] [--json PATH]
"""
import argparse
import json
import os
import statistics
import time

import torch

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


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "quartiles": statistics.quantiles(values, n=4)}


def time_packages(folder: str, model_name: str, rounds: int, calls: int) -> dict:
    packages = {name: torch._inductor.aoti_load_package(os.path.join(folder, f"{model_name}_{name}.pt2"))
                for name in PACKAGES}
    x = torch.randn(MODELS[model_name])
    per_call = {name: [] for name in packages}
    with torch.no_grad():
        for package in packages.values():
            for _ in range(3):
                package(x)
        for r in range(rounds):
            for name in (list(packages) if r % 2 == 0 else list(reversed(packages))):
                start = time.perf_counter()
                for _ in range(calls):
                    packages[name](x)
                per_call[name].append((time.perf_counter() - start) / calls * 1e3)
    ratios = [a / b for a, b in zip(per_call["checks"], per_call["no_checks"])]
    return {"model": model_name, "input": list(MODELS[model_name]), "rounds": rounds, "calls_per_round": calls,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "ms_per_call": {name: _spread(v) for name, v in per_call.items()},
            "checks_minus_no_checks_us": 1e3 * (statistics.median(per_call["checks"])
                                               - statistics.median(per_call["no_checks"])),
            "checks_over_no_checks_per_round": _spread(ratios)}


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
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
