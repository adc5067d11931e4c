"""What the non-finite-gradient guard costs a train step (backs docs/bad_inputs.md, "NaN or Inf gradients").

One model and one optimizer, optimize(bf16) with SGD (momentum), stepped in interleaved rounds with the guard on
("skip", the default) and off (the same optimizer object, its guard detached for the "off" calls), so both variants
share weights, state and memory layout; the paired per-round ratio is the guard's cost. Also times the guard's scan
alone (ipex_train.base.ops.first_nonfinite over the step's gradients).

    python -m benchmarks.studies.nonfinite_guard_cost --model bert_base --rounds 8 --json out.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import ipex_train
from ipex_train.base import ops as _ops
from ipex_train.training.optimizer import nonfinite_guard

from ..common import report
from ..common.timing import interleaved
from ..common.train_models import MODELS, example_input


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert_base", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = spec.build()
    model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9),
                                     dtype=torch.bfloat16)
    guard = nonfinite_guard(opt)
    x = example_input(spec)
    y = torch.randint(0, 10, (spec.input_shape[0],))

    def step(with_guard: bool):
        opt._ipex_guard = guard if with_guard else None
        opt.zero_grad()
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()

    rounds = interleaved({"guard_on": lambda: step(True), "guard_off": lambda: step(False)}, args.rounds,
                         warmup=2, steady_within=0.05)
    opt._ipex_guard = guard
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    scan = interleaved({"scan": lambda: _ops.first_nonfinite(grads)}, 20, warmup=2)
    ratio = rounds.paired("guard_on", "guard_off")
    result = {"model": args.model, "threads": torch.get_num_threads(),
              "grad_elements": sum(g.numel() for g in grads),
              "grad_dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in grads}),
              "guard_on": rounds.summary("guard_on").as_dict(), "guard_off": rounds.summary("guard_off").as_dict(),
              "paired_ratio": ratio.as_dict(unit="x"), "scan": scan.summary("scan").as_dict()}
    print(f"{args.model}: step with the guard / without: median {ratio.median:.4f} (spread {ratio.spread:.3f}); "
          f"steps {rounds.summary('guard_on').median * 1e3:.1f} / {rounds.summary('guard_off').median * 1e3:.1f} ms; "
          f"the scan alone {scan.summary('scan').median * 1e3:.2f} ms over "
          f"{result['grad_elements'] / 1e6:.1f}M gradient elements")
    return report.write(args.json, result)


if __name__ == "__main__":
    main()
