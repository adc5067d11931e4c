"""A checkpoint loaded into the optimizer of a model sharded with FSDP2, checked on every rank before anything is
loaded on any of them.

The checks are the one-process ones (:mod:`.loaded_state`: entries empty or complete, ``step`` a finite number
>= 0, state tensors floating point and shaped like their parameter), plus the layout shards need: a state tensor
shaped like a sharded parameter is a DTensor laid out like it (``get_state_dict``/``set_state_dict`` and this
optimizer's ``state_dict()`` give those; a plain whole tensor would meet the shard only at the step). A rank's
checkpoint can be bad where another's is not (each holds its own shards), so the ranks agree before loading: one
small all_reduce per load, and the failing ranks' messages gathered only when one failed; then every rank raises
and none has changed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import loaded_state
from .registry import FusedOptimizer


def _check_groups(state_dict: Any, groups: Sequence[Mapping[str, Any]], where: str) -> None:
    # torch's own structure checks, here so that the ranks agree on them too.
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups' (an optimizer state_dict), got "
                         f"{type(state_dict).__name__}")
    saved = state_dict["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"{where}: the checkpoint has {len(saved)} param groups, the optimizer {len(groups)}")
    for i, (s, g) in enumerate(zip(saved, groups)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(f"{where}: param group {i} of the checkpoint has {len(s['params'])} parameters, the "
                             f"optimizer's {len(g['params'])}")


def _check_layouts(state_dict: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], where: str) -> None:
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = dict(zip(ids, (p for g in groups for p in g["params"])))
    for saved_id, entry in state_dict["state"].items():
        p = params.get(saved_id)
        if not isinstance(p, DTensor) or not isinstance(entry, Mapping):
            continue
        for key, value in entry.items():
            if not isinstance(value, Tensor) or key == "step" or value.shape != p.shape:
                continue
            if not isinstance(value, DTensor):
                raise ValueError(f"{where}: state[{saved_id!r}][{key!r}] is a plain tensor of the parameter's whole "
                                 f"shape {tuple(p.shape)}; a sharded parameter's state is a DTensor laid out like it "
                                 "(load with torch.distributed.checkpoint's set_state_dict, or a state_dict() of "
                                 "this optimizer)")
            if value.placements != p.placements or value.device_mesh != p.device_mesh:
                raise ValueError(f"{where}: state[{saved_id!r}][{key!r}] is a DTensor placed {value.placements} on "
                                 f"{value.device_mesh}; its parameter is placed {p.placements} on {p.device_mesh}")


def _problem(entry: FusedOptimizer | None, state_dict: Any, groups: Sequence[Mapping[str, Any]],
             where: str) -> Exception | None:
    try:
        _check_groups(state_dict, groups, where)
        if entry is not None:
            loaded_state.check_checkpoint(entry, state_dict, groups, where)
        _check_layouts(state_dict, groups, where)
    except (ValueError, TypeError) as e:
        return e
    except Exception as e:  # noqa: BLE001 -- a malformed checkpoint is this rank's refusal, which the other ranks
        # must learn (raising here alone would leave them waiting in the agreement's collective)
        return ValueError(f"{where}: the checkpoint is not a well-formed optimizer state_dict "
                          f"({type(e).__name__}: {e})")
    return None


def _group(groups: Sequence[Mapping[str, Any]]):
    """The process group of the optimizer's shards (None when it holds none, or without a process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    sharded = next((p for g in groups for p in g["params"] if isinstance(p, DTensor)), None)
    return None if sharded is None else sharded.device_mesh.get_group()


def check(entry: FusedOptimizer | None, state_dict: Any, groups: Sequence[Mapping[str, Any]], where: str) -> None:
    """Raise (ValueError/TypeError, on every rank of the shard group) unless every rank's ``state_dict`` can be
    loaded into its optimizer with param groups ``groups`` (fused optimizer ``entry``, None for others); a rank
    whose own checkpoint is fine names the rank that refused its one. Collective: every rank calls it."""
    problem = _problem(entry, state_dict, groups, where)
    group = _group(groups)
    if group is None:
        if problem is not None:
            raise problem
        return
    failed = torch.tensor([problem is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if problem is None else str(problem), group=group)
    if problem is not None:
        raise problem
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise ValueError(f"{where}: rank {rank} of the shard group refused its part of the checkpoint, so nothing was "
                     f"loaded on any rank: {message}")
