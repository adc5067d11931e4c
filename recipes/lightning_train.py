"""A tiny Llama (built from a config, no download) trained by Lightning with ipex_train's precision plugin, beside
Lightning's own ``precision="bf16-mixed"`` (CPU autocast) and ``"32-true"``; checkpointed and resumed with
``fit(ckpt_path=...)``, checked bit for bit.

    python -m recipes.lightning_train                   # ipex_train plugin, bf16-mixed, 32-true
    python -m recipes.lightning_train --width 256 --layers 4 --seq 128 --vocab 1024 --steps 60

The line a Lightning user adds::

    from ipex_train.integrations.lightning import IpexTrainPrecision
    trainer = L.Trainer(accelerator="cpu", plugins=[IpexTrainPrecision("bf16")])   # instead of precision="bf16-mixed"

Data (synthetic, learnable): arithmetic progressions of token ids (next token = previous + a per-sequence stride).
The LightningModule's configure_optimizers returns AdamW (no weight decay on biases and norms) with a linear
warm-up/decay LambdaLR stepped every step.

Checked (exit status 1 when it fails): the plugin's run resumed from its epoch-1 checkpoint with a fresh module and
Trainer ends on the uninterrupted run's weights, bit for bit. Reported: median step time of each run and the
plugin's against bf16-mixed's.

Report, out/lightning_train/metrics.json and out/lightning_train/lightning_train.png.
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import lightning as L
import torch
import transformers

from ipex_train.integrations.lightning import IpexTrainPrecision
from recipes import _common

MODES = {"ipex": "ipex_train plugin bf16", "bf16-mixed": "lightning bf16-mixed", "32-true": "lightning 32-true"}


class Progressions(torch.utils.data.Dataset):
    """Token ids ``start + stride * position`` modulo the vocabulary."""

    def __init__(self, n: int, seed: int, vocab: int, seq: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i]


class TinyLlama(L.LightningModule):
    """LlamaForCausalLM from a config, AdamW with decay/no-decay groups and a linear warm-up/decay schedule."""

    def __init__(self, args):
        super().__init__()
        torch.manual_seed(args.seed)
        heads = max(2, args.width // 64)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.width, intermediate_size=8 * args.width // 3,
            num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=args.seq))
        self.lr, self.total = args.lr or 3e-3, args.steps
        self.losses: list[float] = []

    def training_step(self, ids, batch_idx):
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in self.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                lr=self.lr)
        warm = max(1, self.total // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warm, max(0.0, (self.total - s) / max(1, self.total - warm))))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StepTimer(L.Callback):
    """Records each training batch's wall time (forward, backward, optimizer step)."""

    def __init__(self):
        self.times: list[float] = []
        self.start = 0.0

    def on_train_batch_start(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def fit(args, mode: str, max_epochs: int | None = None, ckpt_path: str | None = None, save_to: str | None = None):
    """One Lightning fit of a fresh TinyLlama; the module and the step timer."""
    module, timer = TinyLlama(args), StepTimer()
    callbacks = [timer]
    if save_to is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_epochs=1, save_top_k=-1, filename="{epoch}"))
    kw = dict(plugins=[IpexTrainPrecision("bf16")]) if mode == "ipex" else dict(precision=mode)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=not args.no_progress,
                        enable_model_summary=False, enable_checkpointing=save_to is not None, callbacks=callbacks,
                        max_steps=-1 if max_epochs else args.steps, max_epochs=max_epochs, **kw)
    loader = torch.utils.data.DataLoader(Progressions(args.batch_size * args.batches, args.seed, args.vocab, args.seq),
                                         batch_size=args.batch_size, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, timer


def resume_exact(args) -> bool:
    """Whether fit(ckpt_path=epoch 1) continues the plugin's run to the uninterrupted run's weights, bit for bit."""
    out = os.path.join(args.out, "checkpoints")
    whole, _ = fit(args, "ipex", max_epochs=4, save_to=out)
    resumed, _ = fit(args, "ipex", max_epochs=4, ckpt_path=os.path.join(out, "epoch=1.ckpt"))
    want, got = whole.state_dict(), resumed.state_dict()
    return want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def main(argv: list[str] | None = None) -> int:
    """Train with the plugin and with Lightning's own precisions, check resume, report."""
    parser = argparse.ArgumentParser(prog="python -m recipes.lightning_train", description=__doc__.split("\n\n")[0])
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="adamw", optimizers=["adamw"], steps=60,
                             batch_size=8, channels_last=False)
    parser.add_argument("--width", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--seq", type=int, default=32, help="sequence length")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    parser.add_argument("--batches", type=int, default=4, help="batches per epoch (the resume check runs 4 epochs)")
    parser.add_argument("--compare-autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="also run precision='bf16-mixed'; default: as --compare-fp32")
    parser.add_argument("--out", default=os.path.join("out", "lightning_train"), help="checkpoints go here")
    args = parser.parse_args(argv)
    if args.dtype != "bfloat16":
        parser.error("--dtype: the plugin's bf16 is the recipe's subject; only bfloat16")
    args.json = args.json or os.path.join(args.out, "metrics.json")
    args.plot = args.plot or os.path.join(args.out, "lightning_train.png")
    if args.compare_autocast is None:
        args.compare_autocast = args.compare_fp32
    modes = ["ipex"] + ["bf16-mixed"] * args.compare_autocast + ["32-true"] * args.compare_fp32

    print(f"Llama width {args.width} x {args.layers} layers, batch {args.batch_size} x {args.seq} tokens, "
          f"{args.steps} steps")
    results = {}
    for mode in modes:
        module, timer = fit(args, mode)
        results[mode] = _common.RunResult(MODES[mode], "float32" if mode == "32-true" else "bfloat16", args.steps,
                                          args.batch_size, module.losses, timer.times, _common.peak_rss_mib())
    checks = {"resume_exact": resume_exact(args)}
    ratios = {}
    if "bf16-mixed" in results:
        ratios["step_time_vs_bf16_mixed"] = results["ipex"].median_step_s / results["bf16-mixed"].median_step_s
    if "32-true" in results:
        ratios["final_loss_vs_32_true"] = (results["ipex"].summary()["final_loss"]
                                           / results["32-true"].summary()["final_loss"])

    runs = list(results.values())
    print()
    print(_common.report(runs))
    print(f"\nresume from the epoch-1 checkpoint gives the uninterrupted run's weights: {checks['resume_exact']}")
    for key, value in ratios.items():
        print(f"  {key}: {value:.3f}")
    _common.write_json(args.json, runs, {"recipe": "lightning_train", "args": vars(args), "checks": checks,
                                         "ratios": ratios})
    _common.plot(args.plot, runs, f"Lightning, Llama width {args.width}, batch {args.batch_size}")
    print(f"metrics: {os.path.abspath(args.json)}\nplot:    {os.path.abspath(args.plot)}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
