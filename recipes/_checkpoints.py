"""Checkpoint flags and resuming for the language-model recipes (llm_finetune, fsdp_train), and their data stream
(random text windows) with a position that a checkpoint can hold."""
from __future__ import annotations

import argparse
import os

import torch


class RandomWindows:
    """Endless batches of ``batch_size`` random windows of ``length`` tokens from ``tokens``, drawn by a generator
    of their own (seeded by ``seed``); :meth:`state_dict` is the position in the stream, which
    :meth:`load_state_dict` restores (a resumed run draws the batches the uninterrupted one would)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, length: int, seed: int):
        self.tokens, self.batch_size, self.length = tokens, batch_size, length
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.length, (self.batch_size,), generator=self.generator)
        self.drawn += 1
        return torch.stack([self.tokens[s:s + self.length] for s in starts.tolist()])

    def state_dict(self) -> dict:
        """The stream's position: the generator's state and the number of batches drawn."""
        return {"generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        """Go to the position :meth:`state_dict` returned."""
        self.generator.set_state(state["generator"])
        self.drawn = int(state["drawn"])


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--checkpoint-dir, --checkpoint-every, --checkpoint-keep, --async-checkpoint, --no-resume."""
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="save checkpoints here (every --checkpoint-every steps and at the end); the same command "
                             "run again resumes from the latest complete one")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="steps between checkpoints (default: only at the end)")
    parser.add_argument("--checkpoint-keep", type=int, default=2, metavar="K", help="complete checkpoints kept")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="write checkpoints in the background (a copy of the state is written while training "
                             "goes on)")
    parser.add_argument("--no-resume", action="store_true",
                        help="start over: delete the checkpoints in --checkpoint-dir instead of resuming")


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error for checkpoint flags without --checkpoint-dir, or out of range."""
    if args.checkpoint_dir is None and (args.checkpoint_every is not None or args.async_checkpoint or args.no_resume):
        parser.error("--checkpoint-every, --async-checkpoint and --no-resume need --checkpoint-dir")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every: must be 1 or more, got {args.checkpoint_every}")
    if args.checkpoint_keep < 1:
        parser.error(f"--checkpoint-keep: must be 1 or more, got {args.checkpoint_keep}")


def open_run(args: argparse.Namespace, directory: str, model, optimizer, scheduler, data: RandomWindows,
             say=print):
    """The Checkpointer of a run (None without --checkpoint-dir) and the step to start from: the latest complete
    checkpoint in ``directory`` loaded into the model, optimizer, scheduler, RNG states and ``data`` (or step 0,
    after deleting the directory's checkpoints with --no-resume). ``say`` prints where the run starts."""
    if args.checkpoint_dir is None:
        return None, 0
    from ipex_train.checkpoint import Checkpointer

    ckpt = Checkpointer(directory, model, optimizer, scheduler, every=args.checkpoint_every,
                        keep=args.checkpoint_keep, async_save=args.async_checkpoint)
    if args.no_resume:
        ckpt.clear()
        say(f"checkpoints: --no-resume, starting at step 0 (cleared {os.path.abspath(directory)})")
        return ckpt, 0
    resumed = ckpt.resume()
    if resumed is None:
        say(f"checkpoints: none complete in {os.path.abspath(directory)}, starting at step 0")
        return ckpt, 0
    if resumed.data_state is None:
        raise RuntimeError(f"{resumed.path} was saved by {resumed.world_size} process(es) and holds no data position "
                           "for this one; resume with the same number of processes")
    data.load_state_dict(resumed.data_state)
    say(f"checkpoints: resumed from {resumed.path} at step {resumed.step}")
    return ckpt, resumed.step
