"""What a checkpoint holds, as a torch.distributed.checkpoint state dict, and loading it back.

Layout (every key a DCP key; a plain ``dcp.load`` or ``dcp_to_torch_save`` reads it):

* ``model``: ``get_model_state_dict(model)``: fp32 values (split bf16 weights combined), FSDP2 shards as DTensors.
* ``optim``: the optimizer's ``state_dict()`` with parameters named by their FQNs, the layout of
  ``get_state_dict``: ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``. The state is
  fp32 (reduced-byte state decoded; it re-encodes to the same bits on load).
* ``scheduler``: the LR scheduler's ``state_dict()`` (when one is given).
* ``progress``: ``{"step": N, "world_size": W}``.
* ``rank<r>``: each rank's RNG states (torch CPU, Python ``random``, NumPy's global one when NumPy is loaded) and
  the data position its caller handed over.

The optimizer part is built here rather than with ``get_state_dict``/``set_state_dict``: both first run
``_init_optim_state``, a step with zero grads at lr 0 on an optimizer that has no state yet. On a live run saved
before its first step that step would count (Adam's step counter, the bf16 state's rounding rounds), and with
``step_in_backward`` it raises. Loading builds the tensors to read into from the checkpoint's own metadata instead
(state shaped like its parameter is made like the parameter: a DTensor shard under FSDP2).
"""
from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its FQN in ``model`` (a parameter shared by two modules: its first name)."""
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = param_names(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [j for j, p in enumerate(group["params"]) if id(p) not in names]
        if missing:
            raise ValueError(f"Checkpointer: the optimizer's param group {i} holds parameter(s) at position(s) "
                             f"{missing} that are not parameters of the model; build the optimizer from "
                             "model.parameters() (after fully_shard, before optimize(inplace=True))")
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter FQNs (the layout of torch's ``get_state_dict``)."""
    fqns = _optimizer_fqns(model, optimizer)
    flat = [name for group in fqns for name in group]
    sd = optimizer.state_dict()
    return {"state": {flat[i]: entry for i, entry in sd["state"].items()},
            "param_groups": [dict(g, params=[flat[i] for i in g["params"]]) for g in sd["param_groups"]]}


def rng_state() -> dict[str, Any]:
    """This process's random number generators' states."""
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def state_dict(model, optimizer, scheduler, step: int, rank: int, world_size: int, data_state) -> dict[str, Any]:
    """The DCP state dict of one checkpoint on this rank (see the module docstring)."""
    sd: dict[str, Any] = {"model": get_model_state_dict(model),
                          "progress": {"step": step, "world_size": world_size},
                          f"rank{rank}": {"rng": rng_state(), "data": data_state}}
    if optimizer is not None:
        sd["optim"] = optimizer_state(model, optimizer)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    return sd


def _set(tree: dict, path: tuple, value) -> None:
    """Put ``value`` at ``path`` (dict keys and list indices) in ``tree``, creating the containers on the way."""
    node = tree
    for key, nxt in zip(path[:-1], path[1:]):
        fresh = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = fresh
            node = node[key]
        else:
            node = node.setdefault(key, fresh)
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def _tensor_like(meta: TensorStorageMetadata, like: torch.Tensor | None) -> torch.Tensor:
    dtype = meta.properties.dtype
    if like is not None and tuple(like.shape) == tuple(meta.size):
        return torch.empty_like(like, dtype=dtype)  # a DTensor for an FSDP2 shard: each rank reads its part
    return torch.empty(meta.size, dtype=dtype)


def template(metadata: Metadata, model: nn.Module, rank: int, parts: set[str]) -> dict[str, Any]:
    """The state dict to load the checkpoint's top-level ``parts`` into: the model's own state dict, and for
    everything else tensors made from the metadata (optimizer state like its parameter) and placeholders for the
    non-tensor values, which DCP replaces."""
    mappings = getattr(metadata, "planner_data", None)
    if not isinstance(mappings, dict):
        raise ValueError("Checkpointer: this checkpoint's metadata has no key paths (not written by DCP's default "
                         "planner); load it with torch.distributed.checkpoint directly")
    params = dict(model.named_parameters())
    out: dict[str, Any] = {}
    if "model" in parts:
        # New tensors (DTensors for shards), not the live ones plain fp32 parameters' state dict returns: reading
        # the checkpoint changes nothing before every part has been read and checked.
        out["model"] = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
                        for k, v in get_model_state_dict(model).items()}
    for flat, path in mappings.items():
        top = path[0]
        if top == "model" or top not in parts or (top.startswith("rank") and top != f"rank{rank}"):
            continue
        meta = metadata.state_dict_metadata[flat]
        if isinstance(meta, BytesStorageMetadata):
            value = None
        else:
            like = params.get(path[2]) if top == "optim" and len(path) == 4 and path[1] == "state" else None
            value = _tensor_like(meta, like)
        _set(out, tuple(path), value)
    return out


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Load the FQN-keyed optimizer state into ``optimizer`` (its param groups must hold the same parameters, in
    the same order, as the saved ones)."""
    fqns = _optimizer_fqns(model, optimizer)
    saved = loaded["param_groups"]
    if len(saved) != len(fqns):
        raise ValueError(f"Checkpointer: the checkpoint's optimizer has {len(saved)} param group(s), this one "
                         f"{len(fqns)}; build the optimizer as the saved run did")
    for i, (group, names) in enumerate(zip(saved, fqns)):
        if list(group["params"]) != names:
            extra = sorted(set(group["params"]) - set(names))[:3]
            absent = sorted(set(names) - set(group["params"]))[:3]
            raise ValueError(f"Checkpointer: param group {i} of the checkpoint holds other parameters than this "
                             f"optimizer's (saved, not here: {extra}; here, not saved: {absent}; or another "
                             "order); build the optimizer as the saved run did")
    index = {name: i for i, name in enumerate(n for group in fqns for n in group)}
    optimizer.load_state_dict({
        "state": {index[name]: entry for name, entry in loaded.get("state", {}).items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in saved]})


def load_model(model: nn.Module, loaded: dict[str, Any]) -> None:
    """Load the model part (fp32 values; split bf16 weights re-split, FSDP2 shards as DTensors)."""
    set_model_state_dict(model, loaded)
