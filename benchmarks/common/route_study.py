"""A native-policy route's study: op rows (torch against the fused op) and whole-step rows, a model trained under
``optimize(dtype=bf16, bf16_compute="native")`` with every route on, against the same model with one route switched
off (its ``routable`` patched to False), and a second unrouted instance as the noise floor."""
from __future__ import annotations

from unittest import mock


def routed_step(build, loss, route, route_name: str, routed: bool):
    """A zero-argument SGD step of ``build()`` (seeded, momentum 0.9) minimising ``loss(model)``, with ``route`` (a
    ``ipex_train.compute_policy`` route module) on or off, and how many modules ``route_name`` routes in it."""
    import torch

    import ipex_train

    torch.manual_seed(0)
    model = build().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with mock.patch.object(route, "routable", route.routable if routed else (lambda module: False)):
        model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, bf16_compute="native")
    n_routed = ipex_train.compute_policy.routed_modules(model).get(route_name, 0)

    def step():
        opt.zero_grad(set_to_none=True)
        loss(model).backward()
        opt.step()

    return step, n_routed


def suite_step(model_name: str, route, route_name: str, routed: bool):
    """:func:`routed_step` on the benchmark suite's ``model_name`` (MSE against a fixed random target)."""
    import torch

    from benchmarks.common.train_models import MODELS, NUM_CLASSES, example_input

    spec = MODELS[model_name]
    gen = torch.Generator().manual_seed(1)
    x = example_input(spec, gen)  # token ids for the models with a vocabulary
    target = torch.randn(spec.input_shape[0], NUM_CLASSES, generator=gen)
    return routed_step(spec.build, lambda model: (model(x).float() - target).pow(2).mean(), route, route_name, routed)


def linear_operands(tokens: int, n_in: int, n_out: int):
    """bf16 ``x`` (tokens, n_in), ``w`` (n_out, n_in, scaled by n_in^-1/2) and ``b`` (n_out), all requiring grad, and
    an output gradient ``g`` (tokens, n_out): one seeded linear layer's operands for an op study."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n_in, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(n_out, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(tokens, n_out, generator=gen).to(torch.bfloat16)
    return x, w, b, g


def patched_suite_step(model_name: str, patches=()):
    """A zero-argument SGD step (momentum 0.9, MSE on the head against a fixed target) of the suite's ``model_name``
    under ``optimize(dtype=bf16, bf16_compute="native")`` with every route on, each step run inside ``patches``
    (``unittest.mock`` patchers, entered anew per step: what a study switches off); and the optimized model."""
    import contextlib

    import torch

    import ipex_train
    from benchmarks.common.train_models import MODELS, NUM_CLASSES, example_input

    spec = MODELS[model_name]
    gen = torch.Generator().manual_seed(1)
    x = example_input(spec, gen)
    target = torch.randn(spec.input_shape[0], NUM_CLASSES, generator=gen)
    torch.manual_seed(0)
    model = spec.build().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = ipex_train.optimize(model, opt, dtype=torch.bfloat16, bf16_compute="native")

    def step():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            opt.zero_grad(set_to_none=True)
            (model(x).float() - target).pow(2).mean().backward()
            opt.step()

    return step, model


def step_row(make_step, rounds: int) -> dict:
    """:func:`benchmarks.common.timing.routed_against_unrouted` over ``make_step(routed)``'s routed, unrouted and
    control steps (each ``make_step`` returns ``(step, modules routed)``), with the routed module counts."""
    from benchmarks.common.timing import routed_against_unrouted

    routed, n_routed = make_step(True)
    plain, n_plain = make_step(False)
    control, _ = make_step(False)
    return {"modules_routed": n_routed, "modules_routed_in_unrouted": n_plain,
            **routed_against_unrouted(routed, plain, control, rounds)}


def route_step_row(model_name: str, route, route_name: str, rounds: int) -> dict:
    """:func:`step_row` over :func:`suite_step`'s models, with the model's name."""
    return {"model": model_name,
            **step_row(lambda routed: suite_step(model_name, route, route_name, routed), rounds)}


def step_line(row: dict) -> str:
    """One line for a :func:`step_row` row (named by its ``model``, if any)."""
    return (f"{row.get('model', '')} step: unrouted {row['unrouted_ms']:.1f} routed {row['routed_ms']:.1f} ratio "
            f"{row['ratio']:.3f} (spread {row['ratio_spread']:.3f}) control {row['control_ms']:.1f} ratio "
            f"{row['control_ratio']:.3f} ms; modules routed {row['modules_routed']} / in unrouted "
            f"{row['modules_routed_in_unrouted']}")


def run_study(description: str, *, op_cases, op_row, op_header: str, op_line, step_cases=(None,), step_row_of,
              step_header: str | None = None, step_line_of=step_line, meta: dict | None = None,
              argv: list[str] | None = None) -> dict:
    """The ``main()`` of a route's study: parse the command line (``--op-rounds``, ``--step-rounds``, ``--no-op``,
    ``--no-step``, ``--json``, ``--threads``), time ``op_row(case, rounds)`` for each op case and
    ``step_row_of(case, rounds)`` for each step case, printing a header and one line per row, and return (and
    optionally write) the JSON."""
    import torch

    from benchmarks.common import report
    from benchmarks.common.timing import op_and_step_arguments

    args = op_and_step_arguments(description, argv)
    ops, steps = [], []
    for rows, cases, make, header, line, rounds, off in (
            (ops, op_cases, op_row, op_header, op_line, args.op_rounds, args.no_op),
            (steps, step_cases, step_row_of, step_header, step_line_of, args.step_rounds, args.no_step)):
        if off:
            continue
        if header:
            print(header)
        for case in cases:
            rows.append(make(case, rounds))
            print(line(rows[-1]), flush=True)
    return report.write(args.json, {"meta": {"threads": torch.get_num_threads(), **(meta or {})}, "op": ops,
                                    "step": steps}, indent=1)


def run_two_column_study(description: str, op_shapes, op_row, step_row_of, shape_label: str,
                         argv: list[str] | None = None) -> dict:
    """:func:`run_study` for a fused op whose op rows compare torch against it (``op_row(shape, rounds)`` ->
    ``torch_ms``, ``fused_ms``, ``ratio``) and whose one step row is ``step_row_of(rounds)``."""
    width = max(16, len(shape_label) + 2)
    return run_study(
        description, op_cases=op_shapes, op_row=op_row,
        op_header=f"op bf16 fwd+bwd: {shape_label:>{width}}{'torch':>9}{'fused':>9}{'ratio':>7}  (ms)",
        op_line=lambda row: (f"{'':<17}{str(tuple(row['shape'])):>{width}}{row['torch_ms']:9.2f}"
                             f"{row['fused_ms']:9.2f}{row['ratio']:7.3f}"),
        step_row_of=lambda _, rounds: step_row_of(rounds), argv=argv)
