"""The main job: a small CNN trained on scikit-learn's digits images (shipped with the package, no download) with
``ipex_train.optimize(model, optimizer, dtype=torch.bfloat16)``, beside the same recipe in plain fp32 PyTorch.

    python -m recipes.digits                 # bf16 vs fp32, report + out/digits/{metrics.json,digits.png}
    python -m recipes.digits --dtype float32 --optimizer adamw --epochs 5

Each run trains in its own process, so the peak memory reported is that run's own.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import _common

OPTIMIZERS = ["sgd", "adamw", "adam", "lamb", "adagrad", "lars"]


def load_digits(seed: int, image_size: int):
    """The 1797 8x8 digit images upsampled to ``image_size``, normalised, split 80/20 (train/test)."""
    from sklearn.datasets import load_digits as sk_load

    data = sk_load()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU blocks, pooling, a linear classifier."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(4 * width, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def make_optimizer(name: str, params, lr: float | None) -> torch.optim.Optimizer:
    """The optimizer ``name`` with this recipe's default learning rate."""
    import ipex_train

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9, weight_decay=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 2e-3, weight_decay=1e-2)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr or 2e-3)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr or 2e-2)
    if name == "lamb":
        return ipex_train.optim.Lamb(params, lr=lr or 5e-3, weight_decay=1e-2)
    return ipex_train.optim.Lars(params, lr=lr or 0.5, momentum=0.9, eeta=0.02)


def one_run(args: argparse.Namespace) -> _common.RunResult:
    """Train once: with ipex_train.optimize unless args.vanilla (then plain fp32 PyTorch)."""
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed, args.image_size)
    model = DigitsCNN()
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    name, dtype, model, optimizer, memory_format = _common.prepare(args, model, optimizer)
    steps_per_epoch = len(y_train) // args.batch_size
    steps = args.steps or args.epochs * steps_per_epoch
    scheduler = _common.one_cycle(optimizer, steps)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def epoch():
        perm = torch.randperm(len(y_train), generator=gen)
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            yield x_train[idx].contiguous(memory_format=memory_format), y_train[idx]

    result = _common.train_loop(name, dtype, model, optimizer, _common.cycle(epoch),
                                lambda out, y: F.cross_entropy(out.float(), y), steps, args.batch_size,
                                progress=not args.no_progress, scheduler=scheduler)
    model.eval()
    with torch.no_grad():
        pred = model(x_test.contiguous(memory_format=memory_format)).float().argmax(1)
    result.accuracy = float((pred == y_test).float().mean())
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: bf16 (or --dtype) with ipex_train beside plain fp32, then the report, JSON and plot."""
    parser = argparse.ArgumentParser(prog="python -m recipes.digits", description=__doc__.split("\n\n")[0])
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="sgd", optimizers=OPTIMIZERS, steps=0,
                             batch_size=64, channels_last=True)
    _common.add_state_dtype_flag(parser)
    parser.add_argument("--epochs", type=int, default=12, help="epochs when --steps is 0 (default)")
    parser.add_argument("--image-size", type=int, default=16, help="side the 8x8 images are upsampled to")
    parser.set_defaults(json=os.path.join("out", "digits", "metrics.json"),
                        plot=os.path.join("out", "digits", "digits.png"))
    args = parser.parse_args(argv)

    print(f"digits: {args.optimizer}, dtype {args.dtype}, batch {args.batch_size}, "
          f"{'steps ' + str(args.steps) if args.steps else str(args.epochs) + ' epochs'}")
    _common.compare("digits", one_run, args, f"digits CNN, {args.optimizer}, batch {args.batch_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
