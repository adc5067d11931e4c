"""ipex_train.checkpoint.Checkpointer in one process: a resumed run ends bit-identical to the uninterrupted one
(plain torch and optimize() with fp32, bf16 and int8 state, step_in_backward), incomplete folders are never
resumed from, the latest k are kept, RNG states and the data position come back, asynchronous saves give the same
checkpoint, plain torch loads it, and bad arguments are refused."""
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

import ipex_train
from ipex_train.checkpoint import Checkpointer, complete_checkpoints, latest_checkpoint

CONFIGS = {
    "torch": None,
    "bf16": dict(dtype=torch.bfloat16),
    "bf16_state": dict(dtype=torch.bfloat16, optimizer_state_dtype=torch.bfloat16),
    "int8_sib": dict(dtype=torch.bfloat16, optimizer_state_dtype="int8", step_in_backward=True),
}


def make(config):
    """A small MLP (weights >= 4096 elements: reduced state applies), AdamW with a warm-up schedule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Tanh(), nn.Linear(96, 64)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if CONFIGS[config] is not None:
        model, opt = ipex_train.optimize(model, opt, inplace=True, **CONFIGS[config])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train(model, opt, sched, gen, steps):
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.flip(1))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def raw_state(opt):
    """The optimizer's state as stored (int8 codes, bf16 values), in parameter order."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"]]


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("config", list(CONFIGS))
def test_resumed_run_is_bit_identical(tmp_path, config):
    """Save after 3 steps, train 3 more; a fresh model resumed from the checkpoint takes the same 3 steps: same
    losses, same weights, same raw optimizer state (int8 codes, bf16 state), same param groups and schedule."""
    model, opt, sched = make(config)
    gen = torch.Generator().manual_seed(1)
    train(model, opt, sched, gen, 3)
    Checkpointer(tmp_path, model, opt, sched).save(3, gen.get_state())
    want_losses = train(model, opt, sched, gen, 3)

    model2, opt2, sched2 = make(config)
    resumed = Checkpointer(tmp_path, model2, opt2, sched2).resume()
    assert resumed.step == 3 and resumed.path == tmp_path / "step-3" and resumed.world_size == 1
    gen2 = torch.Generator()
    gen2.set_state(resumed.data_state)
    assert train(model2, opt2, sched2, gen2, 3) == want_losses
    assert same(model2.state_dict(), model.state_dict())
    assert same(raw_state(opt2), raw_state(opt))
    if config == "int8_sib":
        assert {v.dtype for st in raw_state(opt2) for v in st.values()} >= {torch.int8, torch.uint8}
    assert same([{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups],
                [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    assert sched2.state_dict() == sched.state_dict()


def test_save_before_the_first_step_changes_nothing(tmp_path):
    """A save before any step (empty optimizer state) does not step the optimizer (torch's get_state_dict would run
    a zero-grad step); resuming from it gives the uninterrupted run."""
    model, opt, sched = make("int8_sib")
    want = train(model, opt, sched, torch.Generator().manual_seed(1), 3)
    model2, opt2, sched2 = make("int8_sib")
    Checkpointer(tmp_path, model2, opt2, sched2).save(0)
    assert not opt2.state
    assert train(model2, opt2, sched2, torch.Generator().manual_seed(1), 3) == want
    model3, opt3, sched3 = make("int8_sib")
    assert Checkpointer(tmp_path, model3, opt3, sched3).load(tmp_path / "step-0").step == 0
    assert train(model3, opt3, sched3, torch.Generator().manual_seed(1), 3) == want


def _fake(folder, marker=True, metadata=True, step=None):
    folder.mkdir()
    if metadata:
        (folder / ".metadata").write_bytes(b"x")
    if marker:
        (folder / "CHECKPOINT_COMPLETE.json").write_text(json.dumps({"step": step}))


def test_incomplete_folders_are_never_resumed(tmp_path):
    model, opt, sched = make("bf16")
    Checkpointer(tmp_path, model, opt, sched).save(4)
    _fake(tmp_path / "step-8.tmp", step=8)                      # a save killed before its rename
    _fake(tmp_path / "step-9", marker=False)                     # no marker
    _fake(tmp_path / "step-10", metadata=False, step=10)         # no DCP metadata
    _fake(tmp_path / "step-11", step=12)                         # a marker for another step
    (tmp_path / "step-12").write_text("not a folder")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4]
    model2, opt2, sched2 = make("bf16")
    assert Checkpointer(tmp_path, model2, opt2, sched2).resume().step == 4
    # The next save clears the leftovers of killed saves (.tmp), nothing else.
    Checkpointer(tmp_path, model, opt, sched).save(5)
    assert not (tmp_path / "step-8.tmp").exists() and (tmp_path / "step-9").exists()


def test_every_keep_and_final(tmp_path):
    model, opt, sched = make("bf16")
    gen = torch.Generator().manual_seed(1)
    ckpt = Checkpointer(tmp_path, model, opt, sched, every=2, keep=2)
    saved = []
    for step in range(1, 8):
        train(model, opt, sched, gen, 1)
        saved.append(ckpt.maybe_save(step))
    assert [p.name if p else None for p in saved] == [None, "step-2", None, "step-4", None, "step-6", None]
    assert ckpt.maybe_save(7, final=True) == tmp_path / "step-7"
    assert ckpt.maybe_save(7, final=True) is None  # never twice for one step
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-7"]
    Checkpointer(tmp_path, model, opt, sched).clear()
    assert list(tmp_path.iterdir()) == [] and latest_checkpoint(tmp_path) is None
    assert Checkpointer(tmp_path, *make("bf16")).resume() is None


def test_rng_states_come_back(tmp_path):
    model, opt, sched = make("torch")
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    Checkpointer(tmp_path, model, opt, sched).save(1, {"epoch": 2, "index": 17})
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    resumed = Checkpointer(tmp_path, *make("torch")).resume()
    assert resumed.data_state == {"epoch": 2, "index": 17}
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


@pytest.mark.parametrize("config", ["torch", "int8_sib"])
def test_async_save_equals_sync_save(tmp_path, monkeypatch, config):
    """The background write holds the state of save() time: the writer is held back until two more training
    steps have changed every weight and moment in place (fp32 parameters and state share memory with what a state
    dict returns; a write without its own copy would save the later values)."""
    import threading

    import torch.distributed.checkpoint as dcp

    release, save = threading.Event(), dcp.save
    writer_threads = []

    def held_back(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            writer_threads.append(threading.current_thread().name)
            assert release.wait(60)
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", held_back)
    model, opt, sched = make(config)
    gen = torch.Generator().manual_seed(1)
    train(model, opt, sched, gen, 2)
    Checkpointer(tmp_path / "sync", model, opt, sched).save(2)
    ckpt = Checkpointer(tmp_path / "async", model, opt, sched, async_save=True)
    ckpt.save(2)
    train(model, opt, sched, gen, 2)  # training goes on while it is written: the copy taken at save() is written
    release.set()
    ckpt.close()
    assert writer_threads == ["ipex_train checkpoint step-2"]
    loaded = []
    for name in ("sync", "async"):
        m, o, s = make(config)
        assert Checkpointer(tmp_path / name, m, o, s).resume().step == 2
        loaded.append((m.state_dict(), raw_state(o), s.state_dict()))
    assert same(loaded[0][0], loaded[1][0]) and same(loaded[0][1], loaded[1][1]) and loaded[0][2] == loaded[1][2]
    assert not same(loaded[0][0], model.state_dict())  # the two later steps did change the weights


def test_plain_torch_loads_the_checkpoint(tmp_path):
    """dcp_to_torch_save + torch.load give the fp32 weights; a vanilla model and AdamW load them with
    torch.distributed.checkpoint's set_state_dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, sched = make("int8_sib")
    train(model, opt, sched, torch.Generator().manual_seed(1), 2)
    Checkpointer(tmp_path, model, opt, sched).save(2)
    dcp_to_torch_save(tmp_path / "step-2", tmp_path / "plain.pt")
    sd = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert sd["progress"] == {"step": 2, "world_size": 1}
    assert same(sd["model"], model.state_dict())
    vanilla = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Tanh(), nn.Linear(96, 64))
    vopt = torch.optim.AdamW(vanilla.parameters(), lr=1e-2, weight_decay=0.01)
    set_state_dict(vanilla, vopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert same(vanilla.state_dict(), model.state_dict())
    want = opt.state_dict()["state"]
    got = vopt.state_dict()["state"]
    assert all(torch.equal(got[i]["exp_avg_sq"], want[i]["exp_avg_sq"]) for i in want)


def test_mismatched_optimizer_is_refused_and_changes_nothing(tmp_path):
    model, opt, sched = make("bf16")
    train(model, opt, sched, torch.Generator().manual_seed(1), 1)
    Checkpointer(tmp_path, model, opt, sched).save(1)
    torch.manual_seed(3)
    other = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Tanh(), nn.Linear(96, 64))
    other_opt = torch.optim.AdamW(list(other.parameters())[:2], lr=1e-2)  # another parameter list
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="param group 0 of the checkpoint holds other parameters"):
        Checkpointer(tmp_path, other, other_opt).resume()
    assert same(other.state_dict(), before) and not other_opt.state


def test_bad_arguments(tmp_path):
    model, opt, sched = make("torch")
    with pytest.raises(TypeError, match="directory must be"):
        Checkpointer(3, model)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Checkpointer(tmp_path, opt)
    with pytest.raises(TypeError, match="optimizer must be"):
        Checkpointer(tmp_path, model, model)
    with pytest.raises(TypeError, match="scheduler must have"):
        Checkpointer(tmp_path, model, opt, 1.0)
    with pytest.raises(ValueError, match="every must be >= 1"):
        Checkpointer(tmp_path, model, every=0)
    with pytest.raises(TypeError, match="keep must be an int or None"):
        Checkpointer(tmp_path, model, keep=1.5)
    with pytest.raises(TypeError, match="async_save must be True or False"):
        Checkpointer(tmp_path, model, async_save=1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        Checkpointer(tmp_path, model).save(-1)
    Checkpointer(tmp_path, model).save(1)  # no optimizer in it
    with pytest.raises(ValueError, match="holds no optimizer state"):
        Checkpointer(tmp_path, model, opt).resume()
