"""The whole-step half of a native-policy route's study: a benchmark-suite model trained under
``optimize(dtype=bf16, bf16_compute="native")`` with every route on, against the same model with one route switched
off (its ``routable`` patched to False), and a second unrouted instance as the noise floor."""
from __future__ import annotations

from unittest import mock


def suite_step(model_name: str, route, route_name: str, routed: bool):
    """A zero-argument SGD step (MSE against a fixed random target) of the suite's ``model_name``, with ``route`` (a
    ``ipex_train.compute_policy`` route module) on or off, and how many modules ``route_name`` routes in it."""
    import torch

    import ipex_train
    from benchmarks.common.train_models import MODELS, NUM_CLASSES

    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with mock.patch.object(route, "routable", route.routable if routed else (lambda module: False)):
        model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, bf16_compute="native")
    n_routed = ipex_train.compute_policy.routed_modules(model).get(route_name, 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(spec.input_shape, generator=gen)
    target = torch.randn(spec.input_shape[0], NUM_CLASSES, generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() - target).pow(2).mean()
        loss.backward()
        opt.step()

    return step, n_routed


def route_step_row(model_name: str, route, route_name: str, rounds: int) -> dict:
    """:func:`benchmarks.common.timing.routed_against_unrouted` over :func:`suite_step`'s routed, unrouted and
    control models, with the model's name and how many modules the route took in the routed and unrouted ones."""
    from benchmarks.common.timing import routed_against_unrouted

    routed, n_routed = suite_step(model_name, route, route_name, True)
    plain, n_plain = suite_step(model_name, route, route_name, False)
    control, _ = suite_step(model_name, route, route_name, False)
    return {"model": model_name, "modules_routed": n_routed, "modules_routed_in_unrouted": n_plain,
            **routed_against_unrouted(routed, plain, control, rounds)}


def print_step_row(row: dict) -> None:
    """One line for a :func:`route_step_row` row."""
    print(f"{row['model']} step: unrouted {row['unrouted_ms']:.1f} routed {row['routed_ms']:.1f} ratio "
          f"{row['ratio']:.3f} (spread {row['ratio_spread']:.3f}) control {row['control_ms']:.1f} ratio "
          f"{row['control_ratio']:.3f} ms; modules routed {row['modules_routed']} / in unrouted "
          f"{row['modules_routed_in_unrouted']}", flush=True)


def run_two_column_study(description: str, op_shapes, op_row, step_row, shape_label: str,
                         argv: list[str] | None = None) -> dict:
    """The ``main()`` of a fused op's study whose op rows compare torch against the fused op (``op_row(shape,
    rounds)`` -> ``torch_ms``, ``fused_ms``, ``ratio``) and whose step row is ``step_row(rounds)`` (a
    :func:`route_step_row`): parse the study's command line, print both tables, return (and optionally write) the
    JSON."""
    import torch

    from benchmarks.common import report
    from benchmarks.common.timing import op_and_step_arguments

    args = op_and_step_arguments(description, argv)
    ops = []
    width = max(16, len(shape_label) + 2)
    if not args.no_op:
        print(f"op bf16 fwd+bwd: {shape_label:>{width}}{'torch':>9}{'fused':>9}{'ratio':>7}  (ms)")
    for shape in () if args.no_op else op_shapes:
        row = op_row(shape, args.op_rounds)
        ops.append(row)
        print(f"{'':<17}{str(shape):>{width}}{row['torch_ms']:9.2f}{row['fused_ms']:9.2f}{row['ratio']:7.3f}",
              flush=True)
    steps = []
    if not args.no_step:
        row = step_row(args.step_rounds)
        steps.append(row)
        print_step_row(row)
    return report.write(args.json, {"meta": {"threads": torch.get_num_threads()}, "op": ops, "step": steps},
                        indent=1)
