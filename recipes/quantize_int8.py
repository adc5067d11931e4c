"""INT8 deployment of the main job's digits CNN: train in fp32, calibrate on part of the training set, convert with
ipex_train.quantization, then deploy it two ways and reload each in a fresh process (plain torch, no ipex_train)
to evaluate there: accuracy fp32 vs int8 and latency.

* torchscript: convert() (eager int8 kernels), trace + freeze + torch.jit.save -> digits_int8.pt;
* aoti: convert(backend="pt2e") (the same qconf summary as a torchao pt2e graph) and
  ipex_train.inference.export(backend="aoti") -> digits_int8.pt2, loaded with torch._inductor.aoti_load_package
  (batch size dynamic). Compiling the package takes 10-40 s.

    python -m recipes.quantize_int8                 # report + out/quantize_int8/{metrics.json,quantize_int8.png,
                                                    #   qconf.json,digits_int8.pt,digits_int8.pt2}
    python -m recipes.quantize_int8 --epochs 3 --calib-batches 2 --deploy torchscript
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from recipes import _common
from recipes.digits import DigitsCNN, load_digits

# Run in a fresh interpreter: only torch is imported, so this also shows the saved model needs no ipex_train.
_DEPLOY = """
import json, sys, time, statistics, torch
model = torch.jit.freeze(torch.jit.load(sys.argv[1]).eval())
x, y = torch.load(sys.argv[2])
batch = int(sys.argv[3])
with torch.no_grad():
    pred = torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)]).argmax(1)
    ts = []
    for _ in range(20):
        s = time.perf_counter(); model(x[:batch]); ts.append(time.perf_counter() - s)
print(json.dumps({"accuracy": float((pred == y).float().mean()), "latency_ms": 1e3 * statistics.median(ts),
                  "ipex_train_imported": "ipex_train" in sys.modules}))
"""

_DEPLOY_AOTI = _DEPLOY.replace("torch.jit.freeze(torch.jit.load(sys.argv[1]).eval())",
                               "torch._inductor.aoti_load_package(sys.argv[1])")


def train_fp32(seed: int, epochs: int, image_size: int, batch_size: int = 64, progress: bool = False):
    """Train DigitsCNN in plain fp32 PyTorch (SGD, one-cycle LR); returns (eval model, (x_train, y_train),
    (x_test, y_test))."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    (x_train, y_train), test = load_digits(seed, image_size)
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    steps_per_epoch = len(y_train) // batch_size
    scheduler = _common.one_cycle(optimizer, epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed + 1)
    model.train()
    for _ in tqdm(range(epochs), desc="train fp32", disable=not progress):
        perm = torch.randperm(len(y_train), generator=gen)
        for i in range(steps_per_epoch):
            idx = perm[i * batch_size:(i + 1) * batch_size]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
            scheduler.step()
    return model.eval(), (x_train, y_train), test


def calibrate_and_convert(model, x_calib, batch_size: int, qconfig=None, progress: bool = False):
    """prepare -> calibration batches of ``x_calib`` -> convert; returns (prepared, int8 model)."""
    from tqdm import tqdm

    from ipex_train import quantization

    prepared = quantization.prepare(model, qconfig or quantization.default_static_qconfig,
                                    example_inputs=x_calib[:1])
    with torch.no_grad():
        for i in tqdm(range(0, len(x_calib), batch_size), desc="calibrate", disable=not progress):
            prepared(x_calib[i:i + batch_size])
    return prepared, quantization.convert(prepared)


def accuracy(model, x, y, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` on (x, y)."""
    with torch.no_grad():
        pred = torch.cat([model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]).argmax(1)
    return float((pred == y).float().mean())


def _latency_ms(model, x, repeats: int = 20) -> float:
    with torch.no_grad():
        model(x)
        ts = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            ts.append(time.perf_counter() - start)
    return 1e3 * statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    """Train, calibrate, convert, save, reload in a fresh process; print the report, write JSON and plot."""
    parser = argparse.ArgumentParser(prog="python -m recipes.quantize_int8", description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--calib-batches", type=int, default=4, help="calibration batches of 64 training images")
    parser.add_argument("--batch-size", type=int, default=64, help="latency batch size")
    parser.add_argument("--out", default=os.path.join("out", "quantize_int8"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--deploy", choices=("torchscript", "aoti", "both"), default="both",
                        help="which deploy artefact(s) to build and reload")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    progress = not args.no_progress
    from ipex_train import inference, quantization

    model, (x_train, _), (x_test, y_test) = train_fp32(args.seed, args.epochs, args.image_size, progress=progress)
    prepared, int8 = calibrate_and_convert(model, x_train[:64 * args.calib_batches], 64, progress=progress)
    qconf = os.path.join(args.out, "qconf.json")
    prepared.save_qconf_summary(qconf)
    example = x_test[:args.batch_size]
    data = os.path.join(args.out, "test_set.pt")
    torch.save((x_test, y_test), data)
    rows = {"fp32 eager": {"accuracy": accuracy(model, x_test, y_test), "latency_ms": _latency_ms(model, example)},
            "int8 eager": {"accuracy": accuracy(int8, x_test, y_test), "latency_ms": _latency_ms(int8, example)}}
    saved = {}
    if args.deploy in ("torchscript", "both"):
        saved["torchscript"] = os.path.join(args.out, "digits_int8.pt")
        with torch.no_grad():
            torch.jit.freeze(torch.jit.trace(int8, example)).save(saved["torchscript"])
        rows["int8 reloaded (fresh process)"] = _reload(_DEPLOY, saved["torchscript"], data, args.batch_size)
    if args.deploy in ("aoti", "both"):
        saved["aoti"] = os.path.join(args.out, "digits_int8.pt2")
        # The test set ends in a smaller batch: a dynamic batch, which int8 convolutions only get when asked for.
        graph = quantization.convert(prepared, backend="pt2e", example_inputs=example, dynamic_dims=(0,))
        inference.export(graph, example, backend="aoti", path=saved["aoti"],
                         config=inference.AOTIConfig(dynamic_dims=(0,)))
        rows["int8 AOTInductor (fresh process)"] = _reload(_DEPLOY_AOTI, saved["aoti"], data, args.batch_size)
    deployed = next(r for name, r in rows.items() if "fresh process" in name)  # the accuracy line reports it
    needs_ipex = any(r.get("ipex_train_imported") for r in rows.values())
    print(f"\n{'model':32s}{'accuracy':>10s}{'latency ms':>12s}   (batch {args.batch_size})")
    for name, r in rows.items():
        print(f"{name:32s}{100 * r['accuracy']:9.2f}%{r['latency_ms']:12.2f}")
    diff = 100 * (deployed["accuracy"] - rows["fp32 eager"]["accuracy"])
    print(f"\nint8 - fp32 accuracy: {diff:+.2f} points; reload needed ipex_train: {needs_ipex}")
    print(f"kept fp32: {quantization.fp32_ops(int8, example[:1]) or 'nothing'}")
    metrics = {"machine": _common.machine(), "args": vars(args), "results": rows, "accuracy_diff_points": diff,
               "qconf_summary": qconf, "saved_model": saved,
               "pair_sums_saturate": quantization.pair_sums_saturate()}
    path = os.path.join(args.out, "metrics.json")
    with open(path, "w") as f:
        json.dump(metrics, f, indent=2)
    plot = os.path.join(args.out, "quantize_int8.png")
    _plot(plot, rows)
    print(f"metrics: {os.path.abspath(path)}\nplot:    {os.path.abspath(plot)}\nqconf:   {os.path.abspath(qconf)}")
    return 0


def _reload(script: str, saved: str, data: str, batch_size: int) -> dict:
    """Accuracy and latency of the saved artefact, measured by ``script`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", script, saved, data, str(batch_size)], capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plot(path: str, rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_lat) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(rows)
    ax_acc.bar(names, [100 * r["accuracy"] for r in rows.values()], color="tab:green")
    ax_acc.set(ylabel="top-1 %", title="test accuracy", ylim=(80, 100))
    ax_lat.bar(names, [r["latency_ms"] for r in rows.values()], color="tab:blue")
    ax_lat.set(ylabel="ms per batch", title="latency")
    for ax in (ax_acc, ax_lat):
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("digits CNN: fp32 vs int8 (ipex_train.quantization)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
