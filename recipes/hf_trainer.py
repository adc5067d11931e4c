"""Tiny BERT and GPT-2 (built from configs, no download) trained by HuggingFace's ``Trainer`` with the model and
optimizer of ``ipex_train.optimize(dtype=bf16)``; checkpointed, resumed and reloaded in vanilla transformers, each
checked bit for bit.

    python -m recipes.hf_trainer                      # both models, bf16 beside plain fp32
    python -m recipes.hf_trainer --models gpt2 --steps 200

The lines a Trainer user adds: optimize() the model with its optimizer, then hand both to the Trainer::

    model, optimizer = ipex_train.optimize(model, optimizer, dtype=torch.bfloat16, inplace=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, steps)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler))

Data (synthetic, learnable): BERT classifies whether a sequence's first token is even; GPT-2 models arithmetic
progressions of token ids (next token = previous + a per-sequence stride).

What the recipe checks per model (exit status 1 when one fails):

1. resume: ``trainer.train(resume_from_checkpoint=...)`` from the checkpoint written half way, with a fresh model
   and optimizer, ends on the same weights as the uninterrupted run, bit for bit;
2. reload: ``trainer.save_model`` writes a checkpoint that ``from_pretrained`` in vanilla transformers loads as
   fp32 (config.json says float32) and equal to the trained model's fp32 weights.

Report, out/hf_trainer/metrics.json and out/hf_trainer/hf_trainer.png (losses and step times of every run).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

import ipex_train
from recipes import _common

VOCAB, SEQ = 64, 16


def config(name: str, width: int):
    """The tiny model config of ``name``."""
    if name == "bert":
        return transformers.BertConfig(vocab_size=VOCAB, hidden_size=width, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=2 * width,
                                       max_position_embeddings=SEQ, num_labels=2)
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=2, n_head=2, n_positions=SEQ,
                                   bos_token_id=0, eos_token_id=0)


def model_class(name: str):
    """The transformers class trained for ``name``."""
    return transformers.BertForSequenceClassification if name == "bert" else transformers.GPT2LMHeadModel


class Synthetic(torch.utils.data.Dataset):
    """Sequences of token ids with the recipe's labels (see the module docstring)."""

    def __init__(self, name: str, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB
        self.labels = self.ids[:, 0] % 2 if name == "bert" else self.ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def trainer(args, name: str, out: str, vanilla: bool):
    """A Trainer over a fresh model: its optimizer through ipex_train.optimize unless ``vanilla``."""
    torch.manual_seed(args.seed)
    model = model_class(name)(config(name, args.width)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-3, weight_decay=0.01)
    if not vanilla:
        model, optimizer = ipex_train.optimize(model, optimizer, dtype=_common.DTYPES[args.dtype], inplace=True)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)
    targs = transformers.TrainingArguments(out, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                                           save_steps=max(1, args.steps // 2), logging_steps=1, use_cpu=True,
                                           report_to=[], disable_tqdm=args.no_progress, seed=args.seed)
    return transformers.Trainer(model=model, args=targs, train_dataset=Synthetic(name, 256, args.seed),
                                optimizers=(optimizer, scheduler), callbacks=[StepTimer()])


class StepTimer(transformers.TrainerCallback):
    """Records each optimizer step's wall time."""

    def __init__(self):
        self.times: list[float] = []
        self.start = 0.0

    def on_step_begin(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def run(args, name: str, label: str, out: str, vanilla: bool) -> tuple[_common.RunResult, object]:
    """Train one model to the end; its RunResult (losses, step times, accuracy on fresh data) and Trainer."""
    tr = trainer(args, name, out, vanilla)
    tr.train()
    timer = next(c for c in tr.callback_handler.callbacks if isinstance(c, StepTimer))
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    result = _common.RunResult(f"{name} {label}", "float32" if vanilla else args.dtype, args.steps,
                               args.batch_size, losses, timer.times, _common.peak_rss_mib())
    test = Synthetic(name, 64, args.seed + 1)
    model = tr.model.eval()
    with torch.no_grad():
        logits = model(input_ids=test.ids).logits.float()
    if name == "bert":
        result.accuracy = float((logits.argmax(-1) == test.labels).float().mean())
    else:  # next-token accuracy past the first two tokens (which fix the stride)
        result.accuracy = float((logits[:, 1:-1].argmax(-1) == test.ids[:, 2:]).float().mean())
    return result, tr


def check(args, name: str, out: str, tr) -> dict:
    """Resume from the half-way checkpoint and reload the saved model in vanilla transformers."""
    want = tr.model.state_dict()
    resumed = trainer(args, name, out, vanilla=False)
    resumed.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{max(1, args.steps // 2)}"))
    resume_exact = all(torch.equal(v, want[k]) for k, v in resumed.model.state_dict().items())
    final = os.path.join(out, "final")
    tr.save_model(final)
    got = model_class(name).from_pretrained(final).state_dict()
    reload_exact = got.keys() == want.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
    return {"resume_exact": resume_exact, "reload_exact": reload_exact}


def main(argv: list[str] | None = None) -> int:
    """Train each model with ipex_train (and plain fp32), check resume and reload, report."""
    parser = argparse.ArgumentParser(prog="python -m recipes.hf_trainer", description=__doc__.split("\n\n")[0])
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="adamw", optimizers=["adamw"], steps=120,
                             batch_size=16, channels_last=False)
    parser.add_argument("--models", default="bert,gpt2", help="comma-separated subset of bert,gpt2")
    parser.add_argument("--width", type=int, default=64, help="hidden size of the tiny models")
    parser.add_argument("--out", default=os.path.join("out", "hf_trainer"), help="checkpoints go here")
    args = parser.parse_args(argv)
    args.json = args.json or os.path.join(args.out, "metrics.json")
    args.plot = args.plot or os.path.join(args.out, "hf_trainer.png")
    names = args.models.split(",")
    if not names or any(n not in ("bert", "gpt2") for n in names):
        parser.error(f"--models: choose from bert,gpt2, got {args.models!r}")

    results, checks = [], {}
    for name in names:
        print(f"{name}: Trainer, adamw, dtype {args.dtype}, batch {args.batch_size}, {args.steps} steps")
        out = os.path.join(args.out, name)
        result, tr = run(args, name, f"ipex_train {args.dtype}", out, vanilla=False)
        results.append(result)
        checks[name] = check(args, name, out, tr)
        if args.compare_fp32:
            results.append(run(args, name, "torch fp32", os.path.join(out, "fp32"), vanilla=True)[0])

    print()
    print(_common.report(results))
    for name, c in checks.items():
        print(f"\n{name}: resume from the half-way checkpoint gives the uninterrupted run's weights: "
              f"{c['resume_exact']}; save_model reloads in vanilla transformers as the exact fp32 weights: "
              f"{c['reload_exact']}")
    _common.write_json(args.json, results, {"recipe": "hf_trainer", "args": vars(args), "checks": checks})
    _common.plot(args.plot, results, f"HF Trainer, {', '.join(names)}, batch {args.batch_size}")
    print(f"metrics: {os.path.abspath(args.json)}\nplot:    {os.path.abspath(args.plot)}")
    return 0 if all(all(c.values()) for c in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
