"""One fp32 input cast once for the projections that read it, against a cast per projection, alone and in whole
Llama training steps.

``python -m benchmarks.studies.shared_input_cast [--json PATH] [--threads N] [--op-rounds 15] [--step-rounds 5]
[--no-step] [--no-op]``

Why: ``optimize(dtype=bf16)`` keeps RMSNorm weights fp32, so a Hugging Face Llama RMSNorm (``weight * x``) returns
fp32 even on a bf16 stream, and each bf16 projection after it casts that output for itself (forward pre-hook), as
autocast does: five casts a decoder layer forward, five casts of the input gradients back and fp32 adds of them.
The native policy's rotary and SwiGLU routes cast it once for q/k/v and once for gate/up
(``compute_policy._swap.shared_input_cast``). This measures that on the machine at hand:

- op: a (4, 256, 768) fp32 input through three bf16 ``nn.Linear`` projections (768 -> 768, 256, 256, optimize()'s
  input-cast hooks on them), forward + backward, each casting against one shared cast, interleaved rounds.
- step: the benchmark suite's ``llama_s256_tokens`` (token ids: a bf16 stream, the norms' outputs fp32) and
  ``llama_s256`` (fp32 embeddings: an fp32 stream) under ``optimize(dtype=bf16, bf16_compute="native")``, with the
  shared cast against the same model with it switched off, steps interleaved with a second switched-off instance
  (``control``: the ratio two identical models give here); and, from 3 profiled steps each way, the casts per step
  (``aten::_to_copy`` calls) and the self time of ``aten::copy_`` per step.

Backs docs/compute_policy.md, "One cast for the projections of one input".
"""
from __future__ import annotations

from unittest import mock

import torch

from benchmarks.common.route_study import patched_suite_step, run_study
from benchmarks.common.timing import interleaved, routed_against_unrouted

BF16 = torch.bfloat16
OP_SHAPE = (4, 256, 768)
STEP_MODELS = ("llama_s256_tokens", "llama_s256")
PROFILED_STEPS = 3


def _no_sharing():
    """Patches that turn the shared cast off in the two routes (each projection casts for itself again)."""
    from ipex_train.compute_policy import _rope, _swiglu

    def as_is(modules, x):
        return x

    return tuple(mock.patch.object(route, "shared_input_cast", as_is) for route in (_rope, _swiglu))


def _op_row(_case, rounds: int) -> dict:
    from ipex_train.compute_policy._swap import shared_input_cast
    from ipex_train.precision.casts import register_input_casts

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    projections = torch.nn.ModuleList(torch.nn.Linear(OP_SHAPE[-1], n, bias=False) for n in (768, 256, 256)).to(BF16)
    register_input_casts(projections)
    x = torch.randn(OP_SHAPE, generator=gen).requires_grad_()

    def each():
        return torch.autograd.grad(sum(p(x).float().sum() for p in projections), x)

    def shared():
        h = shared_input_cast(projections, x)
        return torch.autograd.grad(sum(p(h).float().sum() for p in projections), x)

    rs = interleaved({"each": each, "shared": shared}, rounds, repeats=5, warmup=3)
    med = rs.median()
    return {"shape": list(OP_SHAPE), "each_ms": med["each"] * 1e3, "shared_ms": med["shared"] * 1e3,
            "ratio": rs.paired("shared", "each").median}


def _suite_step(model_name: str, shared: bool):
    """A step of the suite's ``model_name`` with the shared cast on or off, and its casts per step."""
    step, _ = patched_suite_step(model_name, () if shared else _no_sharing())
    step()
    with torch.profiler.profile() as prof:
        for _ in range(PROFILED_STEPS):
            step()
    events = prof.key_averages()
    casts = {"calls": sum(e.count for e in events if e.key == "aten::_to_copy") // PROFILED_STEPS,
             "copy_ms": sum(e.self_cpu_time_total for e in events if e.key == "aten::copy_") / 1e3 / PROFILED_STEPS}
    return step, casts


def _step_row(model_name: str, rounds: int) -> dict:
    shared, casts_shared = _suite_step(model_name, True)
    each, casts_each = _suite_step(model_name, False)
    control, _ = _suite_step(model_name, False)
    return {"model": model_name,
            "casts_per_step_shared": casts_shared["calls"], "casts_per_step_each": casts_each["calls"],
            "copy_ms_per_step_shared": casts_shared["copy_ms"], "copy_ms_per_step_each": casts_each["copy_ms"],
            **routed_against_unrouted(shared, each, control, rounds)}


def _step_line(r: dict) -> str:
    return (f"  {r['model']}: each {r['unrouted_ms']:.1f} shared {r['routed_ms']:.1f} ratio {r['ratio']:.3f} (spread "
            f"{r['ratio_spread']:.3f}) control ratio {r['control_ratio']:.3f}; casts per step "
            f"{r['casts_per_step_each']} -> {r['casts_per_step_shared']}, aten::copy_ self ms per step (profiled) "
            f"{r['copy_ms_per_step_each']:.1f} -> {r['copy_ms_per_step_shared']:.1f}")


def main(argv: list[str] | None = None) -> dict:
    """Time the op row and the step rows, print them and return (and optionally write) the JSON."""
    return run_study(
        __doc__.splitlines()[0], op_cases=(None,), op_row=_op_row,
        op_header="op: fp32 (4, 256, 768) into three bf16 projections, forward + backward (ms)",
        op_line=lambda r: f"  cast each {r['each_ms']:.3f}  shared {r['shared_ms']:.3f}  ratio {r['ratio']:.3f}",
        step_cases=STEP_MODELS, step_row_of=_step_row,
        step_header="step, ms: a cast per projection ('each') against one shared cast, and a second 'each' instance",
        step_line_of=_step_line, argv=argv)


if __name__ == "__main__":
    main()
