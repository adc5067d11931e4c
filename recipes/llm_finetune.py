"""Fine-tune a Llama-style decoder on a CPU: full fine-tune or LoRA (peft), plain torch beside ipex_train.

    python -m recipes.llm_finetune --size small --mode lora              # every LoRA variant, side by side
    python -m recipes.llm_finetune --size 1b --mode full --variants ipex-int8-sib-ckpt --steps 3
    python -m recipes.llm_finetune --size small --mode trainer           # HF Trainer + peft

The model is a ``LlamaForCausalLM`` built from a config (GQA, RMSNorm, rotary, tied embeddings; ``--size`` from a
CI-sized model to ~1B parameters, weights drawn at random: the recipe measures the training machinery, not a
pretrained model's quality). The text is the source of Python's own standard library, read from disk (no download),
tokenized byte by byte (vocabulary 256).

Modes: ``full`` trains every parameter (fp32 weights); ``lora`` trains peft LoRA adapters on q/k/v/o and the MLP
projections of a base held in ``--base-dtype`` (bfloat16 by default: what ``from_pretrained(dtype=torch.bfloat16)``
gives); ``trainer`` is ``lora`` through ``transformers.Trainer``.

Variants (``--variants``, comma separated), each in its own process so that its peak memory is its own:

* ``torch``: the model as built, torch AdamW (fp32 full fine-tune; in LoRA, the base as loaded and fp32 adapters)
* ``autocast``: the same under ``torch.autocast("cpu", dtype=torch.bfloat16)``
* ``ipex``: ``ipex_train.optimize(dtype=torch.bfloat16)``
* ``ipex-int8``: + ``optimizer_state_dtype="int8"``
* ``ipex-int8-sib``: + ``step_in_backward=True``
* ``ipex-int8-sib-ckpt``: + gradient checkpointing (``model.activation_checkpointing_enable()``)

Checkpoints (``full`` and ``lora``): ``--checkpoint-dir DIR --checkpoint-every N`` saves every N steps and at the
end into ``DIR/VARIANT/step-N`` (:class:`ipex_train.checkpoint.Checkpointer`: model, optimizer, LR schedule, RNG
states, the data position); the same command run again resumes each variant from its latest complete checkpoint
and prints where (``--no-resume`` starts over). The JSON's ``first_step`` says where a run's losses start.

Reported per variant: tokens/s (median step), peak RSS minus the process's RSS before the model is built, that in
bytes per parameter, ipex_train.memory_report's bytes per trainable and per frozen parameter, and the losses (same
batches for every variant). JSON and a PNG of loss and tokens/s per step under ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recipes import _checkpoints, _common

# hidden, layers, heads, kv heads, MLP width: ~0.1M to ~1B parameters (vocabulary 256: byte-level).
SIZES = {
    "tiny": (64, 2, 4, 2, 172),
    "small": (256, 4, 8, 4, 688),
    "100m": (768, 12, 12, 4, 2048),
    "350m": (1024, 24, 16, 4, 2816),
    "1b": (2048, 22, 32, 4, 5632),  # TinyLlama's shape
}
VARIANTS = ("torch", "autocast", "ipex", "ipex-int8", "ipex-int8-sib", "ipex-int8-sib-ckpt")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB = 256


def corpus(max_bytes: int) -> torch.Tensor:
    """Up to ``max_bytes`` of the Python standard library's source (sorted file order), as byte token ids."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> _checkpoints.RandomWindows:
    """Endless random windows of ``seq_len`` tokens (the same sequence for every variant of one seed); its
    ``state_dict()`` is the position a checkpoint holds."""
    return _checkpoints.RandomWindows(tokens, batch_size, seq_len, seed)


def build(size: str, dtype: torch.dtype, seq_len: int):
    """The Llama of ``size``, its weights created directly in ``dtype`` (no fp32 copy on the way)."""
    import transformers

    hidden, layers, heads, kv, mlp = SIZES[size]
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=mlp,
                                   max_position_embeddings=seq_len, tie_word_embeddings=True,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)


def add_lora(model, rank: int):
    """peft LoRA adapters (fp32, as peft makes them) on the attention and MLP projections; the base frozen."""
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))


def rss_mib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@dataclass
class LLMRun(_common.RunResult):
    """One variant's run: :class:`recipes._common.RunResult` plus the LLM figures."""

    mode: str = ""
    seq_len: int = 0
    parameters: int = 0
    trainable: int = 0
    rss_before_mib: float = 0.0
    memory_report: dict = field(default_factory=dict)
    first_step: int = 0  # the step a resumed run started from (its losses are those of steps first_step, ...)

    def summary(self) -> dict:
        """The scalar metrics, with tokens/s and the memory figures."""
        out = super().summary()
        added = max(0.0, self.peak_rss_mib - self.rss_before_mib)
        out.update(mode=self.mode, seq_len=self.seq_len, parameters=self.parameters, trainable=self.trainable,
                   tokens_per_s=self.batch_size * self.seq_len / self.median_step_s,
                   rss_before_mib=self.rss_before_mib, peak_rss_added_mib=added,
                   peak_rss_bytes_per_param=added * 2 ** 20 / max(1, self.parameters),
                   memory_report=self.memory_report, first_step=self.first_step)
        return out


def _memory(model, optimizer) -> dict:
    import ipex_train

    r = ipex_train.memory_report(model, optimizer)
    return {"total": r.per_parameter()["total"], "trainable": r.per_trainable(), "frozen": r.per_frozen()["total"],
            "line": str(r)}


def _setup(args, variant: str):
    """The model and optimizer of one variant, and the context its forwards run under."""
    import ipex_train

    lora = args.mode in ("lora", "trainer")
    base_dtype = _common.DTYPES[args.base_dtype] if lora else torch.float32
    torch.manual_seed(args.seed)
    model = build(args.size, base_dtype, args.seq_len)
    if lora:
        model = add_lora(model, args.rank)
    if variant.endswith("-ckpt"):
        model.activation_checkpointing_enable()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr or (2e-3 if lora else 1e-4), weight_decay=0.0)
    context = contextlib.nullcontext
    if variant == "autocast":
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif variant.startswith("ipex"):
        model, optimizer = ipex_train.optimize(
            model, optimizer, dtype=torch.bfloat16, inplace=True, frozen_weights=args.frozen_weights,
            optimizer_state_dtype="int8" if "int8" in variant else None, step_in_backward="sib" in variant or None)
    return model, optimizer, context


def one_run(args) -> LLMRun:
    """Train one variant (``args.variant``) for ``args.steps`` steps; runs in its own process."""
    tokens = corpus(args.corpus_mib * 2 ** 20)
    data = batches(tokens, args.batch_size, args.seq_len, args.seed)
    _import_libraries(args.mode)
    before = rss_mib()
    model, optimizer, context = _setup(args, args.variant)
    result = LLMRun(name=args.variant, dtype=args.base_dtype, steps=args.steps, batch_size=args.batch_size,
                    mode=args.mode, seq_len=args.seq_len, rss_before_mib=before,
                    parameters=sum(p.numel() for p in model.parameters()),
                    trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                    memory_report=_memory(model, optimizer))
    if args.mode == "trainer":
        _train_with_trainer(args, model, optimizer, data, result)
    else:
        _train(args, model, optimizer, context, data, result)
    return result


def _import_libraries(mode: str) -> None:
    """Import what building and optimizing the model loads (~300 MB of code and tables), so that the RSS taken
    before the build counts it and the peak above it is the training's own."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import ipex_train.compute_policy  # noqa: F401

    if mode != "full":
        import peft  # noqa: F401

        import ipex_train.integrations.peft  # noqa: F401
    import ipex_train.integrations.transformers  # noqa: F401


def warmup(optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear learning-rate warm-up over ``steps`` steps (constant after; ``steps`` 0: constant throughout).

    A full fine-tune of a randomly initialised decoder diverges in its first steps at AdamW's usual rates without
    it (plain torch fp32, 100m, lr 3e-4, batch 1: the loss jumps 5.1 -> 7.4 at step 3; 1b: 6.3 -> 8.1 -> 10.9)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / steps) if steps else 1.0)


def _train(args, model, optimizer, context, data, result: LLMRun) -> None:
    from tqdm import tqdm

    scheduler = warmup(optimizer, args.warmup_steps)
    ckpt, result.first_step = _checkpoints.open_run(args, os.path.join(args.checkpoint_dir or "", args.variant),
                                                    model, optimizer, scheduler, data,
                                                    say=lambda line: print(f"{args.variant}: {line}", flush=True))
    bar = tqdm(range(result.first_step, args.steps), desc=f"{args.variant:>20}", disable=args.no_progress,
               dynamic_ncols=True)
    for step in bar:
        ids = next(data)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with context():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        result.step_times_s.append(time.perf_counter() - t0)
        result.losses.append(loss.item())
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}",
                        tok_s=f"{args.batch_size * args.seq_len / result.step_times_s[-1]:.0f}")
        if ckpt is not None:
            ckpt.maybe_save(step + 1, data.state_dict())
    if ckpt is not None:
        ckpt.maybe_save(args.steps, data.state_dict(), final=True)
        ckpt.close()


def _train_with_trainer(args, model, optimizer, data, result: LLMRun) -> None:
    import tempfile

    import transformers

    class Windows(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.cat([next(data) for _ in range(args.steps)])

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            result.step_times_s.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(out, per_device_train_batch_size=args.batch_size,
                                               max_steps=args.steps, logging_steps=1, use_cpu=True, report_to=[],
                                               save_strategy="no", disable_tqdm=args.no_progress, seed=args.seed)
        sched = warmup(optimizer, args.warmup_steps)
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=Windows(),
                                       optimizers=(optimizer, sched), callbacks=[Timer()])
        trainer.train()
    result.losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]


def report(runs: list[LLMRun]) -> str:
    """A plain-text table of the variants, ratios against the first."""
    rows = [r.summary() for r in runs]
    head = (f"{'variant':<20}{'tokens/s':>10}{'vs first':>9}{'peak+ MiB':>11}{'B/param':>9}{'trainable':>11}"
            f"{'frozen':>8}{'final loss':>12}{'vs first':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r["memory_report"]
        lines.append(f"{r['name']:<20}{r['tokens_per_s']:>10.1f}{r['tokens_per_s'] / rows[0]['tokens_per_s']:>8.2f}x"
                     f"{r['peak_rss_added_mib']:>11.0f}{r['peak_rss_bytes_per_param']:>9.2f}"
                     f"{m['trainable']:>11.2f}{m['frozen']:>8.2f}{r['final_loss']:>12.4f}"
                     f"{100 * (r['final_loss'] / rows[0]['final_loss'] - 1):>+8.2f}%")
    return "\n".join(lines)


def plot(path: str, runs: list[LLMRun], title: str) -> None:
    """Loss (left) and tokens/s (right) per step of every variant, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        ax_loss.plot(r.losses, label=r.name, linewidth=1)
        ax_tok.plot([r.batch_size * r.seq_len / t for t in r.step_times_s], label=r.name, linewidth=1)
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    ax_tok.set(xlabel="step", ylabel="tokens/s", title="throughput")
    for ax in (ax_loss, ax_tok):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run every asked variant in its own process, print the table, write the JSON and the plot."""
    parser = argparse.ArgumentParser(prog="python -m recipes.llm_finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--mode", choices=["full", "lora", "trainer"], default="lora")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all; trainer: torch,ipex)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (1e-4 full, 2e-3 LoRA)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear learning-rate warm-up (10 full: a random init diverges without; 0 LoRA)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--base-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="LoRA/trainer: the dtype the frozen base is loaded in (full mode: float32)")
    parser.add_argument("--frozen-weights", choices=["lossless", "low_precision"], default="lossless",
                        help="optimize(frozen_weights=...): a float32 base's frozen weights keep their fp32 truth, "
                             "or are held in bf16 only")
    parser.add_argument("--corpus-mib", type=int, default=8, help="MiB of standard-library source to sample from")
    parser.add_argument("--out", default=os.path.join("out", "llm_finetune"))
    parser.add_argument("--json", metavar="PATH", help="default: OUT/metrics.json")
    parser.add_argument("--plot", metavar="PATH", help="default: OUT/llm_finetune.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    _checkpoints.add_flags(parser)
    args = parser.parse_args(argv)
    _checkpoints.check_flags(parser, args)
    if args.checkpoint_dir is not None and args.mode == "trainer":
        parser.error("--checkpoint-dir: the trainer mode checkpoints through transformers.Trainer (save_strategy); "
                     "use --mode full or lora")
    default = "torch,ipex" if args.mode == "trainer" else ",".join(VARIANTS)
    variants = (args.variants or default).split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {','.join(unknown)}; choose from {','.join(VARIANTS)}")
    if args.mode == "full":
        args.base_dtype = "float32"
    if args.warmup_steps is None:
        args.warmup_steps = 10 if args.mode == "full" else 0
    if args.warmup_steps < 0:
        parser.error("--warmup-steps: must be 0 or more")
    args.json = args.json or os.path.join(args.out, "metrics.json")
    args.plot = args.plot or os.path.join(args.out, "llm_finetune.png")

    print(f"llm_finetune: {args.size} Llama, mode {args.mode}, base {args.base_dtype}, batch {args.batch_size} x "
          f"{args.seq_len} tokens, {args.steps} steps")
    runs = [_common.run_isolated(one_run, argparse.Namespace(**vars(args), variant=v)) for v in variants]
    print()
    print(report(runs))
    for r in runs:
        print(f"{r.name}: {r.memory_report['line']}")
    _common.write_json(args.json, runs, {"recipe": "llm_finetune", "args": vars(args)})
    plot(args.plot, runs, f"{args.size} Llama, {args.mode}, batch {args.batch_size} x {args.seq_len}")
    print(f"metrics: {os.path.abspath(args.json)}\nplot:    {os.path.abspath(args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
