"""Checkpoint folders on disk: naming, the completion marker, publishing, listing, pruning.

A checkpoint of step N is written into ``step-N.tmp``; once every rank's files and DCP's ``.metadata`` are there,
rank 0 writes the marker file (fsynced) and renames the folder to ``step-N`` (one atomic rename on POSIX), then
fsyncs the parent directory. So a folder named ``step-N`` holding the marker is complete; anything else
(``*.tmp``, a folder without the marker, ``*.deleting``) is never resumed from. Deleting renames first, so a
half-deleted folder is never taken for a complete one either.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

MARKER = "CHECKPOINT_COMPLETE.json"
_FINAL = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|deleting|replaced)$")


def final_path(directory: Path, step: int) -> Path:
    """Where the complete checkpoint of ``step`` lives."""
    return directory / f"step-{step}"


def temp_path(directory: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it counts."""
    return directory / f"step-{step}.tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a published checkpoint: named ``step-N``, with DCP's ``.metadata`` and a marker that
    names the same step."""
    match = _FINAL.match(folder.name)
    if not match or not (folder / ".metadata").is_file():
        return False
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("step") == int(match.group(1))


def complete(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as (step, folder), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for folder in directory.iterdir():
        match = _FINAL.match(folder.name)
        if match and folder.is_dir() and is_complete(folder):
            found.append((int(match.group(1)), folder))
    return sorted(found)


def publish(directory: Path, step: int, info: dict) -> Path:
    """Mark the fully written ``step-N.tmp`` complete and rename it to ``step-N`` (replacing an older ``step-N``)."""
    tmp, final = temp_path(directory, step), final_path(directory, step)
    marker = tmp / MARKER
    with open(marker, "w") as f:
        json.dump({"step": step, "time": time.time(), **info}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a run started over (or a resumed one passing an old step): the new one wins
        aside = directory / f"step-{step}.replaced"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(directory)
    return final


def remove(folder: Path) -> None:
    """Delete a checkpoint folder: renamed out of the ``step-N`` namespace first, then removed."""
    doomed = folder.with_name(folder.name.split(".")[0] + ".deleting")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(directory: Path, keep: int | None) -> None:
    """Delete all but the latest ``keep`` complete checkpoints (None: keep all)."""
    if keep is None:
        return
    for _, folder in complete(directory)[:-keep]:
        remove(folder)


def remove_leftovers(directory: Path) -> None:
    """Delete what killed runs left: unfinished ``*.tmp`` folders, half-deleted or half-replaced ones."""
    if directory.is_dir():
        for folder in directory.iterdir():
            if _LEFTOVER.match(folder.name):
                shutil.rmtree(folder, ignore_errors=True)


def remove_all(directory: Path) -> None:
    """Delete every checkpoint folder (complete or not) in ``directory``; other files stay."""
    if directory.is_dir():
        for folder in directory.iterdir():
            if _FINAL.match(folder.name) and folder.is_dir():
                remove(folder)
    remove_leftovers(directory)
