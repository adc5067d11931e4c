"""The ranks' tasks of tests/test_fsdp2.py on optimizer state under FSDP2: Lamb/Lars with reduced-byte state on
uneven shards, frozen weights, and bad checkpoints loaded into a sharded optimizer. Run by fsdp_ranks.spawn (the
helpers and the launching are there)."""
from __future__ import annotations

import fsdp_ranks as R
import torch
import torch.distributed as dist
from torch import nn

import ipex_train


def norm_model() -> nn.Module:
    """Uneven shards large enough for reduced-byte state on every rank at 2 ranks: 1025 and 9 rows (513/512 and 5/4
    rows per rank, each shard >= 4096 elements, rank 1's int8 blocks starting mid-block of the whole weight), then
    a 3-row Linear whose shards keep fp32 state."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 1025), nn.GELU(), nn.Linear(1025, 9), nn.GELU(), nn.Linear(9, 3))


NORM_STATES = {"bf16": torch.bfloat16, "int8": "int8"}


def task_reduced_norms() -> dict:
    """Lamb and Lars with bf16 and int8 state on uneven shards: the whole weights after STEPS steps, and the state
    dtypes kept per rank."""
    out = {}
    for name in ("lamb", "lars"):
        for state, state_dtype in NORM_STATES.items():
            m, opt = R.sharded(make_model=norm_model, make_opt=R.OPTIMIZERS[name], optimizer_state_dtype=state_dtype)
            R.train(m, opt, R.STEPS)
            out[f"{name}_{state}"] = R.full(m)
            out[f"{name}_{state}_dtypes"] = sorted({str(v.dtype) for st in opt.state.values() for k, v in st.items()
                                                    if k != "step"})
    m, opt = R.sharded(make_model=norm_model, make_opt=R.OPTIMIZERS["lamb"], optimizer_state_dtype="int8",
                     step_in_backward=True)
    R.train(m, opt, R.STEPS)
    out["lamb_int8_step_in_backward"] = R.full(m)
    return out


def task_frozen() -> dict:
    """A frozen first Linear under FSDP2 (frozen_weights left unset and 'lossless'): it stays as it was (fp32
    shards) while the rest trains as in one process."""
    out = {}
    for frozen_weights in (None, "lossless"):
        m = R.model()
        m[0].requires_grad_(False)
        m = R.shard(m)
        m, opt = ipex_train.optimize(m, R.OPTIMIZERS["adamw"]([p for p in m.parameters() if p.requires_grad]),
                                     inplace=True, frozen_weights=frozen_weights)
        R.train(m, opt, R.STEPS)
        out[str(frozen_weights)] = R.full(m)
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
    m, opt = R.sharded(make_model=R.wide_model, optimizer_state_dtype=state_dtype)
    R.train(m, opt, 2)
    good = opt.state_dict()
    before = _local_snapshot(m, opt)
    cases = _bad_checkpoints(good, next(m.parameters()))
    for case, ck in cases.items():
        out[f"{state}_{case}"] = R.error(lambda ck=ck: opt.load_state_dict(ck))
        out[f"{state}_{case}_unchanged"] = _same(before, _local_snapshot(m, opt))
    # Only rank 1's part of the checkpoint is bad: rank 0 must refuse too.
    mine = cases["missing"] if dist.get_rank() == 1 else good
    out[f"{state}_rank1_only"] = R.error(lambda: opt.load_state_dict(mine))
    out[f"{state}_rank1_only_unchanged"] = _same(before, _local_snapshot(m, opt))
    # Through torch.distributed.checkpoint's set_state_dict (FQN-keyed), as a user loads.
    _, osd = get_state_dict(m, opt)
    osd["state"][next(iter(osd["state"]))].pop("exp_avg")
    out[f"{state}_set_state_dict"] = R.error(lambda: set_state_dict(m, opt, model_state_dict={},
                                                                   optim_state_dict=osd))
    out[f"{state}_set_state_dict_unchanged"] = _same(before, _local_snapshot(m, opt))
    opt.load_state_dict(good)
    # fp32 state loads as it was; int8 state comes back as fp32 until the next step re-encodes it
    out[f"{state}_good_load_unchanged"] = _same(before, _local_snapshot(m, opt)) if state_dtype is None else True
    out[f"{state}_after"] = R.train(m, opt, 1)
    return out


def task_bad_load() -> dict:
    """Bad checkpoints into a sharded optimizer (fp32 and int8 state): each refused on every rank, naming the
    problem, with nothing changed on any rank; one corrupted on rank 1 only is refused on rank 0 as well. Then a
    good load and a step still work."""
    return {**_bad_loads("fp32", None), **_bad_loads("int8", "int8")}


def task_checkpointer_async(root: str) -> dict:
    """ipex_train.checkpoint on shards (int8 state, the step inside backward): a synchronous and an asynchronous
    save of the same step, the asynchronous writer held back until two more steps changed the shards in place;
    each loaded into a fresh sharded model, whose gathered weights and next two losses are returned."""
    import threading

    import torch.distributed.checkpoint as dcp

    from ipex_train.checkpoint import Checkpointer

    release, save = threading.Event(), dcp.save

    def held_back(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            release.wait(60)
        return save(*args, **kwargs)

    kw = {"make_model": R.wide_model, "optimizer_state_dtype": "int8", "step_in_backward": True}
    m, opt = R.sharded(**kw)
    R.train(m, opt, 2)
    Checkpointer(f"{root}/sync", m, opt).save(2)
    dcp.save = held_back
    try:
        ckpt = Checkpointer(f"{root}/async", m, opt, async_save=True)
        ckpt.save(2)
        R.train(m, opt, 2)
        release.set()
        ckpt.close()
    finally:
        dcp.save = save
    out = {"trained_on": R.full(m)}
    for name in ("sync", "async"):
        m2, opt2 = R.sharded(**kw)
        out[f"{name}_step"] = Checkpointer(f"{root}/{name}", m2, opt2).resume().step
        out[f"{name}_weights"] = R.full(m2)
        out[f"{name}_losses"] = R.train(m2, opt2, 2)
    return out
