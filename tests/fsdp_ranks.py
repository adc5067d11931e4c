"""What each rank of tests/test_fsdp2.py runs: FSDP2 (fully_shard on a CPU mesh, gloo) with ipex_train.optimize().

:func:`spawn` starts ``world`` ranks once for a list of tasks; each task returns picklable results, which rank 0
(or every rank, for per-rank figures) writes to a file the test reads. The model has uneven shards: its Linear
layers have 7 and 3 rows, so 4 ranks hold 2/2/2/1 and 1/1/1/0 rows (one rank holds none).
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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


def norm_model() -> nn.Module:
    """Uneven shards large enough for reduced-byte state on every rank at 2 ranks: 1025 and 9 rows (513/512 and 5/4
    rows per rank, each shard >= 4096 elements, rank 1's int8 blocks starting mid-block of the whole weight), then
    a 3-row Linear whose shards keep fp32 state."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 1025), nn.GELU(), nn.Linear(1025, 9), nn.GELU(), nn.Linear(9, 3))


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


def _error(fn) -> str:
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

    out["inplace_false"] = _error(copy)
    m = shard(model())
    opt = torch.optim.AdamW(m.parameters())
    out["no_policy"] = _error(lambda: ipex_train.optimize(m, opt, dtype=torch.bfloat16, inplace=True))
    out["unchanged"] = type(opt) is torch.optim.AdamW and not hasattr(m, "_ipex_train_masters")
    m = shard(model(), bf16_policy())
    out["fp32_on_bf16_policy"] = _error(
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
        err = _error(opt.step)
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

    out["split_weights_in_unit"] = _error(reoptimize)
    m = shard(model())
    opt = torch.optim.AdamW(m.parameters())
    out["frozen_low_precision"] = _error(lambda: ipex_train.optimize(m, opt, inplace=True, dtype=torch.bfloat16,
                                                                     frozen_weights="low_precision"))
    out["frozen_unchanged"] = type(opt) is torch.optim.AdamW
    return out


NORM_STATES = {"bf16": torch.bfloat16, "int8": "int8"}


def task_reduced_norms() -> dict:
    """Lamb and Lars with bf16 and int8 state on uneven shards: the whole weights after STEPS steps, and the state
    dtypes kept per rank."""
    out = {}
    for name in ("lamb", "lars"):
        for state, state_dtype in NORM_STATES.items():
            m, opt = sharded(make_model=norm_model, make_opt=OPTIMIZERS[name], optimizer_state_dtype=state_dtype)
            train(m, opt, STEPS)
            out[f"{name}_{state}"] = full(m)
            out[f"{name}_{state}_dtypes"] = sorted({str(v.dtype) for st in opt.state.values() for k, v in st.items()
                                                    if k != "step"})
    m, opt = sharded(make_model=norm_model, make_opt=OPTIMIZERS["lamb"], optimizer_state_dtype="int8",
                     step_in_backward=True)
    train(m, opt, STEPS)
    out["lamb_int8_step_in_backward"] = full(m)
    return out


def task_frozen() -> dict:
    """A frozen first Linear under FSDP2 (frozen_weights left unset and 'lossless'): it stays as it was (fp32
    shards) while the rest trains as in one process."""
    out = {}
    for frozen_weights in (None, "lossless"):
        m = model()
        m[0].requires_grad_(False)
        m = shard(m)
        m, opt = ipex_train.optimize(m, OPTIMIZERS["adamw"]([p for p in m.parameters() if p.requires_grad]),
                                     inplace=True, frozen_weights=frozen_weights)
        train(m, opt, STEPS)
        out[str(frozen_weights)] = full(m)
        out[f"{frozen_weights}_dtypes"] = sorted({str(p.dtype) for p in m.parameters()})
    return out


def _local_snapshot(m, opt) -> list[torch.Tensor]:
    """This rank's shards and optimizer state, as copies."""
    out = [p.to_local().detach().clone() for p in m.parameters()]
    for st in opt.state.values():
        for v in st.values():
            out.append((v.to_local() if hasattr(v, "to_local") else torch.as_tensor(v)).detach().clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _bad_checkpoints(good: dict, param: torch.Tensor) -> dict:
    """Corrupted copies of ``good`` (an id-keyed optimizer state_dict), each named by the case."""
    import copy

    from torch.distributed.tensor import DTensor

    def edited(fn):
        ck = copy.deepcopy(good)
        fn(ck["state"][0])
        return ck

    wrong = DTensor.from_local(torch.zeros(2, 3), param.device_mesh, param.placements, run_check=False)
    return {
        "missing": edited(lambda st: st.pop("exp_avg_sq")),
        "missing_step": edited(lambda st: st.pop("step")),
        "bad_step": edited(lambda st: st.update(step=torch.tensor(-5.0))),
        "wrong_shape": edited(lambda st: st.update(exp_avg=wrong)),
        "int_dtype": edited(lambda st: st.update(exp_avg=st["exp_avg"].to(torch.int8))),
        "not_a_tensor": edited(lambda st: st.update(exp_avg=[0.0] * 4)),
        "plain_whole_tensor": edited(lambda st: st.update(exp_avg=st["exp_avg"].full_tensor())),
        "group_count": {**copy.deepcopy(good), "param_groups": []},
        "group_without_params": {**copy.deepcopy(good), "param_groups": [{}]},
    }


def _bad_loads(state: str, state_dtype) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    m, opt = sharded(make_model=wide_model, optimizer_state_dtype=state_dtype)
    train(m, opt, 2)
    good = opt.state_dict()
    before = _local_snapshot(m, opt)
    cases = _bad_checkpoints(good, next(m.parameters()))
    for case, ck in cases.items():
        out[f"{state}_{case}"] = _error(lambda ck=ck: opt.load_state_dict(ck))
        out[f"{state}_{case}_unchanged"] = _same(before, _local_snapshot(m, opt))
    # Only rank 1's part of the checkpoint is bad: rank 0 must refuse too.
    mine = cases["missing"] if dist.get_rank() == 1 else good
    out[f"{state}_rank1_only"] = _error(lambda: opt.load_state_dict(mine))
    out[f"{state}_rank1_only_unchanged"] = _same(before, _local_snapshot(m, opt))
    # Through torch.distributed.checkpoint's set_state_dict (FQN-keyed), as a user loads.
    _, osd = get_state_dict(m, opt)
    osd["state"][next(iter(osd["state"]))].pop("exp_avg")
    out[f"{state}_set_state_dict"] = _error(lambda: set_state_dict(m, opt, model_state_dict={},
                                                                   optim_state_dict=osd))
    out[f"{state}_set_state_dict_unchanged"] = _same(before, _local_snapshot(m, opt))
    opt.load_state_dict(good)
    # fp32 state loads as it was; int8 state comes back as fp32 until the next step re-encodes it
    out[f"{state}_good_load_unchanged"] = _same(before, _local_snapshot(m, opt)) if state_dtype is None else True
    out[f"{state}_after"] = train(m, opt, 1)
    return out


def task_bad_load() -> dict:
    """Bad checkpoints into a sharded optimizer (fp32 and int8 state): each refused on every rank, naming the
    problem, with nothing changed on any rank; one corrupted on rank 1 only is refused on rank 0 as well. Then a
    good load and a step still work."""
    return {**_bad_loads("fp32", None), **_bad_loads("int8", "int8")}


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
def _rank_main(rank: int, world: int, port: int, tasks: list, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    try:
        for name, args in tasks:
            try:
                results[name] = globals()[f"task_{name}"](*args)
            except Exception:  # noqa: BLE001 -- reported to the test, which fails with the traceback
                results[name] = {"traceback": traceback.format_exc()}
    finally:
        with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
        dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, tasks: list, out: Path, timeout: float = 600) -> list[dict]:
    """Run ``tasks`` ([(name, args)], functions ``task_<name>``) in ``world`` fresh ranks (gloo on 127.0.0.1);
    returns each rank's results. Ranks still running after ``timeout`` seconds are killed."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), tasks, str(out)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"FSDP2 ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world):
        with open(out / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
