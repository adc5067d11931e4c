"""Train a small MLP on scikit-learn's digits with HuggingFace Accelerate and the ipex_train plugin.

    python recipes/accelerate_train.py --steps 200 --json out/accelerate/metrics.json
    accelerate launch recipes/accelerate_train.py --steps 200
    accelerate launch --multi_gpu --num_processes 2 recipes/accelerate_train.py   # 2 CPU processes (see below)
    IPEX_TRAIN_SPLIT_MASTER_WEIGHT_FOR_BF16=0 accelerate launch recipes/accelerate_train.py   # plugin options
    python recipes/accelerate_train.py --no-plugin       # the same loop with Accelerate alone, for comparison

The loop is Accelerate's usual one: gradient accumulation, clip_grad_norm_, an LR scheduler created on the
optimizer before prepare, and (with --output-dir) save_state plus an fp32 export of the weights.

Several processes on one machine: ``accelerate launch --cpu`` starts several processes only through mpirun
(``--mpirun_hostfile``); ``--multi_gpu`` uses torchrun, which needs no GPU, and the script pins the accelerator to
the CPU (gloo). ``torchrun --nproc_per_node 2 recipes/accelerate_train.py`` works too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear-LayerNorm-GELU blocks with dropout and a linear classifier (64 pixel inputs, 10 classes)."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(width, 10),
        )

    def forward(self, x):
        return self.net(x)


def load_digits(seed: int):
    """scikit-learn's 1797 8x8 digits (shipped with the package, no download), standardised, split 80/20."""
    from sklearn.datasets import load_digits as sk_load

    data = sk_load()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--mixed-precision", choices=["bf16", "no"], default="bf16",
                        help="Accelerator(mixed_precision=...); the plugin's dtype follows it")
    parser.add_argument("--no-plugin", action="store_true", help="Accelerate alone, without ipex_train")
    parser.add_argument("--output-dir", help="save_state() and the fp32 weights (save_model) here at the end")
    parser.add_argument("--json", metavar="PATH", help="write the metrics as JSON (main process)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate, report; returns the exit status."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm import tqdm

    args = parse_args(argv)
    # ipex_train trains on the CPU, whatever accelerators the machine has.
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train),
                                         batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)

    if args.no_plugin:
        plugin = None
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        from ipex_train.integrations.accelerate import IpexTrainPlugin

        plugin = IpexTrainPlugin()
        model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)

    losses, step_times = [], []
    bar = tqdm(total=args.steps, disable=args.no_progress or not accelerator.is_main_process, dynamic_ncols=True,
               desc="ipex_train + accelerate" if plugin else "accelerate")
    model.train()
    step_loss, t0 = 0.0, time.perf_counter()
    while len(losses) < args.steps:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step_loss += loss.detach() / args.grad_accum
            if accelerator.sync_gradients:
                # The mean over processes: what the optimizer step saw.
                losses.append(accelerator.reduce(step_loss, reduction="mean").item())
                step_times.append(time.perf_counter() - t0)
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", ms=f"{1e3 * step_times[-1]:.1f}")
                step_loss, t0 = 0.0, time.perf_counter()
                if len(losses) == args.steps:
                    break
    bar.close()

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if args.output_dir:
        accelerator.save_state(os.path.join(args.output_dir, "checkpoint"))
        accelerator.save_model(model, os.path.join(args.output_dir, "model"))  # fp32 weights, safetensors
    accelerator.wait_for_everyone()

    # Skip the first steps (allocations, kernel selection) in the timing.
    median_s = statistics.median(step_times[min(3, len(step_times) - 1):])
    metrics = {
        "plugin": None if plugin is None else {k: str(v) for k, v in plugin.config.to_dict().items()},
        "dtype": str(plugin.resolve_dtype(accelerator) if plugin else torch.float32),
        "mixed_precision": accelerator.mixed_precision,
        "num_processes": accelerator.num_processes,
        "steps": args.steps,
        "batch_size_per_process": args.batch_size,
        "grad_accum": args.grad_accum,
        "median_step_ms": 1e3 * median_s,
        "samples_per_s": args.batch_size * args.grad_accum * accelerator.num_processes / median_s,
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "test_accuracy": accuracy,
        "losses": losses,
    }
    if accelerator.is_main_process:
        print(f"{metrics['num_processes']} process(es), {metrics['dtype']}, mixed_precision "
              f"{metrics['mixed_precision']}: {metrics['median_step_ms']:.2f} ms/step, "
              f"{metrics['samples_per_s']:.0f} samples/s, loss {metrics['first_loss']:.4f} -> "
              f"{metrics['final_loss']:.4f}, test accuracy {100 * accuracy:.2f}%")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(metrics, f, indent=2)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
