"""Would oneDNN's plain-tensor int8 ops (``onednn::qconv2d_pointwise`` and its ``.binary`` overload, which fuses a
residual add + relu into the convolution) beat the quantized-tensor kernels ipex_train.quantization runs today?

    python -m benchmarks.studies.int8_onednn_ops [--quick] [--json PATH]

A study, not part of ``python -m benchmarks``; it backs docs/benchmarks.md, "oneDNN plain-tensor int8 ops and a fused
residual add (measured, not adopted)".
In one process, variants called in turn within each round; medians over rounds, and each speedup the median over
rounds of the per-round ratio:

* single convolutions of ResNet-50 shapes and BERT-sized linears: (a) ``quantized::conv2d(_relu)`` /
  ``quantized::linear`` with oneDNN-packed weights on quantized tensors against (b) ``onednn::qconv2d_pointwise`` /
  ``qlinear_pointwise`` with ``onednn::qconv_prepack``/``qlinear_prepack`` weights on plain uint8 tensors;
* ResNet-50's 16 residual convolutions (1x1, then + identity, relu), each stage's shape and block count: (a) conv
  + ``quantized::add_relu`` against (b) ``.binary`` with a "sum" post-op and (c) ``quantized::conv2d_add_relu``;
  (b) and (c) write into their accumulator, so each is timed with a copy of the identity (what a runtime needs when
  the identity is read again) and without ("no copy"); plus each output's error in output steps against the fp32
  computation on the same int8 inputs;
* in the same rounds, the whole ipex_train int8 ResNet-50 (eager), so the residual saving is a share of a forward;
* what a prepacked weight costs where it cannot be kept (every ResNet-50 convolution prepacked once);
* whether a module calling these ops traces, freezes, saves and loads in a fresh process without ipex_train;
* whether they saturate u8 x s8 pair sums with oneDNN capped to AVX2 (no VNNI), as the quantized kernels do.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import List, Optional  # noqa: F401, UP035  (named by _no_scalars' TorchScript type comment)

import torch
import torch.ao.nn.quantized as nnq

from benchmarks.common import report
from benchmarks.common.inference_models import resnet50
from benchmarks.common.timing import interleaved
from ipex_train import quantization

ONEDNN = torch.ops.onednn
# (input channels, output channels, kernel, stride, input size, relu) of single convolutions in ResNet-50
CONVS = [(64, 256, 1, 1, 56, False), (64, 64, 3, 1, 56, True), (256, 64, 1, 1, 56, True),
         (128, 128, 3, 2, 56, True), (256, 512, 1, 2, 56, False)]
# ResNet-50's residual convolutions: (mid channels, output channels, size, blocks of that stage)
RESIDUAL = [(64, 256, 56, 3), (128, 512, 28, 4), (256, 1024, 14, 6), (512, 2048, 7, 3)]
LINEARS = [(768, 768), (768, 3072), (3072, 768)]
BASE, FORWARD = "quantized conv + add_relu", "ipex_train int8 forward"


def _qparams(t: torch.Tensor) -> tuple[float, int]:
    """uint8 affine scale and zero point covering t's range (what min-max calibration records)."""
    lo, hi = min(t.min().item(), 0.0), max(t.max().item(), 0.0)
    scale = max(hi - lo, 1e-8) / 255
    return scale, round(-lo / scale)


def _u8(t, scale, zp):
    return torch.clamp(torch.round(t / scale) + zp, 0, 255).to(torch.uint8)


class Conv:
    """One int8 convolution in both forms: an nnq.Conv2d packed for the onednn engine and a prepacked onednn
    weight, with calibrated qparams; with ``residual``, also a uint8 identity and the qparams of relu(conv + it)."""

    def __init__(self, cin, cout, k, stride, size, batch, relu, residual=False):
        self.stride, self.pad = [stride] * 2, [k // 2] * 2
        self.relu = relu and not residual  # the conv's own relu; a residual's relu follows the add
        xf = torch.randn(batch, cin, size, size).relu().contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, k, k) / (cin * k * k) ** 0.5
        self.ws = (w.abs().amax(dim=(1, 2, 3)) / 127).float()
        self.wz = torch.zeros(cout, dtype=torch.long)
        qw = torch.quantize_per_channel(w, self.ws.double(), self.wz, 0, torch.qint8)
        self.b = torch.randn(cout) * 0.1
        self.xs, self.xz = _qparams(xf)
        self.x = _u8(xf, self.xs, self.xz)
        self.qx = torch._make_per_tensor_quantized_tensor(self.x, self.xs, self.xz)
        ref = torch.nn.functional.conv2d((self.x.float() - self.xz) * self.xs, qw.dequantize(), self.b,
                                         stride, k // 2)
        self.cs, self.cz = _qparams(ref.relu() if self.relu else ref)  # the conv's own output
        self.module = nnq.Conv2d(cin, cout, k, stride=stride, padding=k // 2)
        self.module.set_weight_bias(qw, self.b)
        self.packed = ONEDNN.qconv_prepack(qw.int_repr(), self.ws, self.xs, self.xz, self.stride, self.pad, [1, 1],
                                           1, list(self.x.shape))
        if residual:
            idf = torch.randn(ref.shape).relu().contiguous(memory_format=torch.channels_last)
            self.ids, self.idz = _qparams(idf)
            self.identity = _u8(idf, self.ids, self.idz)
            self.q_identity = torch._make_per_tensor_quantized_tensor(self.identity.clone(), self.ids, self.idz)
            self.q_conv = self.quantized()  # the conv's int8 output, to time add_relu alone
            self.scratch = self.identity.clone()  # overwritten by the timing-only "no copy" variants
            self.q_scratch = self.q_identity.clone()
            ref = (ref + (self.identity.float() - self.idz) * self.ids).relu()
            self.os, self.oz = _qparams(ref)
            self.ref = torch.round(ref / self.os) + self.oz  # one rounding, no clamp needed: range covered

    def quantized(self):
        kernel = torch.ops.quantized.conv2d_relu if self.relu else torch.ops.quantized.conv2d
        return kernel(self.qx, self.module._packed_params, self.cs, self.cz)

    def onednn(self):
        return ONEDNN.qconv2d_pointwise(self.x, self.xs, self.xz, self.packed, self.ws, self.wz, self.b, self.stride,
                                        self.pad, [1, 1], 1, self.cs, self.cz, None, "relu" if self.relu else "none",
                                        [], "")

    def quantized_residual(self):
        y = torch.ops.quantized.conv2d(self.qx, self.module._packed_params, self.cs, self.cz)
        return torch.ops.quantized.add_relu(y, self.q_identity, self.os, self.oz)

    def quantized_fused(self, copy=True):
        accum = self.q_identity.clone() if copy else self.q_scratch  # it writes into its accumulator too
        return torch.ops.quantized.conv2d_add_relu(self.qx, accum, self.module._packed_params, self.os, self.oz)

    def add_relu(self):
        return torch.ops.quantized.add_relu(self.q_conv, self.q_identity, self.os, self.oz)

    def onednn_residual(self, copy=True):
        accum = self.identity.clone() if copy else self.scratch  # "no copy" overwrites scratch: timing only
        return ONEDNN.qconv2d_pointwise.binary(self.x, self.xs, self.xz, self.packed, self.ws, self.wz, accum, self.b,
                                               self.stride, self.pad, [1, 1], 1, self.os, self.oz, None, self.ids,
                                               self.idz, "sum", 1.0, "relu", [], "")


def _time(fns: dict, rounds: int, calls: int) -> dict:
    """Per variant, the mean ms per call of each round; each round calls every variant in turn (A, B, A, B...)."""
    per_round = interleaved(fns, rounds, calls, warmup=1).per_round  # the warm-up creates oneDNN's primitives
    return {k: [s * 1e3 for s in seconds] for k, seconds in per_round.items()}


def _paired(per: dict, slow: str, fast: str) -> float:
    """Median over rounds of per[slow] / per[fast] (> 1: ``fast`` is faster); rounds share the machine's load."""
    return statistics.median(a / b for a, b in zip(per[slow], per[fast]))


def _median(per: dict) -> dict:
    return {k: statistics.median(v) for k, v in per.items()}


def _steps(got, ref) -> dict:
    d = (got.float() - ref.float()).abs()
    return {"max": d.max().item(), "frac_over_1": (d > 1).float().mean().item()}


def _linears(k: int, n: int, tokens: int) -> dict:
    """A k->n int8 linear on ``tokens`` rows as quantized::linear and as onednn::qlinear_pointwise (the latter's
    weight prepacked for this input shape)."""
    x = torch.randint(0, 256, (tokens, k), dtype=torch.uint8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ws, wz, b = torch.rand(n) * 1e-3, torch.zeros(n, dtype=torch.long), torch.randn(n)
    m = nnq.Linear(k, n)
    m.set_weight_bias(torch._make_per_channel_quantized_tensor(w, ws.double(), wz, 0), b)
    qx, packed = torch._make_per_tensor_quantized_tensor(x, 0.02, 0), ONEDNN.qlinear_prepack(w, [tokens, k])
    return {"quantized": lambda: torch.ops.quantized.linear(qx, m._packed_params._packed_params, 0.5, 3),
            "onednn": lambda: ONEDNN.qlinear_pointwise(x, 0.02, 0, packed, ws, wz, b, 0.5, 3, None, "none", [], "")}


def single_ops(batch, rounds, calls) -> list:
    """Single convolutions and linears, quantized-tensor kernel against onednn plain-tensor op."""
    rows = []
    for cin, cout, k, s, size, relu in CONVS:
        c = Conv(cin, cout, k, s, size, batch, relu)
        t = _time({"quantized": c.quantized, "onednn": c.onednn}, rounds, calls)
        diff = (c.quantized().int_repr().int() - c.onednn().int()).abs().max().item()
        rows.append({"op": f"conv {cin}->{cout} k{k} s{s} {size}px{' relu' if relu else ''}", "ms": _median(t),
                     "speedup": _paired(t, "quantized", "onednn"), "max_code_diff": diff})
    for k, n in LINEARS:
        tokens = 128 * batch
        fns = _linears(k, n, tokens)
        t = _time(fns, rounds, calls)
        diff = (fns["quantized"]().int_repr().int() - fns["onednn"]().int()).abs().max().item()
        rows.append({"op": f"linear {k}->{n} {tokens} tokens", "ms": _median(t),
                     "speedup": _paired(t, "quantized", "onednn"), "max_code_diff": diff})
    return rows


def residual(batch, rounds, calls, model) -> dict:
    """ResNet-50's residual convolutions, summed over its blocks, timed in the same rounds as the whole model."""
    convs = [(Conv(mid, out, 1, 1, size, batch, True, residual=True), blocks) for mid, out, size, blocks in RESIDUAL]
    x = torch.randn(batch, 3, 224, 224)

    def total(method, **kw):
        return lambda: [getattr(c, method)(**kw) for c, blocks in convs for _ in range(blocks)]

    fused = {"quantized::conv2d_add_relu": total("quantized_fused"),
             "quantized::conv2d_add_relu, no copy": total("quantized_fused", copy=False),
             "onednn binary": total("onednn_residual"), "onednn binary, no copy": total("onednn_residual", copy=False)}
    fns = {BASE: total("quantized_residual"), "quantized conv alone": total("quantized"),
           "add_relu alone": total("add_relu"), "onednn conv alone": total("onednn"), **fused,
           FORWARD: lambda: model(x)}
    with torch.no_grad():
        t = _time(fns, rounds, calls)
    errors = {f"{c.x.shape[1]}->{c.identity.shape[1]}": {
        "quantized": _steps(c.quantized_residual().int_repr(), c.ref), "onednn": _steps(c.onednn_residual(), c.ref),
        "quantized conv2d_add_relu": _steps(c.quantized_fused().int_repr(), c.ref)} for c, _ in convs}
    # per fused variant: its speedup over conv + add_relu, and the time it saves as a share of the whole forward
    saved = {k: {"speedup": _paired(t, BASE, k), "share_of_forward": statistics.median(
        (a - b) / f for a, b, f in zip(t[BASE], t[k], t[FORWARD]))} for k in fused}
    return {"ms": _median(t), "fused": saved, "error_steps": errors}


def prepack_cost() -> dict:
    """ms to prepack every ResNet-50 convolution weight once (what a graph that cannot hold them pays per call)."""
    convs = [m for m in resnet50().modules() if isinstance(m, torch.nn.Conv2d)]
    args = [(torch.randint(-127, 128, c.weight.shape, dtype=torch.int8), torch.rand(c.out_channels) * 0.01,
             list(c.stride), list(c.padding)) for c in convs]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for w, ws, stride, pad in args:
            ONEDNN.qconv_prepack(w, ws, 0.02, 0, stride, pad, [1, 1], 1, None)
        times.append((time.perf_counter() - start) * 1e3)
    return {"convolutions": len(args), "ms": statistics.median(times)}


@torch.jit.script
def _no_scalars():
    # type: () -> List[Optional[number]]
    return []  # the ops' Scalar?[] argument: the tracer cannot record one, TorchScript can (typed via `number`)


@torch.jit.script
def _qconv(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, wz: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qconv2d_pointwise(x, 0.02, 0, w, ws, wz, b, [1, 1], [1, 1], [1, 1], 1, 0.05, 3, None,
                                              "relu", _no_scalars(), "")


class _Holder(torch.jit.ScriptModule):
    """A prepacked weight that serializes as its int8 form and is prepacked again on load."""

    def __init__(self, w, ws):
        super().__init__()
        self.w, self.ws, self.wz, self.b = w, ws, torch.zeros(w.shape[0], dtype=torch.long), torch.zeros(w.shape[0])
        self.packed = ONEDNN.qconv_prepack(w, ws, 0.02, 0, [1, 1], [1, 1], [1, 1], 1, None)

    @torch.jit.script_method
    def __getstate__(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        return self.w, self.ws, self.training

    @torch.jit.script_method
    def __setstate__(self, state: tuple[torch.Tensor, torch.Tensor, bool]) -> None:
        self.w, self.ws, self.training = state
        self.wz, self.b = torch.zeros(self.w.shape[0], dtype=torch.long), torch.zeros(self.w.shape[0])
        self.packed = torch.ops.onednn.qconv_prepack(self.w, self.ws, 0.02, 0, [1, 1], [1, 1], [1, 1], 1, None)

    @torch.jit.script_method
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _qconv(x, self.packed, self.ws, self.wz, self.b)


class _Model(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, w, self.ws = how, torch.randint(-127, 128, (16, 8, 3, 3), dtype=torch.int8), torch.rand(16) * 0.01
        self.w = w if how == "prepack in graph" else ONEDNN.qconv_prepack(w, self.ws, 0.02, 0, [1, 1], [1, 1], [1, 1],
                                                                          1, None)
        self.holder = _Holder(w, self.ws) if how.startswith("script") else None
        self.wz, self.b = torch.zeros(16, dtype=torch.long), torch.zeros(16)

    def forward(self, x):
        x = _u8(x, 0.02, 0).contiguous(memory_format=torch.channels_last)
        if self.holder is not None:
            y = self.holder(x)
        elif self.how == "prepack in graph":
            packed = ONEDNN.qconv_prepack(self.w, self.ws, 0.02, 0, [1, 1], [1, 1], [1, 1], 1, None)
            y = _qconv(x, packed, self.ws, self.wz, self.b)
        else:
            y = _qconv(x, self.w, self.ws, self.wz, self.b)
        return (y.float() - 3) * 0.05


_LOAD = ("import sys, torch; m = torch.jit.load(sys.argv[1]).eval(); x, ref = torch.load(sys.argv[2]); "
         "print(torch.equal(m(x), ref), torch.equal(torch.jit.freeze(m)(x), ref), 'ipex_train' in sys.modules, "
         "torch.backends.quantized.engine)")


def serialization() -> dict:
    """How a module calling onednn::qconv2d_pointwise survives trace (+ freeze), save and a fresh-process load."""
    out = {}
    x = torch.rand(2, 8, 8, 8)
    for how in ("prepacked attribute", "prepack in graph", "script holder, frozen", "script holder, not frozen"):
        model = _Model(how).eval()
        try:
            with torch.no_grad():
                ref = model(x)
                traced = torch.jit.trace(model, x, check_trace=False)
                if not how.endswith("not frozen"):
                    traced = torch.jit.freeze(traced)
            with tempfile.TemporaryDirectory() as d:
                traced.save(f"{d}/m.pt")
                torch.save((x, ref), f"{d}/io.pt")
                run = subprocess.run([sys.executable, "-c", _LOAD, f"{d}/m.pt", f"{d}/io.pt"], capture_output=True,
                                     text=True, check=False)
            equal, frozen, imported, engine = run.stdout.split() if run.returncode == 0 else ("",) * 4
            out[how] = (f"saved; fresh process: equal={equal}, equal after freezing there={frozen}, "
                        f"ipex_train imported={imported}, engine={engine}"
                        if run.returncode == 0 else f"load failed: {run.stderr.strip().splitlines()[-1]}")
        except (RuntimeError, NotImplementedError) as e:
            out[how] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return out


_SATURATION = (
    "import torch; w = torch.full((1, 64, 1, 1), 127, dtype=torch.int8); one = torch.ones(1); "
    "zero = torch.zeros(1, dtype=torch.long); "
    "x = torch.full((1, 64, 2, 2), 255, dtype=torch.uint8).contiguous(memory_format=torch.channels_last); "
    "p = torch.ops.onednn.qconv_prepack(w, one, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None); "
    "print(torch.ops.onednn.qconv2d_pointwise(x, 1.0, 0, p, one, zero, None, [1, 1], [0, 0], [1, 1], 1, "
    "64 * 255 * 127 / 200, 0, None, 'none', [], '').reshape(-1)[0].item())")


def saturation() -> dict:
    """What a 64-input conv of u8 255 x s8 127 returns (exact: 200) natively and with oneDNN capped to AVX2 (no
    VNNI: pair sums saturate to int16); a subprocess each, as oneDNN reads the cap once."""
    out = {}
    for isa in (None, "AVX2"):
        env = dict(os.environ, **({"ONEDNN_MAX_CPU_ISA": isa} if isa else {}))
        run = subprocess.run([sys.executable, "-c", _SATURATION], capture_output=True, text=True, env=env,
                             check=False)
        out[isa or "native"] = run.stdout.strip() or run.stderr.strip().splitlines()[-1]
    return out


def run(quick: bool) -> dict:
    """Every measurement, printed as it comes; returns them all."""
    # quantized modules packed and run for oneDNN, as ipex_train.quantization packs them (and conv2d_add_relu
    # exists only there)
    torch.backends.quantized.engine = "onednn"
    rounds = 5 if quick else 11
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "quick": quick,
              "serialization": serialization(), "saturation": saturation(), "prepack": prepack_cost(),
              "batches": {}}
    for how, what in result["serialization"].items():
        print(f"serialization, {how}: {what}")
    print("onednn::qconv2d_pointwise, 64 inputs of 255 x 127 (exact: 200): "
          + ", ".join(f"{isa} {v}" for isa, v in result["saturation"].items()))
    print(f"prepacking all {result['prepack']['convolutions']} ResNet-50 conv weights: "
          f"{result['prepack']['ms']:.1f} ms")
    model = resnet50()
    with torch.no_grad():
        prepared = quantization.prepare(model, example_inputs=torch.randn(2, 3, 224, 224))
        for _ in range(2):
            prepared(torch.randn(2, 3, 224, 224))
        int8 = quantization.convert(prepared)
    for batch in (1, 16):
        with torch.no_grad():  # calls per round: 5-20 ms of single ops, one ResNet-50 pass at batch 16
            ops = single_ops(batch, rounds, 30 if batch == 1 else 5)
            res = residual(batch, rounds, 10 if batch == 1 else 1, int8)
        result["batches"][batch] = {"ops": ops, "residual": res}
        for row in ops:
            t = row["ms"]
            print(f"b{batch:<2d} {row['op']:34s} quantized {t['quantized']:7.3f} ms  onednn {t['onednn']:7.3f} ms  "
                  f"onednn speedup {row['speedup']:.2f}x  max code diff {row['max_code_diff']}")
        print(f"b{batch:<2d} ResNet-50's 16 residual convs, medians:" + ",".join(f" {k} {v:.2f} ms"
                                                                             for k, v in res["ms"].items()))
        for k, r in res["fused"].items():
            print(f"b{batch:<2d}   {k}: {r['speedup']:.2f}x {BASE}, saves {r['share_of_forward']:.1%} of a forward")
        for shape, e in res["error_steps"].items():
            print(f"b{batch:<2d}   residual {shape}, error in output steps vs fp32 on the int8 inputs: "
                  + ", ".join(f"{k} max {v['max']:.0f}, >1: {v['frac_over_1']:.2%}" for k, v in e.items()))
    return result


def main(argv=None):
    warnings.filterwarnings("ignore", message=r".*(quantiz|deprecated).*")  # torch 2.14 deprecates quantized tensors
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 11")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.quick)
    report.write(args.json, result, indent=1)


if __name__ == "__main__":
    main()
