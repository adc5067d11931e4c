"""A timm model trained with timm's own optimizer and scheduler factories under ``ipex_train.optimize(dtype=bf16)``;
checkpointed, resumed and reloaded in vanilla timm, each checked bit for bit.

    python -m recipes.timm_train                                  # resnet18, adamw, bf16 beside plain fp32
    python -m recipes.timm_train --model vit_tiny_patch16_224 --optimizer lamb --steps 100

Data: scikit-learn's digits (shipped with the package, no download) upsampled to --image-size, 3 channels. The
model comes from ``timm.create_model(pretrained=False)``, the optimizer from ``timm.optim.create_optimizer_v2`` and
the per-step cosine schedule from ``timm.scheduler.create_scheduler_v2``; then, the lines a timm user adds::

    model, optimizer = ipex_train.optimize(model, optimizer, dtype=torch.bfloat16)

What the recipe checks (exit status 1 when one fails):

1. resume: a checkpoint in timm's train.py format ({"state_dict", "optimizer", "epoch"}) written half way, loaded
   into a fresh model and optimizer with ``timm.models.resume_checkpoint``, trains on to the same final weights
   as the uninterrupted run, bit for bit;
2. reload: the final checkpoint loads into a vanilla timm model (``timm.models.load_checkpoint``) as the exact
   fp32 weights of the trained model.

Report, out/timm_train/metrics.json and out/timm_train/timm_train.png (losses and step times of both runs).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from recipes import _common
from recipes.digits import load_digits

OPTIMIZERS = ["adamw", "sgd", "lamb", "lars", "adam"]


def build(args: argparse.Namespace, vanilla: bool):
    """Model, optimizer and scheduler from timm's factories; through ipex_train.optimize unless ``vanilla``."""
    import timm
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    import ipex_train

    torch.manual_seed(args.seed)
    kwargs = {"img_size": args.image_size} if "vit" in args.model else {}
    model = timm.create_model(args.model, pretrained=False, num_classes=10, **kwargs).train()
    optimizer = create_optimizer_v2(model, opt=args.optimizer, lr=args.lr or 1e-3, weight_decay=0.05)
    if not vanilla:
        model, optimizer = ipex_train.optimize(model, optimizer, dtype=_common.DTYPES[args.dtype])
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=args.steps,
                                       warmup_epochs=max(1, args.steps // 10), step_on_epochs=False,
                                       updates_per_epoch=1)
    return model, optimizer, scheduler


class PerStep:
    """timm's schedulers step with the update count: ``step()`` for the recipe loop, from ``start``."""

    def __init__(self, scheduler, start: int = 0):
        self.scheduler, self.updates = scheduler, start

    def step(self):
        self.updates += 1
        self.scheduler.step_update(num_updates=self.updates)


def batches(args, x, y, start: int):
    """The training batches from step ``start`` on; batch k is the same in every run."""
    step = start
    while True:
        idx = torch.randint(0, len(y), (args.batch_size,), generator=torch.Generator().manual_seed(args.seed + step))
        yield x[idx], y[idx]
        step += 1


def train(args, name, model, optimizer, scheduler, data, start: int, stop: int) -> _common.RunResult:
    """Steps ``start`` .. ``stop`` of the recipe's loop."""
    return _common.train_loop(name, args.dtype, model, optimizer, batches(args, *data, start),
                              lambda out, y: F.cross_entropy(out.float(), y), stop - start, args.batch_size,
                              progress=not args.no_progress, scheduler=PerStep(scheduler, start))


def main(argv: list[str] | None = None) -> int:
    """Train, checkpoint, resume, reload, report."""
    parser = argparse.ArgumentParser(prog="python -m recipes.timm_train", description=__doc__.split("\n\n")[0])
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="adamw", optimizers=OPTIMIZERS, steps=60,
                             batch_size=32, channels_last=True)
    parser.add_argument("--model", default="resnet18", help="a timm model name (built without weights)")
    parser.add_argument("--image-size", type=int, default=32, help="side the 8x8 digits are upsampled to")
    parser.add_argument("--out", default=os.path.join("out", "timm_train"), help="checkpoints go here")
    args = parser.parse_args(argv)
    args.json = args.json or os.path.join(args.out, "metrics.json")
    args.plot = args.plot or os.path.join(args.out, "timm_train.png")
    import timm.models

    (x_train, y_train), (x_test, y_test) = load_digits(args.seed, args.image_size)
    data = (x_train.expand(-1, 3, -1, -1).contiguous(), y_train)
    os.makedirs(args.out, exist_ok=True)
    half, name = args.steps // 2, f"ipex_train {args.dtype}"
    print(f"timm {args.model}: {args.optimizer}, dtype {args.dtype}, batch {args.batch_size}, {args.steps} steps")

    model, optimizer, scheduler = build(args, vanilla=False)
    first = train(args, name, model, optimizer, scheduler, data, 0, half)
    checkpoint = os.path.join(args.out, "checkpoint-half.pth.tar")
    # timm's train.py (CheckpointSaver) layout; "version": 2 makes resume_checkpoint return the next epoch.
    torch.save({"epoch": half - 1, "arch": args.model, "state_dict": model.state_dict(),
                "optimizer": optimizer.state_dict(), "version": 2}, checkpoint)
    rest = train(args, name, model, optimizer, scheduler, data, half, args.steps)
    result = _common.RunResult(name, args.dtype, args.steps, args.batch_size, first.losses + rest.losses,
                               first.step_times_s + rest.step_times_s)
    final = os.path.join(args.out, "final.pth.tar")
    torch.save({"epoch": args.steps - 1, "arch": args.model, "state_dict": model.state_dict(), "version": 2}, final)

    resumed, resumed_opt, resumed_sched = build(args, vanilla=False)
    start = timm.models.resume_checkpoint(resumed, checkpoint, optimizer=resumed_opt, log_info=False)
    train(args, "resumed", resumed, resumed_opt, resumed_sched, data, start, args.steps)
    want = model.state_dict()
    resume_exact = all(torch.equal(v, want[k]) for k, v in resumed.state_dict().items())

    vanilla = timm.create_model(args.model, pretrained=False, num_classes=10,
                                **({"img_size": args.image_size} if "vit" in args.model else {}))
    timm.models.load_checkpoint(vanilla, final)
    got = vanilla.state_dict()
    reload_exact = got.keys() == want.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())

    results = [result]
    if args.compare_fp32:
        base = build(args, vanilla=True)
        results.append(train(args, "torch fp32", *base, data, 0, args.steps))
    x_eval = x_test.expand(-1, 3, -1, -1)
    for r, m in zip(results, [model] + ([base[0]] if args.compare_fp32 else [])):
        m.eval()
        with torch.no_grad():
            r.accuracy = float((m(x_eval).float().argmax(1) == y_test).float().mean())
        r.peak_rss_mib = _common.peak_rss_mib()  # one process: its peak so far

    print()
    print(_common.report(results))
    print(f"\nresume from step {half}: final weights identical to the uninterrupted run: {resume_exact}")
    print(f"final checkpoint in vanilla timm (load_checkpoint): exact fp32 weights: {reload_exact}")
    _common.write_json(args.json, results, {"recipe": "timm_train", "args": vars(args),
                                            "resume_exact": resume_exact, "reload_exact": reload_exact})
    _common.plot(args.plot, results, f"timm {args.model}, {args.optimizer}, batch {args.batch_size}")
    print(f"metrics: {os.path.abspath(args.json)}\nplot:    {os.path.abspath(args.plot)}")
    return 0 if resume_exact and reload_exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
