"""The fused optimizer steps on FSDP2 shards (parameters that are DTensors sharded by ``fully_shard``), and the
optimizer state_dict / load_state_dict of such an optimizer. Used by :mod:`ipex_train.distributed`.

Each rank steps only its shard: the fused kernel runs on the local tensors of the parameters, grads and state
(a DTensor op without a sharding rule would raise), and the state is stored back as DTensors laid out like the
parameter (``DTensor.from_local`` with the parameter's global shape and stride), which is what DCP needs to
reshard a checkpoint. The packed int8 state of ``state_dtype="int8"`` has no parameter shape and stays a local
tensor (``state_dict()`` turns it into fp32 DTensors).

Lamb and Lars scale each parameter's update by a ratio of whole-tensor norms, which a shard does not have: their
step sums the shards' squares in fp64 with one all_reduce per param group and mesh (every parameter's norms in one
small tensor), then applies the rule of :mod:`ipex_train.optim._reference` to the local shards with foreach ops.
Reduced-byte state (bf16, int8) is decoded to fp32 for that update and stored back in its format with the kernels'
encodings (stochastic rounding for bf16, the same int8 codes), at the points of the step where the kernels store
it.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import _sharded_load, fused, state_formats
from .registry import FusedOptimizer


def needs_norms(entry: FusedOptimizer | None) -> bool:
    """Whether fused optimizer ``entry`` scales updates by whole-parameter norms (its registry entry says so):
    stepped by :func:`_norm_step`, not the per-shard kernel."""
    return entry is not None and entry.whole_tensor_norms


def _wrap(t: Tensor, p: DTensor) -> Tensor:
    """State tensor ``t`` of the local shard of ``p`` as a DTensor like ``p`` when it has the shard's shape."""
    if t.dim() == 0 or t.shape != p._local_tensor.shape:
        return t  # step counters, packed int8 state
    return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def _local_state(state: MutableMapping[Tensor, dict], params: list[DTensor]) -> dict[Tensor, dict]:
    """Each parameter's state with DTensors replaced by their local tensors, keyed by the local parameter."""
    out = {}
    for p in params:
        out[p._local_tensor] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state[p].items()}
    return out


def _store_state(state: MutableMapping[Tensor, dict], params: list[DTensor], local: dict[Tensor, dict]) -> None:
    """Write back the entries the step created or replaced (new tensors, format changes) as DTensors."""
    for p in params:
        entry = state[p]
        for key, value in local[p._local_tensor].items():
            old = entry.get(key)
            same = old is value or (isinstance(old, DTensor) and old._local_tensor is value)
            if not same:
                entry[key] = _wrap(value, p) if isinstance(value, Tensor) else value


def step(entry: FusedOptimizer, group: dict[str, Any], state: MutableMapping[Tensor, dict],
         params: list[DTensor]) -> None:
    """One step of fused optimizer ``entry`` over the sharded ``params`` of ``group`` (all with grads)."""
    if needs_norms(entry):
        _norm_step(entry, group, state, params)
        return
    local = _local_state(state, params)
    lp = [p._local_tensor for p in params]
    fused.fused_step(entry, group, local, lp, [None] * len(lp), [p.grad._local_tensor for p in params])
    _store_state(state, params, local)


def _by_mesh(params: list[DTensor]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.device_mesh, []).append(i)
    return groups


def _global_norms(params: list[DTensor], a: list[Tensor], b: list[Tensor]) -> tuple[list[float], list[float]]:
    """Whole-parameter norms of the sharded tensors ``a[i]`` and ``b[i]`` (local parts of ``params[i]``): the
    shards' sums of squares in fp64, one all_reduce per mesh."""
    sq = torch.zeros(2, len(params), dtype=torch.float64)
    if params:
        sq[0] = torch.stack(torch._foreach_norm([t.double() for t in a])).square()
        sq[1] = torch.stack(torch._foreach_norm([t.double() for t in b])).square()
    for mesh, idx in _by_mesh(params).items():
        part = sq[:, idx].contiguous()
        dist.all_reduce(part, group=mesh.get_group())
        sq[:, idx] = part
    norms = sq.sqrt()
    return norms[0].tolist(), norms[1].tolist()


class _Working:
    """The state lists of one Lamb/Lars shard step in fp32: reduced-byte state (:mod:`.state_formats`) decoded
    for the update and stored back in its format by :meth:`settle`, as the kernels do per block."""

    def __init__(self, entry: FusedOptimizer, group: dict[str, Any], local: dict[Tensor, dict], params: list[Tensor],
                 lists: dict[str, list]):
        self.local, self.params, self.lists = local, params, dict(lists)
        self.signed = {spec.key: spec.signed for spec in entry.state if lists[spec.key]}
        self.reduced = {k: [state_formats.format_of(t) for t in lists[k]] for k in self.signed}
        self.any_reduced = any(f is not None for fmts in self.reduced.values() for f in fmts)
        self.key = state_formats.call_key(group) if self.any_reduced else 0
        for k, fmts in self.reduced.items():
            self.lists[k] = [t if f is None else state_formats.decode(t, p)
                             for t, p, f in zip(lists[k], params, fmts)]

    def settle(self, key: str) -> list[Tensor]:
        """Store the updated fp32 values of state ``key`` in their formats; returns the values the stored state
        decodes to (the fp32 lists themselves for fp32 state), which the rest of the step reads."""
        out = self.lists[key]
        if not any(f is not None for f in self.reduced[key]):
            return out
        settled = []
        for i, (x, p, fmt) in enumerate(zip(out, self.params, self.reduced[key])):
            if fmt is None:
                settled.append(x)
                continue
            if fmt is state_formats.StateFormat.BF16:
                stored = state_formats.encode_bf16_stochastic(x, state_formats.param_key(self.key, i))
            else:
                stored = state_formats.encode(x, p, fmt, self.signed[key])
            self.local[p][key] = stored
            settled.append(state_formats.decode(stored, p))
        return settled


def _norm_step(entry: FusedOptimizer, group: dict[str, Any], state: MutableMapping[Tensor, dict],
               params: list[DTensor]) -> None:
    """Lamb / Lars on shards with whole-parameter norms (the rule of ipex_train.optim._reference), the state in
    the group's format (:class:`_Working`)."""
    local = _local_state(state, params)
    lp = [p._local_tensor for p in params]
    grads = [p.grad._local_tensor for p in params]
    work = _Working(entry, group, local, lp, fused.state_lists(entry, group, local, lp))
    _NORM_RULES[entry.name](group, lp, grads, work, params)
    _store_state(state, params, local)


def _lamb_direction(m: list[Tensor], v: list[Tensor], w: list[Tensor], bc1: list[float], bc2: list[float],
                    eps: float, wd: float) -> list[Tensor]:
    denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(v, bc2)), eps)
    u = torch._foreach_div(torch._foreach_div(m, bc1), denom)
    if wd:
        torch._foreach_add_(u, w, alpha=wd)
    return u


def _lamb(group: dict[str, Any], w: list[Tensor], g: list[Tensor], work: _Working, params) -> None:
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    m, v = work.lists["exp_avg"], work.lists["exp_avg_sq"]
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    steps = torch.stack([s.reshape(()) for s in work.lists["step"]]).double().tolist()
    bc1 = [1 - beta1 ** s if group["bias_correction"] else 1.0 for s in steps]
    bc2 = [1 - beta2 ** s if group["bias_correction"] else 1.0 for s in steps]
    u = _lamb_direction(m, v, w, bc1, bc2, eps, wd)
    w_norms, u_norms = _global_norms(params, w, u)
    # As the kernel: the norms from the fp32 direction, the update from the moments as stored (reduced state).
    if work.any_reduced:
        u = _lamb_direction(work.settle("exp_avg"), work.settle("exp_avg_sq"), w, bc1, bc2, eps, wd)
    scale = [-lr * (a / b if a > 0 and b > 0 else 1.0) for a, b in zip(w_norms, u_norms)]
    torch._foreach_add_(w, torch._foreach_mul(u, scale))


def _lars(group: dict[str, Any], w: list[Tensor], g: list[Tensor], work: _Working, params) -> None:
    lr, momentum, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
    eeta, epsilon = float(group["eeta"]), float(group["epsilon"])
    w_norms, g_norms = _global_norms(params, w, g)
    scale = [lr * (eeta * a / (b + wd * a + epsilon) if a > 0 and b > 0 else 1.0) for a, b in zip(w_norms, g_norms)]
    buf = work.lists["momentum_buffer"]
    d = torch._foreach_add(g, w, alpha=wd) if wd else [t.clone() for t in g]
    torch._foreach_mul_(buf, momentum)
    torch._foreach_add_(buf, torch._foreach_mul(d, scale))
    torch._foreach_sub_(w, buf)  # as the kernel: the weight from the fp32 buffer, which is then stored
    work.settle("momentum_buffer")


def _fp32(value: Tensor, p: Tensor) -> Tensor:
    """State ``value`` of parameter ``p`` as an fp32 DTensor laid out like ``p`` (``value`` itself when it is)."""
    if isinstance(value, DTensor) and value.dtype != torch.bfloat16:
        return value
    shard = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(p, DTensor):
        return state_formats.decode(shard, p)
    decoded = state_formats.decode(shard, p._local_tensor)
    return DTensor.from_local(decoded, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                              run_check=False)


def state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's ``Optimizer.state_dict`` of ``optimizer`` with every state tensor as an fp32 DTensor (reduced-byte
    state decoded shard by shard): what ``torch.distributed.checkpoint`` saves and reshards."""
    packed = torch.optim.Optimizer.state_dict(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index, entry in packed["state"].items():
        p = params[index]
        state[index] = {k: _fp32(v, p) if isinstance(v, Tensor) and k != "step" else v for k, v in entry.items()}
    return {**packed, "state": state}


def load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], entry: FusedOptimizer | None,
                    where: str) -> None:
    """Load as torch does, keeping the param group dicts the same objects and each group's own ``state_dtype``
    (the checkpoint's state is fp32; the next step stores it in the group's format, which gives back the saved
    bits: bf16 and int8 state decode and re-encode exactly). The checkpoint is checked first on every rank
    (:mod:`._sharded_load`, ``where`` starts the messages; ``entry``: the fused optimizer, None for others); a
    load refused on one rank raises on all and changes nothing. Collective: every rank of the shard group calls
    it."""
    groups = optimizer.param_groups
    _sharded_load.check(entry, state_dict, groups, where)
    settings = state_formats.own_settings(groups)
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    for old, new in zip(groups, optimizer.param_groups):
        if old is not new:
            old.clear()
            old.update(new)
    optimizer.param_groups = groups
    state_formats.restore_settings(groups, settings)


# The shard rule of each fused optimizer whose registry entry has whole_tensor_norms (tests/test_fsdp2.py checks
# that every such entry has one).
_NORM_RULES = {"lamb": _lamb, "lars": _lars}
