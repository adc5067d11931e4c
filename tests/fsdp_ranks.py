"""What each rank of tests/test_fsdp2.py runs: FSDP2 (fully_shard on a CPU mesh, gloo) with ipex_train.optimize().

:func:`spawn` starts ``world`` ranks once for a list of tasks; each task returns picklable results, which rank 0
(or every rank, for per-rank figures) writes to a file the test reads. The model has uneven shards: its Linear
layers have 7 and 3 rows, so 4 ranks hold 2/2/2/1 and 1/1/1/0 rows (one rank holds none). The tasks on reduced-byte
state with Lamb/Lars, frozen weights and bad checkpoints are in fsdp_ranks_state.py.
"""
from __future__ import annotations

import os
import pickle
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import spawn_ranks
import torch
import torch.distributed as dist
from torch import nn

import ipex_train
from ipex_train.optim import Lamb, Lars

STEPS = 10
X = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
Y = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "lamb": lambda p: Lamb(p, lr=1e-2, weight_decay=0.01),
    "lars": lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
}


def model() -> nn.Module:
    """The test model, seeded (7- and 3-row Linears: uneven shards)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 7), nn.GELU(), nn.LayerNorm(7), nn.Linear(7, 3))


def wide_model() -> nn.Module:
    """A model whose weights are large enough (>= 4096 elements per shard) for reduced-byte optimizer state."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 2048), nn.GELU(), nn.Linear(2048, 3))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32."""
    return (out.float() - y).pow(2).mean()


def reference(make_model, make_opt, steps: int, dtype=None, state_dtype=None):
    """One process, the global batch: optimize() and ``steps`` steps; returns (model, optimizer, losses)."""
    m = make_model()
    opt = make_opt(m.parameters())
    m, opt = ipex_train.optimize(m, opt, dtype=dtype, optimizer_state_dtype=state_dtype)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(m(X), Y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return m, opt, losses


# ------------------------------------------------------------------------------------------------ in the ranks
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard(m: nn.Module, policy=None) -> nn.Module:
    """fully_shard every Linear and the root on the CPU mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()
    mesh = _mesh()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(m, mesh=mesh, mp_policy=policy)
    return m


def bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _batch():
    rank, world = dist.get_rank(), dist.get_world_size()
    b = X.shape[0] // world
    return X[rank * b:(rank + 1) * b], Y[rank * b:(rank + 1) * b]


def train(m, opt, steps: int) -> list[float]:
    """``steps`` steps on this rank's part of the global batch; returns the global mean losses."""
    x, y = _batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def sharded(make_model=model, make_opt=OPTIMIZERS["adamw"], policy=None, dtype=None, **kw):
    """A sharded model and its optimize()d optimizer."""
    m = shard(make_model(), policy)
    return ipex_train.optimize(m, make_opt(m.parameters()), dtype=dtype, inplace=True, **kw)


def full(m: nn.Module) -> list[torch.Tensor]:
    """The model's whole parameters (gathered)."""
    return [p.full_tensor().detach().clone() for p in m.parameters()]


def task_fp32() -> dict:
    """Every fused optimizer, fp32: the whole weights after STEPS steps."""
    out = {}
    for name, make in OPTIMIZERS.items():
        m, opt = sharded(make_opt=make)
        train(m, opt, STEPS)
        out[name] = full(m)
        out[f"{name}_class"] = type(opt).__name__
    return out


def task_bf16() -> dict:
    """The bf16 policy: 20 steps' global mean losses."""
    m, opt = sharded(policy=bf16_policy(), dtype=torch.bfloat16)
    summary = ipex_train.summary(m, opt)
    return {"losses": train(m, opt, 20), "policy": summary.compute_policy, "fused": summary.fused_step,
            "reasons": sorted({k.reason for k in summary.kept})}


def error(fn) -> str:
    """``fn()``'s ValueError/RuntimeError/TypeError as "Type: message", or "no error"."""
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def task_refusals() -> dict:
    """The refused orders and options: each error message, and proof that nothing was changed."""
    out = {}

    def copy():
        m = shard(model())
        ipex_train.optimize(m, torch.optim.AdamW(m.parameters()), inplace=False)

    out["inplace_false"] = error(copy)
    m = shard(model())
    opt = torch.optim.AdamW(m.parameters())
    out["no_policy"] = error(lambda: ipex_train.optimize(m, opt, dtype=torch.bfloat16, inplace=True))
    out["unchanged"] = type(opt) is torch.optim.AdamW and not hasattr(m, "_ipex_train_masters")
    m = shard(model(), bf16_policy())
    out["fp32_on_bf16_policy"] = error(
        lambda: ipex_train.optimize(m, torch.optim.AdamW(m.parameters()), inplace=True))

    def optimize_then_shard(dtype):
        m = model().train()
        m, opt = ipex_train.optimize(m, torch.optim.AdamW(m.parameters()), dtype=dtype, inplace=True)
        for layer in m:
            if isinstance(layer, nn.Linear):
                from torch.distributed.fsdp import fully_shard

                fully_shard(layer, mesh=_mesh())
        before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        x, y = _batch()
        loss_fn(m(x), y).backward()
        err = error(opt.step)
        after = [p.detach() for g in opt.param_groups for p in g["params"]]
        return err, all(torch.equal(a, b) for a, b in zip(before, after))

    out["optimize_then_shard_bf16"], out["then_shard_unchanged"] = optimize_then_shard(torch.bfloat16)
    out["optimize_then_shard_fp32"], _ = optimize_then_shard(None)

    def reoptimize():
        m = model().train()
        ipex_train.optimize(m, torch.optim.AdamW(m.parameters()), dtype=torch.bfloat16, inplace=True)
        for layer in m:
            if isinstance(layer, nn.Linear):
                from torch.distributed.fsdp import fully_shard

                fully_shard(layer, mesh=_mesh())
        ipex_train.optimize(m, torch.optim.AdamW(m.parameters()), dtype=torch.bfloat16, inplace=True)

    out["split_weights_in_unit"] = error(reoptimize)
    m = shard(model())
    opt = torch.optim.AdamW(m.parameters())
    out["frozen_low_precision"] = error(lambda: ipex_train.optimize(m, opt, inplace=True, dtype=torch.bfloat16,
                                                                     frozen_weights="low_precision"))
    out["frozen_unchanged"] = type(opt) is torch.optim.AdamW
    return out


def _checkpoint(m, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd}


def save(m, opt, path: str) -> None:
    """DCP save of the model and optimizer state dicts (get_state_dict)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_checkpoint(m, opt), checkpoint_id=path)


def load(m, opt, path: str) -> None:
    """DCP load into ``m`` and ``opt`` (set_state_dict); works in one process without a process group too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _checkpoint(m, opt)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}


def task_dcp_save(root: str) -> dict:
    """Per state dtype: 3 steps, save, 3 more steps; then a fresh model loads the checkpoint and takes the same 3
    steps (its losses must be the continued ones, bit for bit)."""
    out = {}
    for name, state_dtype in STATE_DTYPES.items():
        m, opt = sharded(make_model=wide_model, optimizer_state_dtype=state_dtype)
        train(m, opt, 3)
        save(m, opt, f"{root}/{name}")
        out[f"{name}_continued"] = train(m, opt, 3)
        m2, opt2 = sharded(make_model=wide_model, optimizer_state_dtype=state_dtype)
        load(m2, opt2, f"{root}/{name}")
        out[f"{name}_resumed"] = train(m2, opt2, 3)
        report = ipex_train.memory_report(m2, opt2)
        out[f"{name}_state_bytes"] = report.state
    return out


def task_dcp_load(root: str) -> dict:
    """Load checkpoints saved at another world size and take 3 steps."""
    out = {}
    for name, state_dtype in STATE_DTYPES.items():
        m, opt = sharded(make_model=wide_model, optimizer_state_dtype=state_dtype)
        load(m, opt, f"{root}/{name}")
        out[f"{name}_resumed"] = train(m, opt, 3)
    return out


def task_clip() -> dict:
    """clip_grad_norm_ over sharded grads: the total norm and the clipped whole grads."""
    m, _ = sharded()
    x, y = _batch()
    loss_fn(m(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    return {"norm": float(total), "grads": [p.grad.full_tensor() for p in m.parameters()]}


def task_step_in_backward() -> dict:
    """step_in_backward on shards: the same weights as step() (fp32 state); with int8 state it trains."""
    out = {}
    for sib in (False, True):
        m, opt = sharded(step_in_backward=sib)
        train(m, opt, 5)
        out[f"weights_{sib}"] = full(m)
    for sib in (False, True):
        m, opt = sharded(make_opt=OPTIMIZERS["lamb"], step_in_backward=sib)
        train(m, opt, 5)
        out[f"lamb_weights_{sib}"] = full(m)
    m, opt = sharded(make_model=wide_model, optimizer_state_dtype="int8", step_in_backward=True)
    out["int8_losses"] = train(m, opt, 10)
    out["int8_state_dtypes"] = sorted({str(v.dtype) for s in opt.state.values() for v in s.values()})
    return out


def task_memory() -> dict:
    """memory_report and summary on this rank."""
    m, opt = sharded(make_model=wide_model)
    train(m, opt, 1)
    report = ipex_train.memory_report(m, opt)
    local_elements = sum(p.to_local().numel() for p in m.parameters())
    return {"rank": dist.get_rank(), "weights": report.weights, "state": report.state, "grads": report.grads,
            "parameters": report.parameters, "local_elements": local_elements,
            "global_elements": sum(p.numel() for p in m.parameters()), "tensors": len(list(m.parameters()))}


# --------------------------------------------------------------------------------------------------- launching
def _task(name: str):
    """``task_<name>`` of this module, or of fsdp_ranks_state (the reduced-state, frozen-weight and bad-load
    tasks)."""
    import fsdp_ranks_state

    return globals().get(f"task_{name}") or getattr(fsdp_ranks_state, f"task_{name}")


def _rank_main(rank: int, world: int, port: int, tasks: list, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    try:
        for name, args in tasks:
            try:
                results[name] = _task(name)(*args)
            except Exception:  # noqa: BLE001 -- reported to the test, which fails with the traceback
                results[name] = {"traceback": traceback.format_exc()}
    finally:
        path = os.path.join(out, f"rank{rank}.pkl")
        with open(path + ".part", "wb") as f:
            pickle.dump(results, f)
        os.replace(path + ".part", path)  # whole or absent: spawn() reads it as the rank's verdict
        try:
            dist.barrier()  # no rank tears down while another still talks to it
        except Exception:  # noqa: BLE001 -- a rank already failed; its traceback is in the results
            pass
        dist.destroy_process_group()


def spawn(world: int, tasks: list, out: Path, timeout: float = 600) -> list[dict]:
    """Run ``tasks`` ([(name, args)], functions ``task_<name>``) in ``world`` fresh ranks (gloo on 127.0.0.1);
    returns each rank's results. Ranks still running after ``timeout`` seconds are killed."""
    return spawn_ranks.spawn(_rank_main, (tasks,), world, out, timeout, "FSDP2")
