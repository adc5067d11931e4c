"""Train a small decoder language model sharded with FSDP2 over several CPU processes (gloo), with ipex_train.

    torchrun --nproc_per_node 2 -m recipes.fsdp_train                       # bf16, 2 processes on this machine
    torchrun --nproc_per_node 2 -m recipes.fsdp_train --dtype float32 --state-dtype int8 --step-in-backward
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m recipes.fsdp_train                                             # two machines (node_rank 1 on the other)

The model is a Llama-style decoder built from a transformers config (nothing downloaded); the text is the English
dataset descriptions that ship inside scikit-learn, as bytes (vocabulary 256). The order is FSDP2's: fully_shard
every decoder layer and the root on a CPU mesh (with a bf16 MixedPrecisionPolicy for --dtype bfloat16), build the
optimizer, then ipex_train.optimize(model, optimizer, dtype=..., inplace=True). Rank 0 shows a progress bar and
writes the metrics as JSON and the loss/step-time curves as PNG; --checkpoint DIR saves the model and optimizer
with torch.distributed.checkpoint at the end (loadable at any number of processes, or into a plain model).

--checkpoint-dir DIR --checkpoint-every N saves every N steps and at the end into DIR/step-N
(:class:`ipex_train.checkpoint.Checkpointer`: shards of the model and optimizer, the LR schedule, each rank's RNG
states and data position); the same command run again (after a crash) resumes from the
latest complete checkpoint and rank 0 prints where (--no-resume starts over), and so do the ranks torchrun starts
again itself after one died (torchrun --max-restarts N). Resuming needs the same number of processes (the data
position is per rank).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipes import _checkpoints, _common


def corpus() -> torch.Tensor:
    """scikit-learn's dataset descriptions (real English prose, ~47 KB) as a 1-D tensor of byte values."""
    import sklearn

    folder = Path(sklearn.__file__).parent / "datasets" / "descr"
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.rst")))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A Llama-style decoder from a transformers config, seeded (every rank starts from the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def shard(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """fully_shard every decoder layer, then the root, on a CPU mesh of all processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == "bfloat16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> _checkpoints.RandomWindows:
    """Endless random windows of ``seq_len + 1`` bytes of the text for this rank (its own generator; inputs are
    ``[:, :-1]``, next-byte targets ``[:, 1:]``); its ``state_dict()`` is the position a checkpoint holds."""
    return _checkpoints.RandomWindows(data, batch_size, seq_len + 1, seed * 1000 + dist.get_rank())


def train(args: argparse.Namespace) -> _common.RunResult:
    """The sharded training run; returns rank 0's view (global mean losses, step times)."""
    from tqdm import tqdm

    import ipex_train

    model = shard(build_model(args).train(), args.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-3, weight_decay=0.01)
    model, optimizer = ipex_train.optimize(model, optimizer, dtype=_common.DTYPES[args.dtype], inplace=True,
                                           optimizer_state_dtype=_common.STATE_DTYPES[args.state_dtype],
                                           step_in_backward=args.step_in_backward)
    scheduler = _common.one_cycle(optimizer, args.steps)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(ipex_train.summary(model, optimizer))
        print(f"rank 0: {ipex_train.memory_report(model, optimizer)}")
    name = f"FSDP2 x{dist.get_world_size()} {args.dtype}" + \
        ("" if args.state_dtype == "float32" else f", {args.state_dtype} state")
    result = _common.RunResult(name=name, dtype=args.dtype, steps=args.steps,
                               batch_size=args.batch_size * dist.get_world_size())
    data = batches(corpus(), args.batch_size, args.seq_len, args.seed)
    ckpt, start = _checkpoints.open_run(args, args.checkpoint_dir, model, optimizer, scheduler, data,
                                        say=lambda line: rank0 and print(line, flush=True))
    result.first_step = start
    bar = tqdm(range(start, args.steps), desc=name, disable=not rank0 or args.no_progress, dynamic_ncols=True)
    for step in bar:
        window = next(data)
        x, y = window[:, :-1], window[:, 1:]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        result.step_times_s.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        result.losses.append(float(mean) / dist.get_world_size())
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}", ms=f"{1e3 * result.step_times_s[-1]:.0f}")
        if ckpt is not None:
            ckpt.maybe_save(step + 1, data.state_dict())
    if ckpt is not None:
        ckpt.maybe_save(args.steps, data.state_dict(), final=True)
        ckpt.close()
    if args.checkpoint:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
    result.peak_rss_mib = _common.peak_rss_mib()
    return result


def init_process_group() -> None:
    """The gloo process group over torchrun's env:// rendezvous (one process when run directly), its store keys
    under a prefix naming torchrun's restart count.

    torchrun (static and c10d rendezvous alike) keeps one TCPStore for the whole job, and the workers it starts
    again after a rank died (--max-restarts) connect to that same store. Without a prefix of their own, a
    restarted rank's gloo connectFullMesh can read the address a rank of the previous attempt published (the
    key names are the same) and fail with "Connection refused" before training starts."""
    if "RANK" not in os.environ:  # run directly: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"recipes.fsdp_train/attempt{attempt}", store),
                            rank=rank, world_size=world_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node 2 -m recipes.fsdp_train",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    _common.add_state_dtype_flag(parser)
    parser.add_argument("--step-in-backward", action="store_true", help="step each shard inside backward")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="save model and optimizer with DCP once, at the end, into DIR itself (no resuming)")
    _checkpoints.add_flags(parser)
    parser.add_argument("--json", default=os.path.join("out", "fsdp_train", "metrics.json"))
    parser.add_argument("--plot", default=os.path.join("out", "fsdp_train", "fsdp_train.png"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    _checkpoints.check_flags(parser, args)
    init_process_group()
    try:
        result = train(args)
        if dist.get_rank() == 0:
            print(_common.report([result]))
            _common.write_json(args.json, [result], {"world_size": dist.get_world_size(), "args": vars(args),
                                                     "first_step": result.first_step})
            _common.plot(args.plot, [result], f"FSDP2 on {dist.get_world_size()} CPU processes (gloo)")
            print(f"wrote {args.json} and {args.plot}")
        dist.barrier()  # the ranks leave together: none tears down while rank 0 still writes its report
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
