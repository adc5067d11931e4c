"""ResNet-50 (torchvision, from scratch) trained with SGD + momentum in channels-last, the classic IPEX training
case, with ``ipex_train.optimize(model, optimizer, dtype=torch.bfloat16)`` beside the same recipe in plain fp32
PyTorch, on generated images (no download).

    python -m recipes.resnet50                       # bf16 vs fp32, report + out/resnet50/{metrics.json,resnet50.png}
    python -m recipes.resnet50 --steps 50 --batch-size 64 --image-size 96 --optimizer lars

The images are one of 10 fixed random smooth class templates plus pixel noise: learnable within a few dozen steps,
so the short default run shows the loss falling and a test accuracy above chance. Each run trains in its own
process, so the peak memory reported is that run's own.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from recipes import _common
from recipes.digits import OPTIMIZERS, make_optimizer

NUM_CLASSES = 10
# Peak LRs (OneCycle) for the default batch of 16; SGD reaches ~100% test accuracy in the default 20 steps.
DEFAULT_LR = {"sgd": 0.02, "lars": 2.0, "adamw": 1e-3, "adam": 1e-3, "lamb": 5e-3, "adagrad": 1e-2}


class TemplateImages:
    """Images ``template[label] + noise_std * noise``; templates are random 3x8x8 patterns upsampled to
    ``image_size``, so the classes differ in coarse structure a convolutional network picks up quickly."""

    def __init__(self, seed: int, image_size: int, noise_std: float):
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn(NUM_CLASSES, 3, 8, 8, generator=gen)
        self.templates = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
        self.templates /= self.templates.std()
        self.noise_std = noise_std

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` (image, label) pairs drawn with ``gen``."""
        y = torch.randint(NUM_CLASSES, (n,), generator=gen)
        x = self.templates[y] + self.noise_std * torch.randn(self.templates[y].shape, generator=gen)
        return x, y


def one_run(args: argparse.Namespace) -> _common.RunResult:
    """Train once: with ipex_train.optimize unless args.vanilla (then plain fp32 PyTorch); then test accuracy."""
    import torchvision

    torch.manual_seed(args.seed)
    data = TemplateImages(args.seed, args.image_size, args.noise_std)
    # Zero-initialised last BN of each residual block: every block starts as the identity, which keeps a fresh
    # ResNet-50 stable at a useful learning rate from the first step (Goyal et al., 2017).
    model = torchvision.models.resnet50(weights=None, num_classes=NUM_CLASSES, zero_init_residual=True)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr or DEFAULT_LR[args.optimizer])
    name, dtype, model, optimizer, memory_format = _common.prepare(args, model, optimizer)
    scheduler = _common.one_cycle(optimizer, args.steps)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches in every run

    def batches():
        while True:
            x, y = data.sample(args.batch_size, gen)
            yield x.contiguous(memory_format=memory_format), y

    result = _common.train_loop(name, dtype, model, optimizer, batches(),
                                lambda out, y: F.cross_entropy(out.float(), y), args.steps, args.batch_size,
                                progress=not args.no_progress, scheduler=scheduler)
    x_test, y_test = data.sample(args.test_size, torch.Generator().manual_seed(args.seed + 2))
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x.contiguous(memory_format=memory_format)).float().argmax(1)
                          for x in x_test.split(args.batch_size)])
    result.accuracy = float((pred == y_test).float().mean())
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: bf16 (or --dtype) with ipex_train beside plain fp32, then the report, JSON and plot."""
    parser = argparse.ArgumentParser(prog="python -m recipes.resnet50", description=__doc__.split("\n\n")[0])
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="sgd", optimizers=OPTIMIZERS, steps=20,
                             batch_size=16, channels_last=True)
    parser.add_argument("--image-size", type=int, default=64, help="side of the generated square RGB images")
    parser.add_argument("--noise-std", type=float, default=1.0, help="pixel noise (templates have std 1)")
    parser.add_argument("--test-size", type=int, default=256, help="held-out images for the test accuracy")
    parser.set_defaults(json=os.path.join("out", "resnet50", "metrics.json"),
                        plot=os.path.join("out", "resnet50", "resnet50.png"))
    args = parser.parse_args(argv)

    print(f"resnet50: {args.optimizer}, dtype {args.dtype}, batch {args.batch_size}, {args.steps} steps, "
          f"{args.image_size}x{args.image_size}, {'channels-last' if args.channels_last else 'contiguous'}")
    _common.compare("resnet50", one_run, args, f"ResNet-50, {args.optimizer}, batch {args.batch_size}, "
                    f"{args.image_size}x{args.image_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
