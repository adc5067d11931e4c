"""Inference throughput: eager fp32 vs stock TorchScript + oneDNN Graph fusion vs ipex_train export vs torch.compile.

    python -m benchmarks.suite.bench_inference [--quick] [--json PATH]

Models: ResNet-50 (torchvision, weights=None, 224x224), a BERT-style encoder (nn.TransformerEncoder, d_model
768, 12 heads, seq 128) and ``bert_style`` (benchmarks.common.inference_models.BertStyleEncoder: the same layer written
out with Q/K/V projections and softmax attention, as HuggingFace BERT computes it, which PyTorch's fused encoder
fast path does not take), batch 1 and 16. Variants, all measured in the same run on the same inputs:

* eager: model(x) under torch.no_grad();
* stock_jit: torch.jit.trace + freeze with torch's oneDNN fusion switch on;
* ipex_train: fold_conv_bn + fold_linear_bn + replace_dropout, channels-last for the CNN (its input converted
  inside the timed call), then ipex_train.inference.export;
* ipex_train_bf16: the same TorchScript export of a bf16 copy (fp32 input cast before the call);
* compile: torch.compile (skipped with --quick: it takes minutes per model and batch here);
* aoti_fp32, aoti_bf16: ipex_train.inference.export(backend="aoti") packages (torch.export + AOTInductor with
  freezing; bf16 weights/compute, fp32 input cast inside), loaded with torch._inductor.aoti_load_package;
  aoti_bf16_nopasses: the bf16 package with export's graph passes off (no Q/K/V fusion, softmax left to Inductor);
  compile_fp32, compile_bf16: stock torch.compile with Inductor freezing (--compile, also with --quick).

``--models resnet50,bert_encoder,bert_style``, ``--batches 1,16`` and ``--variants`` pick a subset.

Each time is the median of interleaved repeats after warm-up; throughput is samples/s. A dynamic-shape section
measures what a shape change costs an exported ResNet-50 (first calls at the new shape, then steady state) with
torch's global fusion switch off and on. Targets are printed as PASS/FAIL, never asserted.
"""
import argparse
import copy
import functools
import time
import warnings

import torch
import torchvision
from torch import nn

from benchmarks.common import inference_variants, report
from benchmarks.common.inference_models import BertStyleEncoder
from benchmarks.common.targets import Target, print_targets

RESNET_TARGET = 1.7  # ipex_train export vs eager, ResNet-50 batch 16


def _resnet():
    return torchvision.models.resnet50(weights=None).eval(), (3, 224, 224)


def _bert(layers):
    def make():
        layer = nn.TransformerEncoderLayer(768, 12, 3072, activation="gelu", batch_first=True)
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval(), (128, 768)
    return make


def _bert_style(layers):
    def make():
        return BertStyleEncoder(layers).eval(), (128, 768)
    return make


def _stock_jit(model, x):
    before = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated")
            scripted = torch.jit.freeze(torch.jit.trace(copy.deepcopy(model), x, check_trace=False))
            for _ in range(2):
                scripted(x)
    finally:
        torch.jit.enable_onednn_fusion(before)
    return scripted


def _compiled(model, x):
    compiled = torch.compile(copy.deepcopy(model))
    with torch.no_grad():
        compiled(x)
    return compiled


def _time(fns, x, repeats, warmup):
    """Median seconds per call and relative spread (IQR / median) of each fn, one call of each in turn a round."""
    timed = inference_variants.time_on(fns, x, repeats, warmup=warmup)
    return {name: {"median_s": timed.summary(name).median, "spread": timed.summary(name).spread} for name in fns}


def _case(name, make, batch, args):
    torch.manual_seed(0)
    model, shape = make()
    x = torch.randn((batch,) + shape)
    builders = {"stock_jit": _stock_jit, "ipex_train": inference_variants.ipex_train_export,
                "ipex_train_bf16": lambda m, x: inference_variants.ipex_train_export(m, x, torch.bfloat16),
                "aoti_fp32": lambda m, x: inference_variants.aoti(m, x, torch.float32),
                "aoti_bf16": lambda m, x: inference_variants.aoti(m, x, torch.bfloat16),
                "aoti_bf16_nopasses": lambda m, x: inference_variants.aoti(m, x, torch.bfloat16, passes=False)}
    if not args.quick:
        builders["compile"] = _compiled
    if args.compile:
        builders["compile_fp32"] = lambda m, x: inference_variants.compile_freezing(m, x, torch.float32)
        builders["compile_bf16"] = lambda m, x: inference_variants.compile_freezing(m, x, torch.bfloat16)
    if args.variants:
        builders = {v: b for v, b in builders.items() if v in args.variants.split(",")}
    fns = {"eager": model}
    build_s, skipped = {}, {}
    inference_variants.build_each({v: functools.partial(b, model, x) for v, b in builders.items()}, fns, build_s,
                                  skipped)
    if args.quick and (not args.variants or "compile" in args.variants.split(",")):
        skipped["compile"] = "skipped with --quick (torch.compile takes minutes per model and batch here)"
    with torch.no_grad():
        ref = model(x)
        err = {v: (fn(x).float() - ref).abs().max().item() for v, fn in fns.items() if v != "eager"}
    repeats = (3 if args.quick else 7) if batch > 1 else (5 if args.quick else 15)
    timing = _time(fns, x, repeats, warmup=1)
    eager = timing["eager"]["median_s"]
    variants = {v: {**t, "throughput": batch / t["median_s"], "vs_eager": eager / t["median_s"],
                    "build_s": build_s.get(v), "max_abs_err": err.get(v)} for v, t in timing.items()}
    return {"model": name, "batch": batch, "variants": variants, "skipped": skipped}


def _dynamic_shapes():
    """Export ResNet-50 at batch 1, then call it at batch 2: per-call latency of the first calls and the steady
    state, with torch's global fusion switch off (the fallback runs unfused) and on (the fallback re-specialises)."""
    torch.manual_seed(0)
    model, shape = _resnet()
    x1, x2 = torch.randn((1,) + shape), torch.randn((2,) + shape)
    before = torch.jit.onednn_fusion_enabled()
    out = {"eager_b2_s": _time({"eager": model}, x2, 5, 1)["eager"]["median_s"]}
    try:
        for switch in (False, True):
            torch.jit.enable_onednn_fusion(switch)
            run = inference_variants.ipex_train_export(model, x1)
            steady_b1 = _time({"b1": run}, x1, 5, 0)["b1"]["median_s"]
            first_calls = []
            with torch.no_grad():
                for _ in range(4):
                    start = time.perf_counter()
                    run(x2)
                    first_calls.append(time.perf_counter() - start)
            steady_b2 = _time({"b2": run}, x2, 5, 0)["b2"]["median_s"]
            out[f"global_switch_{'on' if switch else 'off'}"] = {
                "steady_b1_s": steady_b1, "first_calls_b2_s": first_calls, "steady_b2_s": steady_b2}
    finally:
        torch.jit.enable_onednn_fusion(before)
    return out


def _no_slower(text: str) -> Target:
    # A shortfall inside the run's spread is still a shortfall (a FAIL marked "within noise"), as in bench_int8.
    return Target(text, 1.0, ">=", noise="fail", text=text)


def run(args):
    """Run the benchmark (args.quick: fewer layers/repeats, no torch.compile; args.json: write results there);
    prints the table and the targets, returns the results dict."""
    layers = 2 if args.quick else 4
    cases = [(n, m) for n, m in (("resnet50", _resnet), ("bert_encoder", _bert(layers)),
                                 ("bert_style", _bert_style(layers))) if n in args.models.split(",")]
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "quick": bool(args.quick),
               "cases": []}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, quick={bool(args.quick)}")
    print(f"{'model':14s} {'batch':>5s} {'variant':11s} {'samples/s':>10s} {'vs eager':>9s} {'spread':>7s} "
          f"{'max err':>9s} {'build s':>8s}")
    for name, make in cases:
        for batch in (int(b) for b in args.batches.split(",")):
            case = _case(name, make, batch, args)
            results["cases"].append(case)
            for variant, r in case["variants"].items():
                err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.1e}"
                build = "" if r["build_s"] is None else f"{r['build_s']:.1f}"
                print(f"{name:14s} {batch:5d} {variant:11s} {r['throughput']:10.2f} {r['vs_eager']:8.2f}x "
                      f"{r['spread']:6.0%} {err:>9s} {build:>8s}", flush=True)
            for variant, reason in case["skipped"].items():
                print(f"{name:14s} {batch:5d} {variant:11s} skipped: {reason}")
    if not args.no_dynamic:
        results["dynamic_shapes"] = dyn = _dynamic_shapes()
        print(f"\ndynamic shapes (ResNet-50 exported at batch 1, called at batch 2; eager batch 2: "
              f"{dyn['eager_b2_s'] * 1e3:.0f} ms)")
        for key in ("global_switch_off", "global_switch_on"):
            d = dyn[key]
            print(f"  {key}: steady b1 {d['steady_b1_s'] * 1e3:.0f} ms; b2 calls "
                  f"{', '.join(f'{t * 1e3:.0f}' for t in d['first_calls_b2_s'])} ms; "
                  f"steady b2 {d['steady_b2_s'] * 1e3:.0f} ms")

    verdicts = []
    for case in results["cases"]:
        v = case["variants"]
        if "ipex_train" not in v:
            continue
        label = f"{case['model']} b{case['batch']}"
        if case["model"] == "resnet50" and case["batch"] == 16:
            text = f"{label}: ipex_train >= {RESNET_TARGET}x eager"
            verdicts.append(Target(text, RESNET_TARGET, ">=", text=text).judge(v["ipex_train"]["vs_eager"]))
        pairs = (("ipex_train", "stock_jit"), ("aoti_fp32", "ipex_train"), ("aoti_fp32", "compile_fp32"),
                 ("aoti_bf16", "ipex_train_bf16"), ("aoti_bf16", "compile_bf16"))
        for ours, other in pairs:
            if ours in v and other in v:
                ratio = v[other]["median_s"] / v[ours]["median_s"]
                spread = max(v[other]["spread"], v[ours]["spread"])
                verdicts.append(_no_slower(f"{label}: {ours} no slower than {other}").judge(ratio, spread))
    print_targets(verdicts, digits=2)
    results["targets"] = verdicts
    return report.write(args.json, results, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 2 encoder layers, no torch.compile")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--models", default="resnet50,bert_encoder",
                        help="comma-separated subset of resnet50, bert_encoder, bert_style")
    parser.add_argument("--variants", help="comma-separated subset of the variants besides eager")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--compile", action="store_true", help="add torch.compile (freezing) fp32/bf16 rows")
    parser.add_argument("--no-dynamic", action="store_true", help="skip the dynamic-shape section")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
