"""Tiny BERT, Llama and GPT-2 (built from configs, no download) trained by ipex_train's drop-in HF ``Trainer`` with
``TrainingArguments(bf16=True)``, beside the stock ``transformers.Trainer`` with ``bf16=True`` (CPU autocast) and in
plain fp32; checkpointed, resumed and reloaded in vanilla transformers, each checked bit for bit.

    python -m recipes.hf_trainer                      # bert and llama: ipex_train, stock autocast bf16, stock fp32
    python -m recipes.hf_trainer --models llama --steps 200 --width 256 --layers 4 --seq 128 --vocab 1024

The one line a Trainer user changes (everything else, TrainingArguments included, stays)::

    from ipex_train.integrations.transformers import Trainer   # instead of: from transformers import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True, use_cpu=True), train_dataset=data)

Data (synthetic, learnable): BERT classifies whether a sequence's first token is even; Llama and GPT-2 model
arithmetic progressions of token ids (next token = previous + a per-sequence stride).

What the recipe checks per model (exit status 1 when one fails):

1. resume: ``trainer.train(resume_from_checkpoint=...)`` from the checkpoint written half way, with a fresh model,
   ends on the same weights as the uninterrupted run, bit for bit;
2. reload: ``trainer.save_model`` writes a checkpoint that ``from_pretrained`` in vanilla transformers loads as
   fp32 (config.json says float32) and equal to the trained model's fp32 weights.

It also reports (in ``stock``, not failing the run): whether the optimizer's parameter groups are the stock
Trainer's (same parameters by name in each group, same hyperparameters), tokens/s against the stock Trainer's
autocast bf16 run and the final loss against its fp32 run.

Report, out/hf_trainer/metrics.json and out/hf_trainer/hf_trainer.png (losses and step times of every run).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

from ipex_train.integrations.transformers import Trainer
from recipes import _common

MODELS = ("bert", "llama", "gpt2")
# Runs per model: ipex_train's Trainer (bf16=True), then the stock Trainer with bf16=True (autocast) and in fp32.
MODES = {"ipex": "ipex_train bfloat16", "autocast": "torch autocast bf16", "fp32": "torch fp32"}


def config(args, name: str):
    """The tiny model config of ``name``."""
    w, layers, vocab, seq = args.width, args.layers, args.vocab, args.seq
    if name == "bert":
        return transformers.BertConfig(vocab_size=vocab, hidden_size=w, num_hidden_layers=layers,
                                       num_attention_heads=max(2, w // 64), intermediate_size=4 * w,
                                       max_position_embeddings=seq, num_labels=2)
    if name == "llama":
        heads = max(2, w // 64)
        return transformers.LlamaConfig(vocab_size=vocab, hidden_size=w, intermediate_size=8 * w // 3,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq)
    return transformers.GPT2Config(vocab_size=vocab, n_embd=w, n_layer=layers, n_head=2, n_positions=seq,
                                   bos_token_id=0, eos_token_id=0)


def model_class(name: str):
    """The transformers class trained for ``name``."""
    return {"bert": transformers.BertForSequenceClassification, "llama": transformers.LlamaForCausalLM,
            "gpt2": transformers.GPT2LMHeadModel}[name]


class Synthetic(torch.utils.data.Dataset):
    """Sequences of token ids with the recipe's labels (see the module docstring)."""

    def __init__(self, name: str, n: int, seed: int, vocab: int, seq: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab
        self.labels = self.ids[:, 0] % 2 if name == "bert" else self.ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def trainer(args, name: str, out: str, mode: str):
    """A Trainer over a fresh model: ipex_train's (``mode`` "ipex") or the stock one with bf16=True ("autocast")
    or without ("fp32"); the same TrainingArguments otherwise (optim, warm-up, linear decay, weight decay)."""
    torch.manual_seed(args.seed)
    model = model_class(name)(config(args, name)).train()
    saving = dict(save_steps=max(1, args.steps // 2)) if mode == "ipex" else dict(save_strategy="no")
    targs = transformers.TrainingArguments(out, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                                           learning_rate=args.lr or 3e-3, weight_decay=0.01, optim=args.optim,
                                           warmup_steps=max(1, args.steps // 10), lr_scheduler_type="linear",
                                           bf16=mode != "fp32", logging_steps=1, use_cpu=True, report_to=[],
                                           disable_tqdm=args.no_progress, seed=args.seed, **saving)
    cls = Trainer if mode == "ipex" else transformers.Trainer
    return cls(model=model, args=targs, train_dataset=Synthetic(name, 256, args.seed, args.vocab, args.seq),
               callbacks=[StepTimer()])


class StepTimer(transformers.TrainerCallback):
    """Records each optimizer step's wall time."""

    def __init__(self):
        self.times: list[float] = []
        self.start = 0.0

    def on_step_begin(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def run(args, name: str, mode: str, out: str) -> tuple[_common.RunResult, object]:
    """Train one model to the end; its RunResult (losses, step times, accuracy on fresh data) and Trainer."""
    tr = trainer(args, name, out, mode)
    tr.train()
    timer = next(c for c in tr.callback_handler.callbacks if isinstance(c, StepTimer))
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    result = _common.RunResult(f"{name} {MODES[mode]}", "float32" if mode == "fp32" else "bfloat16", args.steps,
                               args.batch_size, losses, timer.times, _common.peak_rss_mib())
    test = Synthetic(name, 64, args.seed + 1, args.vocab, args.seq)
    model = tr.model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
        logits = model(input_ids=test.ids).logits.float()
    if name == "bert":
        result.accuracy = float((logits.argmax(-1) == test.labels).float().mean())
    else:  # next-token accuracy past the first two tokens (which fix the stride)
        result.accuracy = float((logits[:, 1:-1].argmax(-1) == test.ids[:, 2:]).float().mean())
    return result, tr


def check(args, name: str, out: str, tr) -> dict:
    """Resume from the half-way checkpoint and reload the saved model in vanilla transformers."""
    want = tr.model.state_dict()
    resumed = trainer(args, name, out, "ipex")
    resumed.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{max(1, args.steps // 2)}"))
    resume_exact = all(torch.equal(v, want[k]) for k, v in resumed.model.state_dict().items())
    final = os.path.join(out, "final")
    tr.save_model(final)
    got = model_class(name).from_pretrained(final).state_dict()
    reload_exact = got.keys() == want.keys() and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
    return {"resume_exact": resume_exact, "reload_exact": reload_exact}


def groups_as_stock(args, name: str, out: str) -> bool:
    """Whether ipex_train's Trainer creates the parameter groups the stock Trainer creates for the same arguments
    (the same parameters by name in each group, the same hyperparameters)."""
    stock, ours = trainer(args, name, out, "fp32"), trainer(args, name, out, "ipex")
    want, got = stock.create_optimizer(), ours.create_optimizer()
    names = [{id(p): n for n, p in t.model.named_parameters()} for t in (stock, ours)]
    return len(want.param_groups) == len(got.param_groups) and all(
        [names[0][id(p)] for p in gw["params"]] == [names[1][id(p)] for p in gg["params"]]
        and {k: v for k, v in gw.items() if k != "params"} == {k: v for k, v in gg.items() if k != "params"}
        for gw, gg in zip(want.param_groups, got.param_groups))


def stock_comparison(args, name: str, results: dict) -> dict:
    """Tokens/s against the stock autocast run, final loss against the stock fp32 run."""
    out = {}
    tokens = args.batch_size * args.seq
    ours = results["ipex"]
    out["tokens_per_s"] = tokens / ours.median_step_s
    if "autocast" in results:
        out["tokens_per_s_vs_stock_bf16"] = results["autocast"].median_step_s / ours.median_step_s
    if "fp32" in results:
        out["final_loss_vs_stock_fp32"] = ours.summary()["final_loss"] / results["fp32"].summary()["final_loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Train each model with ipex_train's Trainer (and the stock one), check resume and reload, report."""
    parser = argparse.ArgumentParser(prog="python -m recipes.hf_trainer", description=__doc__.split("\n\n")[0])
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="adamw", optimizers=["adamw"], steps=120,
                             batch_size=16, channels_last=False)
    parser.add_argument("--models", default="bert,llama", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (fused: adamw_torch, "
                        "adamw_torch_fused, sgd, adagrad)")
    parser.add_argument("--width", type=int, default=64, help="hidden size of the tiny models")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--seq", type=int, default=16, help="sequence length")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    parser.add_argument("--compare-autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="also run the stock Trainer with bf16=True (CPU autocast); default: as --compare-fp32")
    parser.add_argument("--out", default=os.path.join("out", "hf_trainer"), help="checkpoints go here")
    args = parser.parse_args(argv)
    if args.dtype != "bfloat16":
        parser.error("--dtype: the Trainer's bf16=True is the recipe's subject; only bfloat16")
    args.json = args.json or os.path.join(args.out, "metrics.json")
    args.plot = args.plot or os.path.join(args.out, "hf_trainer.png")
    names = args.models.split(",")
    if not names or any(n not in MODELS for n in names):
        parser.error(f"--models: choose from {','.join(MODELS)}, got {args.models!r}")
    if args.compare_autocast is None:
        args.compare_autocast = args.compare_fp32
    modes = ["ipex"] + ["autocast"] * args.compare_autocast + ["fp32"] * args.compare_fp32

    results, checks, stock = [], {}, {}
    for name in names:
        print(f"{name}: Trainer(bf16=True), optim {args.optim}, batch {args.batch_size} x {args.seq} tokens, "
              f"{args.steps} steps")
        out = os.path.join(args.out, name)
        runs = {}
        for mode in modes:
            runs[mode], tr = run(args, name, mode, out if mode == "ipex" else os.path.join(out, mode))
            if mode == "ipex":
                checks[name] = check(args, name, out, tr)
                stock[name] = {"groups_as_stock": groups_as_stock(args, name, os.path.join(out, "groups"))}
        stock[name].update(stock_comparison(args, name, runs))
        results.extend(runs.values())

    print()
    print(_common.report(results))
    for name, c in checks.items():
        print(f"\n{name}: resume from the half-way checkpoint gives the uninterrupted run's weights: "
              f"{c['resume_exact']}; save_model reloads in vanilla transformers as the exact fp32 weights: "
              f"{c['reload_exact']}; parameter groups as the stock Trainer's: {stock[name]['groups_as_stock']}")
        for key in ("tokens_per_s_vs_stock_bf16", "final_loss_vs_stock_fp32"):
            if key in stock[name]:
                print(f"  {key}: {stock[name][key]:.3f}")
    _common.write_json(args.json, results, {"recipe": "hf_trainer", "args": vars(args), "checks": checks,
                                            "stock": stock})
    _common.plot(args.plot, results, f"HF Trainer, {', '.join(names)}, batch {args.batch_size}")
    print(f"metrics: {os.path.abspath(args.json)}\nplot:    {os.path.abspath(args.plot)}")
    return 0 if all(all(c.values()) for c in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
