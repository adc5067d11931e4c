"""kernels_xpu on a real SYCL device (here the SYCL CPU device: Intel's OpenCL CPU driver from intel-opencl-rt).

Every kernel x storage layout runs on the device and is compared with
  - the CPU kernels (torch.ops.ipex_train.*_step via fused.fused_step): bit-identical for the elementwise steps
    (SGD, Adam/AdamW, Adagrad; the SYCL kernels are built to round as kernels_cpu does), and within
    rtol = atol = 1e-6 for Lamb and Lars, whose norms are summed in another order (work-group sums vs 16 lanes);
  - the plain PyTorch reference (ipex_train/optim/_reference.py) on the fp32/fp64 working values:
    rtol = atol = 1e-6 (fp32) and 1e-12 (fp64), as the CPU kernel tests use.

Needs dpctl and intel-opencl-rt (the `xpu` extra; see kernels_xpu/sycl_env.sh); the first run also builds the host
glue (~25 s) and compiles the kernels at run time (~6 s).
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sycl_required import need_sycl_device

import ipex_train
import ipex_train.xpu as sx
from ipex_train.optim import _reference, fused, registry

need_sycl_device(module=True)

ops = torch.ops.ipex_train
LAYOUTS = ["f32", "f64", "split_bf16", "bf16_master", "f16_master"]
SHAPES = [(33, 31), (257,), (1,), (0,)]  # crosses work-group boundaries; 1 and 0 elements are edge cases
STEPS = 3

CONFIGS = {
    "sgd": [
        dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
        dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False, maximize=True),
        dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.001, nesterov=True, maximize=False),
    ],
    "adam": [
        dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
             decoupled_weight_decay=False),
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True, maximize=True,
             decoupled_weight_decay=True),
    ],
    "adagrad": [dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, eps=1e-10, maximize=False,
                     initial_accumulator_value=0.1)],
    "lamb": [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True),
             dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0, bias_correction=False)],
    "lars": [dict(lr=0.1, momentum=0.9, weight_decay=1e-4, eeta=1e-3, epsilon=1e-8)],
}
CASES = [(kind, i) for kind, cfgs in CONFIGS.items() for i in range(len(cfgs))]


@pytest.fixture(scope="module")
def queue():
    return sx.default_queue()


def _fp64_ok(queue) -> bool:
    return bool(queue.sycl_device.has_aspect_fp64)


class Param:
    """One parameter in a storage layout: the tensors handed to the kernels, and the working (fp32/fp64) value."""

    def __init__(self, layout: str, shape, gen: torch.Generator):
        self.layout = layout
        w = torch.randn(shape, generator=gen, dtype=torch.float64 if layout == "f64" else torch.float32)
        if layout in ("f32", "f64"):
            self.param, self.aux = w, None
        elif layout == "split_bf16":
            self.param, self.aux = ops.split_bf16(w)
        else:
            self.param = w.to(torch.bfloat16 if layout == "bf16_master" else torch.float16)
            self.aux = w
        self.grad_dtype = {"f32": torch.float32, "f64": torch.float64, "f16_master": torch.float16}.get(
            layout, torch.bfloat16)

    def to_usm(self, queue) -> Param:
        out = object.__new__(Param)
        out.layout, out.grad_dtype = self.layout, self.grad_dtype
        out.param = sx.to_usm(self.param, queue)
        out.aux = None if self.aux is None else sx.to_usm(self.aux, queue)
        return out

    def working(self) -> torch.Tensor:
        if self.layout == "split_bf16":
            return ops.combine_bf16(self.param, self.aux)
        return self.param if self.aux is None else self.aux


def _grads(params: list[Param], gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(p.param.shape, generator=gen, dtype=torch.float64).to(p.grad_dtype) for p in params]


def _reference_step(kind, cfg, ws, gs, ref_state, step):
    """One step of the plain reference on working values ``ws`` (updated in place)."""
    n = len(ws)
    steps = [torch.tensor(float(step))] * n
    zeros = lambda: [torch.zeros_like(w) for w in ws]  # noqa: E731
    if kind == "sgd":
        bufs = ref_state.setdefault("buf", [None] * n)
        _reference.sgd(ws, gs, bufs, lr=cfg["lr"], momentum=cfg["momentum"], dampening=cfg["dampening"],
                       weight_decay=cfg["weight_decay"], nesterov=cfg["nesterov"], maximize=cfg["maximize"])
    elif kind == "adam":
        m, v, vmax = (ref_state.setdefault(k, zeros()) for k in ("m", "v", "vmax"))
        _reference.adam(ws, gs, m, v, vmax, steps, lr=cfg["lr"], beta1=cfg["betas"][0], beta2=cfg["betas"][1],
                        weight_decay=cfg["weight_decay"], eps=cfg["eps"], amsgrad=cfg["amsgrad"],
                        maximize=cfg["maximize"], decoupled_weight_decay=cfg["decoupled_weight_decay"])
    elif kind == "adagrad":
        sums = ref_state.setdefault("sum", [torch.full_like(w, cfg["initial_accumulator_value"]) for w in ws])
        _reference.adagrad(ws, gs, sums, steps, lr=cfg["lr"], lr_decay=cfg["lr_decay"],
                           weight_decay=cfg["weight_decay"], eps=cfg["eps"], maximize=cfg["maximize"])
    elif kind == "lamb":
        m, v = (ref_state.setdefault(k, zeros()) for k in ("m", "v"))
        _reference.lamb(ws, gs, m, v, steps, lr=cfg["lr"], beta1=cfg["betas"][0], beta2=cfg["betas"][1],
                        weight_decay=cfg["weight_decay"], eps=cfg["eps"], bias_correction=cfg["bias_correction"])
    else:
        bufs = ref_state.setdefault("buf", zeros())
        _reference.lars(ws, gs, bufs, lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"],
                        eeta=cfg["eeta"], epsilon=cfg["epsilon"])


def _state_tensors(state, params):
    return [(k, t) for p in params for k, t in sorted(state[p].items()) if isinstance(t, torch.Tensor) and k != "step"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind,cfg_index", CASES)
def test_step_matches_cpu_kernels_and_reference(queue, kind, cfg_index, layout):
    if layout == "f64" and not _fp64_ok(queue):
        pytest.skip("the SYCL device has no fp64")
    cfg = CONFIGS[kind][cfg_index]
    gen = torch.Generator().manual_seed(1234 + cfg_index)
    cpu = [Param(layout, s, gen) for s in SHAPES]
    dev = [p.to_usm(queue) for p in cpu]
    ws = [p.working().clone() for p in cpu]
    group = dict(cfg)
    cpu_state, dev_state, ref_state = collections.defaultdict(dict), collections.defaultdict(dict), {}
    for step in range(1, STEPS + 1):
        gs = _grads(cpu, gen)
        fused.fused_step(registry.get(kind), group, cpu_state, [p.param for p in cpu], [p.aux for p in cpu], gs)
        sx.fused_step(kind, group, dev_state, [p.param for p in dev], [p.aux for p in dev],
                      [sx.to_usm(g, queue) for g in gs], queue)
        _reference_step(kind, cfg, ws, [g.to(ws[0].dtype) for g in gs], ref_state, step)

    exact = kind in ("sgd", "adam", "adagrad")
    tol = dict(rtol=1e-12, atol=1e-12) if layout == "f64" else dict(rtol=1e-6, atol=1e-6)
    for i, (c, d) in enumerate(zip(cpu, dev)):
        if exact:
            assert torch.equal(d.param, c.param), f"params[{i}] differs from the CPU kernel"
            if c.aux is not None:
                assert torch.equal(d.aux, c.aux), f"aux[{i}] differs from the CPU kernel"
        else:
            torch.testing.assert_close(d.working(), c.working(), **tol, msg=lambda m, i=i: f"params[{i}]: {m}")
            if layout in ("bf16_master", "f16_master"):  # the 16-bit param is the rounding of its own master
                assert torch.equal(d.param, d.aux.to(d.param.dtype))
        torch.testing.assert_close(d.working(), ws[i], **tol, msg=lambda m, i=i: f"params[{i}] vs reference: {m}")
    cpu_st = _state_tensors(cpu_state, [p.param for p in cpu])
    dev_st = _state_tensors(dev_state, [p.param for p in dev])
    assert [k for k, _ in dev_st] == [k for k, _ in cpu_st]
    for (key, c), (_, d) in zip(cpu_st, dev_st):
        if d.numel():
            assert sx.usm_kind(d, queue) == "shared", f"state {key} is not in USM"
        if exact:
            assert torch.equal(d, c), f"state {key} differs from the CPU kernel"
        else:
            torch.testing.assert_close(d, c, **tol)


def test_split_combine_match_cpu(queue):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5000, generator=gen)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-42, 3.4e38, -3.4e38,
                             1.0 + 2**-8, 1.0 + 3 * 2**-8])  # subnormals, overflow to Inf, exact ties
    x = torch.cat([x, specials, torch.randn(300, generator=gen) * 1e30])
    top, res = sx.split_bf16(sx.to_usm(x, queue), queue)
    ctop, cres = ops.split_bf16(x)
    assert torch.equal(top.view(torch.int16), ctop.view(torch.int16)) and torch.equal(res, cres)
    back = sx.combine_bf16(top, res, queue)
    assert torch.equal(back.view(torch.int32), ops.combine_bf16(ctop, cres).view(torch.int32))
    finite = ~torch.isnan(x)
    assert torch.equal(back[finite].view(torch.int32), x[finite].view(torch.int32))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("opt_cls,kind", [(torch.optim.AdamW, "adam"), (torch.optim.SGD, "sgd")])
def test_training_run_matches_cpu_path(queue, opt_cls, kind):
    torch.manual_seed(0)
    cpu_model = MLP()
    dev_model = MLP()
    dev_model.load_state_dict(cpu_model.state_dict())
    sx.module_to_usm(dev_model, queue)
    hp = dict(lr=1e-2, weight_decay=0.01) if kind == "adam" else dict(lr=0.1, momentum=0.9)
    cpu_opt, dev_opt = opt_cls(cpu_model.parameters(), **hp), opt_cls(dev_model.parameters(), **hp)
    if kind == "adam":  # AdamW's group has no decoupled_weight_decay key: its decay is always decoupled
        for opt in (cpu_opt, dev_opt):
            opt.param_groups[0]["decoupled_weight_decay"] = True
    sx.usm_grads(dev_model.parameters(), queue)
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(5):
        for model, opt, use_sycl in ((cpu_model, cpu_opt, False), (dev_model, dev_opt, True)):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            for group in opt.param_groups:
                ps = [p for p in group["params"] if p.grad is not None]
                args = (registry.get(kind), group, opt.state, ps, [None] * len(ps), [p.grad for p in ps])
                if use_sycl:
                    sx.fused_step(*args, queue)
                else:
                    fused.fused_step(*args)
            if use_sycl:
                losses.append(loss.item())
    assert all(sx.is_usm(p.grad, queue) for p in dev_model.parameters()), "autograd moved a grad out of USM"
    for (name, c), (_, d) in zip(cpu_model.named_parameters(), dev_model.named_parameters()):
        assert sx.usm_kind(d, queue) == "shared"
        torch.testing.assert_close(d, c, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert losses[-1] < losses[0]


def test_non_usm_memory_is_refused(queue):
    group = dict(CONFIGS["adam"][0])
    p, g = sx.to_usm(torch.randn(100), queue), sx.to_usm(torch.randn(100), queue)
    state = collections.defaultdict(dict)
    with pytest.raises(ValueError, match=r"params\[0\] is not in SYCL USM memory"):
        sx.fused_step("adam", group, state, [torch.randn(100)], [None], [g], queue)
    with pytest.raises(ValueError, match=r"grads\[1\] is not in SYCL USM memory"):
        sx.fused_step("adam", group, state, [p, sx.to_usm(torch.randn(3), queue)], [None, None],
                      [g, torch.randn(3)], queue)
    bf = sx.to_usm(torch.randn(100).bfloat16(), queue)
    with pytest.raises(ValueError, match=r"aux\[0\] is not in SYCL USM memory"):
        sx.fused_step("sgd", dict(CONFIGS["sgd"][0]), state, [bf], [torch.randn(100)],
                      [sx.to_usm(torch.randn(100).bfloat16(), queue)], queue)
    with pytest.raises(ValueError, match=r"src is not in SYCL USM memory"):
        sx.split_bf16(torch.randn(10), queue)
    assert not sx.is_usm(torch.randn(10), queue)


def test_argument_errors_name_the_argument(queue):
    state = collections.defaultdict(dict)
    group = dict(CONFIGS["sgd"][1])
    p = sx.to_usm(torch.randn(10), queue)
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype torch.bfloat16"):
        sx.fused_step("sgd", group, state, [p], [None], [sx.to_usm(torch.randn(10).bfloat16(), queue)], queue)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(5,\)"):
        sx.fused_step("sgd", group, state, [p], [None], [sx.to_usm(torch.randn(5), queue)], queue)
    with pytest.raises(ValueError, match=r"params\[0\] is not contiguous"):
        q2 = sx.to_usm(torch.randn(4, 4), queue)
        sx.fused_step("sgd", group, state, [q2.t()], [None], [sx.to_usm(torch.randn(4, 4), queue)], queue)
    with pytest.raises(ValueError, match="kind must be one of"):
        sx.fused_step("rmsprop", group, state, [p], [None], [p], queue)


def test_devices_and_usm_tensors(queue):
    devs = sx.devices()
    keys = {"name", "backend", "fp16", "fp64", "max_work_group_size", "usm_shared"}
    assert devs and all(keys <= set(d) for d in devs)
    assert any(d["usm_shared"] for d in devs)
    t = sx.usm_tensor((3, 0), torch.float32, queue)
    assert t.shape == (3, 0)
    u = sx.usm_tensor((5, 7), torch.bfloat16, queue)
    assert u.is_contiguous() and sx.usm_kind(u, queue) == "shared" and torch.count_nonzero(u.float()) == 0
    env = sx.sycl_env()
    with open(os.path.join(env["OCL_ICD_VENDORS"], "intel-cpu.icd")) as f:
        assert os.path.exists(f.read().strip())
    assert ipex_train.info()["sycl_available"] is True


def test_process_exits_cleanly_after_running_kernels():
    script = textwrap.dedent("""
        import collections, torch, ipex_train.xpu as sx
        from ipex_train.xpu import _runtime
        q = sx.default_queue()
        p, g = sx.to_usm(torch.randn(1000), q), sx.to_usm(torch.randn(1000), q)
        group = dict(lr=0.1, momentum=0.9, weight_decay=1e-4, eeta=1e-3, epsilon=1e-8)
        sx.fused_step("lars", group, collections.defaultdict(dict), [p], [None], [g], q)
        top, res = sx.split_bf16(p, q)
        print("kernels held at exit:", _runtime.runtime(q).kernel_count())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **sx.sycl_env()})
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "kernels held at exit: 3" in proc.stdout


@pytest.mark.skipif(not sx.torch_xpu_available(), reason="this torch build has no XPU device (torch.xpu.is_available() "
                                                         "is False): the torch-XPU path cannot run here")
def test_torch_xpu_tensors_match_cpu_kernels():
    cfg = dict(CONFIGS["adam"][1])
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    cp, xp = p.clone(), p.to("xpu")
    fused.fused_step(registry.get("adam"), cfg, collections.defaultdict(dict), [cp], [None], [g])
    sx.fused_step("adam", cfg, collections.defaultdict(dict), [xp], [None], [g.to("xpu")])
    torch.testing.assert_close(xp.cpu(), cp, rtol=1e-6, atol=1e-6)
