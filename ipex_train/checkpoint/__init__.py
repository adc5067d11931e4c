"""Checkpoints for plain training loops that survive a kill: save every N steps, resume with one call.

.. code-block:: python

    from ipex_train.checkpoint import Checkpointer

    ckpt = Checkpointer("ckpt", model, optimizer, scheduler, every=100, keep=2)
    resumed = ckpt.resume()                  # None, or the latest complete checkpoint loaded
    start = resumed.step if resumed else 0
    for step in range(start, steps):
        ...                                  # one training step
        ckpt.maybe_save(step + 1, data_state=loader_position)
    ckpt.maybe_save(steps, data_state=loader_position, final=True)
    ckpt.close()

What a checkpoint holds (through ``torch.distributed.checkpoint``, one process or FSDP2 ranks): the model
(fp32 values: split bf16 weights combined), the optimizer's state (reduced bf16/int8 state decoded to fp32; it
re-encodes to the same bits on load), the LR scheduler, the step, and per rank the RNG states (torch CPU, Python,
NumPy) and the data position the caller hands over. A folder counts only once complete (``step-N``, renamed from
``step-N.tmp`` after DCP's ``.metadata`` and a marker are written); the latest ``keep`` are kept.
``docs/checkpoints.md`` has the layout, loading with plain torch, and the fault-injection results.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from . import _folders, _staging, _state

__all__ = ["Checkpointer", "Resumed", "complete_checkpoints", "latest_checkpoint"]

_log = logging.getLogger("ipex_train")


@dataclass(frozen=True)
class Resumed:
    """What :meth:`Checkpointer.resume` loaded: the step the checkpoint was saved after (the loop goes on with the
    next one), the data position saved by this rank (None when the checkpoint has none for this rank: saved at
    another world size), the folder, and the world size it was saved at."""

    step: int
    data_state: Any
    path: Path
    world_size: int


def complete_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as ``(step, folder)``, oldest first (unfinished folders left by a
    killed save are not among them)."""
    return _folders.complete(Path(directory))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The folder of the latest complete checkpoint in ``directory``, or None."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_SINGLE_PROCESS_SAVE = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save"


@contextlib.contextmanager
def _quiet(single_process: bool):
    """DCP warns at every save and load of one process that it assumes one process: intended here."""
    with warnings.catch_warnings():
        if single_process:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_int(name: str, value, minimum: int, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Checkpointer: {name} must be an int{' or None' if allow_none else ''}, got {value!r}")
    if value < minimum:
        raise ValueError(f"Checkpointer: {name} must be >= {minimum}, got {value}")


class Checkpointer:
    """Saves ``model``, ``optimizer`` and ``scheduler`` (with the RNG states, the step and a data position) into
    ``directory/step-N`` folders with torch.distributed.checkpoint, and resumes from the latest complete one.

    Args:
        directory: where the ``step-N`` folders go (created on the first save).
        model: the model (plain, optimize()d, or FSDP2-sharded).
        optimizer: its optimizer (e.g. the one optimize() returned), or None.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``), or None.
        every: :meth:`maybe_save` saves when the step is a multiple of it (None: only when ``final=True``).
        keep: how many complete checkpoints to keep (the latest); None keeps all.
        async_save: write in the background: ``save()`` builds the state dict (copying what shares memory with
            the live model and optimizer), then a thread writes it with
            ``torch.distributed.checkpoint.save`` while training goes on; a checkpoint counts once its write
            finished.

    Under torch.distributed every rank constructs it and calls every method; rank 0 publishes and deletes folders.
    """

    def __init__(self, directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler=None, *, every: int | None = None, keep: int | None = 2, async_save: bool = False):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"Checkpointer: directory must be a str or os.PathLike, got {type(directory).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"Checkpointer: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Checkpointer: optimizer must be a torch.optim.Optimizer or None, got "
                            f"{type(optimizer).__name__}")
        if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
            raise TypeError("Checkpointer: scheduler must have state_dict() and load_state_dict() (an LR scheduler) "
                            f"or be None, got {type(scheduler).__name__}")
        _check_int("every", every, 1, allow_none=True)
        _check_int("keep", keep, 1, allow_none=True)
        if not isinstance(async_save, bool):
            raise TypeError(f"Checkpointer: async_save must be True or False, got {async_save!r}")
        if async_save and not (dist.is_available() and dist.is_initialized()):
            # DCP says at every single-process save that it assumes one process (intended here). The background
            # write cannot scope a filter to itself (warnings.catch_warnings is process-wide, not thread-safe), so
            # this one message is filtered for the process.
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_SAVE)
        self.directory = Path(directory)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every, self.keep, self.async_save = every, keep, async_save
        self.rank, self.world_size = _distributed()
        self._dist = dist.is_available() and dist.is_initialized()
        # Background writes talk over a group of their own, so that their collectives never interleave with the
        # training's (FSDP2's all-gathers) on the default group.
        self._group = dist.new_group(backend="gloo") if async_save and self._dist else None
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None

    # -- saving --------------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, data_state: Any = None, *, final: bool = False) -> Path | None:
        """Save after ``step`` completed steps when ``step`` is a multiple of ``every``, or when ``final`` (the end
        of training); never twice for the same step. Returns the folder it will be published as, or None."""
        _check_int("step", step, 0, allow_none=False)
        due = final or (self.every is not None and step % self.every == 0 and step > 0)
        if not due or step == self.last_saved_step:
            return None
        return self.save(step, data_state)

    def save(self, step: int, data_state: Any = None) -> Path:
        """Save now, as the checkpoint after ``step`` completed steps; ``data_state``: this rank's data position
        (anything picklable). Synchronous unless ``async_save``: then it returns once the state is copied and the
        write goes on in the background (the previous background write is waited for first)."""
        _check_int("step", step, 0, allow_none=False)
        self.wait()
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            _folders.remove_leftovers(self.directory)
        if self._dist:
            dist.barrier()  # no rank writes into a folder rank 0 is still clearing
        state = _state.state_dict(self.model, self.optimizer, self.scheduler, step, self.rank, self.world_size,
                                  data_state)
        target = _folders.temp_path(self.directory, step)
        if not self.async_save:
            with _quiet(not self._dist):
                dcp.save(state, checkpoint_id=target, no_dist=not self._dist)
            self._publish(step)
            self.last_saved_step = step
        else:
            # The write goes on in a thread of this process on a private copy of the state (only what shares memory
            # with the live model and optimizer is copied: _staging), and the folder is published when it is done.
            state = _staging.private_copy(state, self.model, self.optimizer)
            self.last_saved_step = step  # a failed background write raises at the next wait()
            self._pending = threading.Thread(target=self._write, args=(state, target, step), daemon=True,
                                             name=f"ipex_train checkpoint step-{step}")
            self._pending.start()
        return _folders.final_path(self.directory, step)

    def _publish(self, step: int) -> None:
        # DCP's finish (rank 0 writes .metadata after gathering every rank's write results) is done on every rank
        # once save() returns: every rank's files are written.
        if self.rank == 0:
            _folders.publish(self.directory, step, {"world_size": self.world_size})
            _folders.prune(self.directory, self.keep)

    def _write(self, state: dict[str, Any], target: Path, step: int) -> None:
        try:
            dcp.save(state, checkpoint_id=target, process_group=self._group, no_dist=not self._dist)
            self._publish(step)
        except BaseException as e:  # re-raised by wait() in the training thread
            self._error = e

    def wait(self) -> None:
        """Wait for a background save to be written and published; raises its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"Checkpointer: the background save failed: {error}") from error

    def close(self) -> None:
        """Wait for a background save (call once training is done)."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- resuming ------------------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The latest complete checkpoint's folder (rank 0's view, shared with every rank), or None."""
        path = latest_checkpoint(self.directory) if self.rank == 0 else None
        if self._dist:
            box = [None if path is None else str(path)]
            dist.broadcast_object_list(box, src=0)
            path = None if box[0] is None else Path(box[0])
        return path

    def resume(self) -> Resumed | None:
        """Load the latest complete checkpoint into the model, optimizer and scheduler, restore this rank's RNG
        states, and return where training stands (None, changing nothing, when there is no complete checkpoint)."""
        self.wait()
        path = self.latest()
        return None if path is None else self.load(path)

    def load(self, path: str | os.PathLike) -> Resumed:
        """Load the checkpoint folder ``path`` (see :meth:`resume`)."""
        path = Path(path)
        reader = dcp.FileSystemReader(path)
        metadata = reader.read_metadata()
        saved = {p[0] for p in (getattr(metadata, "planner_data", None) or {}).values()}
        parts = {"model", "progress", f"rank{self.rank}"} & saved | {"model", "progress"}
        if self.optimizer is not None:
            if "optim" not in saved:
                raise ValueError(f"Checkpointer: {path} holds no optimizer state, but an optimizer was given")
            parts.add("optim")
        if self.scheduler is not None:
            if "scheduler" not in saved:
                raise ValueError(f"Checkpointer: {path} holds no LR scheduler state, but a scheduler was given")
            parts.add("scheduler")
        loaded = _state.template(metadata, self.model, self.rank, parts)
        # Nothing changes until the checkpoint is read (into new tensors) and its optimizer matches this one; then
        # the optimizer (whose load checks everything before it changes anything), the model, the scheduler, RNG.
        with _quiet(not self._dist):
            dcp.load(loaded, storage_reader=reader, no_dist=not self._dist)
        if self.optimizer is not None:
            _state.load_optimizer(self.model, self.optimizer, loaded["optim"])
        _state.load_model(self.model, loaded["model"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(loaded["scheduler"])
        mine = loaded.get(f"rank{self.rank}")
        if mine is not None:
            _state.set_rng_state(mine["rng"])
        else:
            _log.warning("Checkpointer: %s has no state for rank %d (saved by %d process(es)): RNG states and the "
                         "data position are not restored", path, self.rank, loaded["progress"]["world_size"])
        step = int(loaded["progress"]["step"])
        self.last_saved_step = step
        _log.info("Checkpointer: resumed from %s (step %d)", path, step)
        return Resumed(step=step, data_state=None if mine is None else mine["data"], path=path,
                       world_size=int(loaded["progress"]["world_size"]))

    def clear(self) -> None:
        """Delete every checkpoint in the directory (a run that starts over: a later resume must not pick an older
        run's checkpoint). Rank 0 deletes; every rank waits for it."""
        self.wait()
        if self.rank == 0:
            _folders.remove_all(self.directory)
        if self._dist:
            dist.barrier()
        self.last_saved_step = None
