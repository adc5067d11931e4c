"""A transformer encoder (plain torch.nn) trained with ``ipex_train.optim.Lamb`` under
``ipex_train.optimize(model, optimizer, dtype=torch.bfloat16)``, beside the same recipe in plain fp32 PyTorch, on a
generated sequence-classification task (no download).

    python -m recipes.transformer_lamb       # bf16 vs fp32, report + out/transformer_lamb/{metrics.json,*.png}
    python -m recipes.transformer_lamb --steps 200 --d-model 512 --layers 6 --optimizer adamw

The task: each sequence holds random tokens, with one of the first ``--classes`` tokens planted a few extra times;
the label is whichever of those tokens occurs most often (ties go to the lowest). The label is a function of token
counts alone, which attention with mean pooling learns in a few dozen steps (the default 30 reach ~99% test
accuracy). Each run trains in its own process, so the peak memory reported is that run's own.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import _common
from recipes.digits import OPTIMIZERS, make_optimizer

DEFAULT_LR = {"lamb": 5e-3, "adamw": 1e-3, "adam": 1e-3, "sgd": 0.05, "lars": 0.5, "adagrad": 1e-2}


class CountTask:
    """Sequences of ``seq_len`` tokens out of ``vocab``; label = the most frequent of tokens 0..classes-1."""

    def __init__(self, vocab: int, seq_len: int, classes: int, planted: int):
        self.vocab, self.seq_len, self.classes, self.planted = vocab, seq_len, classes, planted

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` (tokens, label) pairs drawn with ``gen``."""
        tokens = torch.randint(self.vocab, (n, self.seq_len), generator=gen)
        # Plant one class token at random positions so that every class is common; the label is still computed
        # from the final counts, never from which token was planted.
        planted = torch.randint(self.classes, (n, 1), generator=gen).expand(n, self.planted)
        positions = torch.rand(n, self.seq_len, generator=gen).argsort(1)[:, :self.planted]
        tokens.scatter_(1, positions, planted)
        counts = F.one_hot(tokens, self.vocab)[:, :, :self.classes].sum(1)
        return tokens, counts.argmax(1)


class EncoderClassifier(nn.Module):
    """Token + learned position embeddings, a pre-norm nn.TransformerEncoder, mean pooling, a linear head."""

    def __init__(self, vocab: int, seq_len: int, classes: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos).mean(1))


def one_run(args: argparse.Namespace) -> _common.RunResult:
    """Train once: with ipex_train.optimize unless args.vanilla (then plain fp32 PyTorch); then test accuracy."""
    torch.manual_seed(args.seed)
    task = CountTask(args.vocab, args.seq_len, args.classes, args.planted)
    model = EncoderClassifier(args.vocab, args.seq_len, args.classes, args.d_model, args.layers, args.heads)
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr or DEFAULT_LR[args.optimizer])
    name, dtype, model, optimizer, _ = _common.prepare(args, model, optimizer)
    scheduler = _common.one_cycle(optimizer, args.steps)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches in every run

    def batches():
        while True:
            yield task.sample(args.batch_size, gen)

    result = _common.train_loop(name, dtype, model, optimizer, batches(),
                                lambda out, y: F.cross_entropy(out.float(), y), args.steps, args.batch_size,
                                progress=not args.no_progress, scheduler=scheduler)
    x_test, y_test = task.sample(args.test_size, torch.Generator().manual_seed(args.seed + 2))
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x).float().argmax(1) for x in x_test.split(args.batch_size)])
    result.accuracy = float((pred == y_test).float().mean())
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: bf16 (or --dtype) with ipex_train beside plain fp32, then the report, JSON and plot."""
    parser = argparse.ArgumentParser(prog="python -m recipes.transformer_lamb",
                                     description=__doc__.split("\n\n")[0])
    # No convolutions here, so channels-last changes nothing; the flag stays for a uniform command line.
    _common.add_common_flags(parser, dtype="bfloat16", optimizer="lamb", optimizers=OPTIMIZERS, steps=30,
                             batch_size=32, channels_last=False)
    _common.add_state_dtype_flag(parser)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--classes", type=int, default=4, help="tokens 0..classes-1 compete for the label")
    parser.add_argument("--planted", type=int, default=6, help="extra copies of one class token per sequence")
    parser.add_argument("--test-size", type=int, default=512, help="held-out sequences for the test accuracy")
    parser.set_defaults(json=os.path.join("out", "transformer_lamb", "metrics.json"),
                        plot=os.path.join("out", "transformer_lamb", "transformer_lamb.png"))
    args = parser.parse_args(argv)

    print(f"transformer_lamb: {args.optimizer}, dtype {args.dtype}, batch {args.batch_size}, {args.steps} steps, "
          f"d_model {args.d_model}, {args.layers} layers, seq {args.seq_len}")
    _common.compare("transformer_lamb", one_run, args,
                    f"transformer encoder ({args.layers}x{args.d_model}), {args.optimizer}, batch {args.batch_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
