"""The optimizer registry, the typed functional API, OptimizeConfig and the option helper."""
from __future__ import annotations

import collections
import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

import ipex_train
from ipex_train import OptimizeConfig
from ipex_train.base import ops as _ops
from ipex_train.optim import Lamb, Lars, fused, registry
from ipex_train.optim import functional as F

ops = torch.ops.ipex_train


def test_registry_matches_the_kernels():
    assert set(registry.NAMES) == set(_ops.optimizer_names())
    for entry in registry.OPTIMIZERS:
        assert hasattr(ops, f"{entry.name}_step")
        assert registry.for_class(entry.optimizer_class) is entry
    assert registry.for_class(torch.optim.AdamW).name == "adam"
    assert registry.for_class(torch.optim.RMSprop) is None

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert registry.for_class(OwnStep) is None
    with pytest.raises(ValueError, match="kind must be one of"):
        registry.get("rmsprop")


def test_supported_variants_leave_the_variant_in_use_alone():
    # The old probe switched the process-wide kernel table; a step on another thread could run another variant.
    before = _ops.kernel_variant()
    seen = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.add(_ops.kernel_variant())

    t = threading.Thread(target=watch)
    t.start()
    try:
        for _ in range(2000):
            assert _ops.supported_kernel_variants()[-1] == "scalar"
    finally:
        stop.set()
        t.join()
    assert seen == {before} and _ops.kernel_variant() == before


def _pair(seed=0, shapes=((5, 3), (17,))):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return params, grads


CLASSES = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    "adam": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=1e-2, weight_decay=1e-3)),
    "lamb": (Lamb, dict(lr=1e-2, weight_decay=1e-2)),
    "lars": (Lars, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
}


def _functional_step(name, group, state, params, grads):
    """One step through ipex_train.optim.functional, state kept in ``state`` as torch.optim keeps it."""
    st = [state[p] for p in params]
    zeros = lambda key: [s.setdefault(key, torch.zeros_like(p)) for s, p in zip(st, params)]  # noqa: E731
    steps = lambda: [s.setdefault("step", torch.tensor(0.0)) for s in st]  # noqa: E731
    if name == "sgd":
        bufs = [s.get("momentum_buffer") for s in st]
        F.sgd(params, grads, bufs, lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
              weight_decay=group["weight_decay"], nesterov=group["nesterov"], maximize=group["maximize"])
        for s, b in zip(st, bufs):
            s["momentum_buffer"] = b
    elif name == "adam":
        F.adam(params, grads, zeros("exp_avg"), zeros("exp_avg_sq"), zeros("max_exp_avg_sq"), steps(), lr=group["lr"],
               beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"], eps=group["eps"],
               amsgrad=group["amsgrad"], maximize=group["maximize"],
               decoupled_weight_decay=group["decoupled_weight_decay"])
    elif name == "adagrad":
        F.adagrad(params, grads, zeros("sum"), steps(), lr=group["lr"], lr_decay=group["lr_decay"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
    elif name == "lamb":
        F.lamb(params, grads, zeros("exp_avg"), zeros("exp_avg_sq"), steps(), lr=group["lr"], beta1=group["betas"][0],
               beta2=group["betas"][1], weight_decay=group["weight_decay"], eps=group["eps"],
               bias_correction=group["bias_correction"])
    else:
        F.lars(params, grads, zeros("momentum_buffer"), lr=group["lr"], momentum=group["momentum"],
               weight_decay=group["weight_decay"], eeta=group["eeta"], epsilon=group["epsilon"])


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_functional_matches_the_fused_step_bit_for_bit(name):
    cls, hp = CLASSES[name]
    params, grads = _pair()
    ours = [p.clone() for p in params]
    group = cls([torch.zeros(1)], **hp).param_groups[0]
    state_f, state_k = collections.defaultdict(dict), collections.defaultdict(dict)
    for _ in range(3):
        _functional_step(name, group, state_f, ours, grads)
        fused.fused_step(registry.get(name), group, state_k, params, [None] * len(params), grads)
    for a, b in zip(ours, params):
        assert torch.equal(a, b)
        for key, value in state_k[b].items():
            assert torch.equal(state_f[a][key], value), key


def test_functional_takes_split_bf16_storage():
    params, grads = _pair(1)
    w = [p.clone() for p in params]
    tops, res = zip(*(_ops.split_bf16(p) for p in params))
    tops, res = list(tops), list(res)
    g16 = [g.bfloat16() for g in grads]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    F.adam(tops, g16, m, v, [], [torch.tensor(0.0) for _ in params], aux=res, lr=1e-2, beta1=0.9, beta2=0.99,
           weight_decay=0.0, eps=1e-8)
    state = collections.defaultdict(dict)
    ref_top, ref_res = zip(*(_ops.split_bf16(p) for p in w))
    group = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8)
    fused.fused_step(registry.get("adam"), group, state, list(ref_top), list(ref_res), g16)
    for a, b, ra, rb in zip(tops, ref_top, res, ref_res):
        assert torch.equal(a, b) and torch.equal(ra, rb)


def test_functional_errors_name_the_argument():
    params, grads = _pair()
    with pytest.raises(ValueError, match=r"got 2 params but 1 exp_avg_sqs"):
        F.adam(params, grads, [torch.zeros_like(p) for p in params], [torch.zeros(1)][:1], [],
               [torch.tensor(0.0)] * 2, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8)
    with pytest.raises(ValueError, match=r"got 2 params but 1 momentum_buffers"):
        F.sgd(params, grads, [None], lr=0.1, momentum=0.9)


# --------------------------------------------------------------------------- OptimizeConfig and options


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def test_config_is_the_same_as_the_keywords():
    m1, m2 = _model(), _model()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    cfg = OptimizeConfig(dtype=torch.bfloat16, split_master_weight_for_bf16=False)
    m1, o1 = ipex_train.optimize(m1, o1, dtype=torch.bfloat16, split_master_weight_for_bf16=False)
    m2, o2 = ipex_train.optimize(m2, o2, config=cfg)
    x = torch.randn(4, 6)
    for m, o in ((m1, o1), (m2, o2)):
        m(x).float().sum().backward()
        o.step()
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert o2._ipex_masters.aux[m2[0].weight].dtype == torch.float32  # master copy, as configured


def test_config_and_conflicting_keyword_is_refused():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ValueError, match=r"level='O0' conflicts with config.level='O1'"):
        ipex_train.optimize(m, opt, level="O0", config=OptimizeConfig())
    with pytest.raises(TypeError, match="config must be an ipex_train.OptimizeConfig"):
        ipex_train.optimize(m, opt, config={"level": "O1"})
    ipex_train.optimize(m, opt, level="O1", dtype=torch.bfloat16, config=OptimizeConfig(dtype=torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(before.values(), m.state_dict().values()))


def test_config_from_env_and_to_dict(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_DTYPE", "bf16")
    monkeypatch.setenv("IPEX_TRAIN_LEVEL", "o0")
    monkeypatch.setenv("IPEX_TRAIN_FUSE_UPDATE_STEP", "off")
    monkeypatch.setenv("IPEX_TRAIN_BF16_COMPUTE", "Emulated")
    cfg = OptimizeConfig.from_env(level="O1")
    assert cfg == OptimizeConfig(dtype=torch.bfloat16, level="O1", fuse_update_step=False, bf16_compute="emulated")
    d = cfg.to_dict()
    assert d["dtype"] == "bfloat16" and d["fuse_update_step"] is False
    assert OptimizeConfig.from_env({}, **d) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.level = "O0"
    monkeypatch.setenv("IPEX_TRAIN_SPLIT_MASTER_WEIGHT_FOR_BF16", "sometimes")
    with pytest.raises(ValueError, match="IPEX_TRAIN_SPLIT_MASTER_WEIGHT_FOR_BF16='sometimes'"):
        OptimizeConfig.from_env()
    with pytest.raises(TypeError, match="unknown option"):
        OptimizeConfig.from_env(levle="O1")


@pytest.mark.parametrize("make", [
    lambda: Lamb([torch.zeros(1)], fused="x"),
    lambda: Lars([torch.zeros(1)], fused=1),
    lambda: ipex_train.optimize(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), fuse_update_step="yes"),
    lambda: OptimizeConfig(sycl="1"),
])
def test_a_non_bool_switch_is_a_type_error_everywhere(make):
    with pytest.raises(TypeError, match=r"must be (True, False or None|None, True or False)"):
        make()


def test_bad_environment_switch_is_a_value_error(monkeypatch):
    from ipex_train import xpu

    monkeypatch.setenv("IPEX_TRAIN_SYCL", "sometimes")
    with pytest.raises(ValueError, match="IPEX_TRAIN_SYCL='sometimes'"):
        xpu.enabled()


def test_norm_scaled_entries_have_a_shard_rule():
    # The registry entry says whether an update needs whole-tensor norms; the FSDP2 step reads that flag alone.
    from ipex_train.optim import sharded

    flagged = {e.name for e in registry.OPTIMIZERS if e.whole_tensor_norms}
    assert flagged == {"lamb", "lars"}
    assert flagged == set(sharded._NORM_RULES)
    assert sharded.needs_norms(Lamb.FUSED) and not sharded.needs_norms(registry.for_class(torch.optim.AdamW))
