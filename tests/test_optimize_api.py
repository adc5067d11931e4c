"""optimize()'s contract: argument errors leave everything unchanged, inplace semantics, repeated optimize(),
channels-last switches, the inference path, deep-copy of models holding non-leaf tensors, and DDP."""
import copy
import io
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ipex_train
from ipex_train.precision import channels_last as _channels_last

BF16 = torch.bfloat16


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.1),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def batch(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)


def step(model, opt, seed=0):
    x, y = batch(seed)
    torch.manual_seed(seed)  # dropout masks
    opt.zero_grad()
    nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.step()


def snapshot(model, opt=None):
    """Everything optimize() might touch: parameter objects, dtypes, layouts, values, hooks, optimizer groups."""
    params = [(p, p.dtype, p.stride(), p.detach().clone(), p.requires_grad) for p in model.parameters()]
    hooks = [(len(m._forward_pre_hooks), len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks))
             for m in model.modules()]
    groups = None
    if opt is not None:
        groups = ([{k: (list(v) if k == "params" else v) for k, v in g.items()} for g in opt.param_groups],
                  type(opt), copy.deepcopy(opt.state_dict()))
    return params, hooks, groups, vars(model).get("_ipex_train_masters")


def assert_same(a, b):
    (pa, ha, ga, ma), (pb, hb, gb, mb) = a, b
    assert len(pa) == len(pb) and ha == hb and ma is mb
    for (p, dt, st, v, rg), (q, dt2, st2, v2, rg2) in zip(pa, pb):
        assert p is q and dt == dt2 and st == st2 and rg == rg2
        assert p.is_meta or torch.equal(v, v2)
    if ga is not None:
        assert ga[0] == gb[0] and ga[1] is gb[1]
        assert str(ga[2]) == str(gb[2])


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("case", ["train-no-opt", "eval-with-opt", "devices", "not-module", "not-optimizer",
                                  "foreign-param", "level", "dtype", "flag", "bf16_compute", "state_dtype",
                                  "state_dtype-unfused", "state_dtype-group"])
def test_errors_leave_model_and_optimizer_unchanged(case):
    model = make()
    opt = sgd(model)
    step(model, opt)
    args, kwargs, err, match = (model, opt), dict(dtype=BF16), ValueError, None
    if case == "train-no-opt":
        args, match = (model,), "pass the optimizer .* or call model.eval"
    elif case == "eval-with-opt":
        model.eval()
        match = "model.train"
    elif case == "devices":
        model.add_module("meta", nn.Linear(2, 2, device="meta"))
        match = "several devices"
    elif case == "not-module":
        args, err, match = (opt, opt), TypeError, "torch.nn.Module"
    elif case == "not-optimizer":
        args, err, match = (model, model), TypeError, "torch.optim.Optimizer"
    elif case == "foreign-param":
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
        match = "not parameters of the model"
    elif case == "level":
        kwargs, match = dict(level="O2"), "'O0' or 'O1'"
    elif case == "dtype":
        kwargs, match = dict(dtype=torch.float64), "torch.bfloat16 or torch.float16"
    elif case == "flag":
        kwargs, err, match = dict(auto_channels_last="yes"), TypeError, "auto_channels_last"
    elif case == "bf16_compute":
        kwargs, match = dict(dtype=BF16, bf16_compute="fast"), "fast"
    elif case == "state_dtype":  # inplace: a late failure would leave the model converted
        kwargs, match = dict(dtype=BF16, inplace=True, optimizer_state_dtype="int4"), "optimizer_state_dtype.*'int4'"
    elif case == "state_dtype-unfused":
        kwargs, match = dict(dtype=BF16, inplace=True, optimizer_state_dtype="int8", fuse_update_step=False), \
            "fused step"
    elif case == "state_dtype-group":
        opt.param_groups[0]["state_dtype"] = torch.float16
        kwargs, match = dict(dtype=BF16, inplace=True, optimizer_state_dtype="int8"), "param group 0 key 'state_dtype'"
    before = snapshot(model, opt)
    with pytest.raises(err, match=match):
        ipex_train.optimize(*args, **kwargs)
    assert_same(snapshot(model, opt), before)


def test_inplace_false_leaves_originals_alone():
    model = make()
    opt = sgd(model)
    step(model, opt)  # some state before optimize()
    before = snapshot(model, opt)
    new_model, new_opt = ipex_train.optimize(model, opt, dtype=BF16)
    assert_same(snapshot(model, opt), before)
    assert new_model is not model and new_opt is not opt
    assert isinstance(new_opt, torch.optim.SGD)
    new_params = set(new_model.parameters())
    assert all(p in new_params for g in new_opt.param_groups for p in g["params"])
    assert new_opt.state[new_model[5].weight]["momentum_buffer"].dtype == torch.float32
    assert new_model[0].weight.is_contiguous(memory_format=torch.channels_last)
    step(new_model, new_opt, seed=1)
    assert_same(snapshot(model, opt), before)


def test_inplace_true_keeps_objects_and_hooks(bf16_activations):
    model = make()
    opt = sgd(model)
    weight = model[5].weight
    calls = []
    model[5].register_forward_hook(lambda m, i, o: calls.append(o.dtype))
    new_model, new_opt = ipex_train.optimize(model, opt, dtype=BF16, inplace=True)
    assert new_model is model and model[5].weight is weight and weight.dtype == BF16
    assert new_opt.param_groups is opt.param_groups and new_opt.state is opt.state
    step(new_model, new_opt)
    assert calls == [bf16_activations]
    assert new_opt.state[weight]["momentum_buffer"].dtype == torch.float32


@pytest.mark.parametrize("inplace", [True, False])
def test_optimize_twice_is_safe(inplace):
    def dtype_hooks(m):
        return len(m._forward_pre_hooks) + len(m._forward_hooks)

    model = make()
    model, opt = ipex_train.optimize(model, sgd(model), dtype=BF16, inplace=True)
    step(model, opt)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2 = ipex_train.optimize(model, opt, dtype=BF16, inplace=inplace)
    assert (model2 is model) == inplace and (opt2 is opt) == inplace
    assert all(torch.equal(v, values[k]) for k, v in model2.state_dict().items())
    assert model2[5].weight.dtype == BF16 and dtype_hooks(model2[5]) == 1
    step(model2, opt2, seed=1)
    # A new optimizer on an already optimized model (e.g. a restarted schedule).
    model3, opt3 = ipex_train.optimize(model2, torch.optim.Adam(model2.parameters(), lr=1e-3), inplace=True)
    assert model3 is model2
    step(model3, opt3, seed=2)
    assert opt3.state[model3[5].weight]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="already optimized with dtype=torch.bfloat16"):
        ipex_train.optimize(model3, opt3, dtype=torch.float16)


def test_channels_last_switches(monkeypatch):
    monkeypatch.setattr(_channels_last, "_enabled", None)

    def conv_is_cl(**kw):
        model = make()
        model, _ = ipex_train.optimize(model, sgd(model), **kw)
        return model[0].weight.is_contiguous(memory_format=torch.channels_last)

    assert conv_is_cl() and conv_is_cl(dtype=BF16)
    assert not conv_is_cl(level="O0") and not conv_is_cl(auto_channels_last=False)
    ipex_train.disable_auto_channels_last()
    assert not conv_is_cl() and conv_is_cl(auto_channels_last=True)
    ipex_train.enable_auto_channels_last()
    assert conv_is_cl(level="O0")


def test_inference_path():
    model = make().eval()
    before = snapshot(model)
    out = ipex_train.optimize(model, dtype=BF16)
    assert isinstance(out, nn.Module) and out is not model
    assert_same(snapshot(model), before)
    assert out[5].weight.dtype == BF16 and not any(isinstance(m, nn.Dropout) for m in out.modules())
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(out(x).float(), model(x), atol=5e-2, rtol=5e-2)


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = None

    def forward(self, x):
        self.cache = self.lin(x) * 2  # a non-leaf tensor left on the module
        return self.cache


def test_deepcopy_of_model_holding_non_leaf_tensors():
    model = Cached()
    model(torch.randn(2, 4))
    new_model, opt = ipex_train.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
    new_model(torch.randn(2, 4)).float().sum().backward()
    opt.step()
    assert model.lin.weight.dtype == torch.float32


def test_optimizer_is_a_real_optimizer():
    model = make()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dtype=BF16)
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "AdamW"
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(o))
    step(model, opt)
    assert seen == [opt]
    clone = copy.deepcopy((model, opt))[1]
    assert clone._ipex_masters is not opt._ipex_masters
    assert all(p in clone._ipex_masters.aux or p.dtype == torch.float32
               for g in clone.param_groups for p in g["params"])


# ---------------------------------------------------------------------------------------------- DDP

def make_mlp():
    # No BatchNorm: its batch statistics would differ between a half batch per rank and the global batch.
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 5))


def _ddp_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_mlp()
        model, opt = ipex_train.optimize(model, sgd(model), dtype=BF16)
        ddp = nn.parallel.DistributedDataParallel(model)
        for i in range(3):
            x, y = batch(seed=i, n=8)
            x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x).float(), y).backward()
            opt.step()
        results[rank] = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(2, port, results), nprocs=2, join=True)
    r0, r1 = results[0], results[1]
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    single = make_mlp()
    single, opt = ipex_train.optimize(single, sgd(single), dtype=BF16)
    for i in range(3):
        x, y = batch(seed=i, n=8)
        opt.zero_grad()
        # DDP averages the two half-batch mean losses: the same as the mean over the global batch.
        nn.functional.cross_entropy(single(x).float(), y).backward()
        opt.step()
    initial = make_mlp().state_dict()
    for k, v in single.state_dict().items():
        assert not torch.equal(v, initial[k]), k
        torch.testing.assert_close(r0[k], v, atol=1e-2, rtol=1e-2)


def test_pickle_model_and_optimizer():
    model = make()
    model, opt = ipex_train.optimize(model, sgd(model), dtype=BF16, bf16_compute="native")
    step(model, opt)
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    model2, opt2 = torch.load(buf, weights_only=False)
    assert isinstance(opt2, torch.optim.SGD) and opt2._ipex_masters is model2._ipex_train_masters
    assert opt2.param_groups[0]["params"][0] is model2[0].weight
    step(model, opt, seed=1)
    step(model2, opt2, seed=1)
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(v, v2), k
