"""bf16 training numerics on a real (small) task: a CNN on scikit-learn's digits, optimize(dtype=bf16) vs fp32.

Both runs use the same initial weights, data order and recipe (SGD with momentum, cosine LR schedule, 10 epochs);
the target is test accuracies within 0.5 points. Needs scikit-learn (it ships the data set; nothing is
downloaded).

    python recipes/digits_numerics.py [--epochs 10] [--seed 0]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import ipex_train


def make_model() -> nn.Module:
    """A small CNN for 1x8x8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))


def load(seed: int):
    """Train/test tensors: images scaled to [0, 1] as N x 1 x 8 x 8 fp32, int64 labels."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=0.25, random_state=seed, stratify=digits.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def run(model: nn.Module, data, epochs: int, seed: int, dtype: torch.dtype | None) -> tuple[float, float]:
    """Train with the recipe (through optimize() when ``dtype`` is given); return (test accuracy %, seconds)."""
    x_train, y_train, x_test, y_test = data
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    if dtype is not None:
        model, opt = ipex_train.optimize(model, opt, dtype=dtype)
    steps_per_epoch = (len(y_train) + 31) // 32
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout masks
    start = time.perf_counter()
    for _ in range(epochs):
        model.train()
        for batch in torch.randperm(len(y_train), generator=g).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x_train[batch]).float(), y_train[batch]).backward()
            opt.step()
            sched.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        correct = (model(x_test).float().argmax(1) == y_test).sum().item()
    return 100.0 * correct / len(y_test), seconds


def main() -> None:
    """Train fp32 and bf16, print both test accuracies and their gap."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = load(args.seed)
    torch.manual_seed(args.seed)
    init = make_model()
    acc32, t32 = run(copy.deepcopy(init), data, args.epochs, args.seed, None)
    acc16, t16 = run(copy.deepcopy(init), data, args.epochs, args.seed, torch.bfloat16)
    print(f"fp32:                   test accuracy {acc32:.2f}%  ({t32:.1f} s)")
    print(f"optimize(dtype=bf16):   test accuracy {acc16:.2f}%  ({t16:.1f} s)")
    gap = abs(acc32 - acc16)
    print(f"gap: {gap:.2f} points (target <= 0.5): {'OK' if gap <= 0.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
