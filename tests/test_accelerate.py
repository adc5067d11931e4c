"""The HuggingFace Accelerate plugin (ipex_train.integrations.accelerate) and recipes/accelerate_train.py.

The fresh-process resume and the 2-process (gloo, 127.0.0.1) run execute this file as a worker script:
``python tests/test_accelerate.py resume|ddp ...`` (see ``_worker_main`` at the bottom).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if not os.environ.get("CI"):
    # A developer without the test extra gets a skip; CI installs it, so there the import below must fail loudly.
    pytest.importorskip("accelerate", reason="install the test extra: pip install -e '.[test]'")

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType
from spawn_ranks import free_port

from ipex_train.integrations.accelerate import ENV_VARS, IpexTrainPlugin

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 240


def new_accelerator(**kwargs) -> Accelerator:
    """A CPU Accelerator with exactly ``kwargs``: Accelerate's state is a process-wide singleton that refuses a
    second mixed_precision, so it is reset first (what Accelerate's own test cases do)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """No IPEX_TRAIN_* option from the caller's environment; Accelerate's singletons reset afterwards."""
    for name in ENV_VARS.values():
        monkeypatch.delenv(name, raising=False)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def make_model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """Linear + LayerNorm (stays fp32) + Linear: both parameter kinds ipex_train handles."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 4))


def make_data(n: int = 64, seed: int = 1) -> torch.utils.data.TensorDataset:
    """A fixed random classification set."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def fp32_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's state_dict (fp32 for an optimized model)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def exported(accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of accelerator.get_state_dict(model): its fp32 parameters alias the live ones."""
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Same keys, same dtypes, same bits (NaN-safe)."""
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(_bits(a[key]), _bits(b[key])), key


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def optimizer_state(optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state tensors as ``"index/key"`` -> tensor (from state_dict())."""
    return {f"{i}/{k}": v.clone() for i, entry in optimizer.state_dict()["state"].items()
            for k, v in entry.items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------- options


def test_options_argument_over_environment_over_default(monkeypatch):
    assert IpexTrainPlugin() == IpexTrainPlugin(None, None, None, None, None)
    for name, value in [("dtype", "bf16"), ("level", "o0"), ("split_master_weight_for_bf16", "0"),
                        ("fuse_update_step", "false"), ("bf16_compute", "Emulated")]:
        monkeypatch.setenv(ENV_VARS[name], value)
    from_env = IpexTrainPlugin()
    assert (from_env.dtype, from_env.level, from_env.split_master_weight_for_bf16, from_env.fuse_update_step,
            from_env.bf16_compute) == (torch.bfloat16, "O0", False, False, "emulated")
    explicit = IpexTrainPlugin(dtype="fp32", level="O1", split_master_weight_for_bf16=True, fuse_update_step=True,
                               bf16_compute="native")
    assert (explicit.dtype, explicit.level, explicit.split_master_weight_for_bf16, explicit.fuse_update_step,
            explicit.bf16_compute) == (torch.float32, "O1", True, True, "native")


def test_environment_options_reach_optimize(monkeypatch):
    monkeypatch.setenv(ENV_VARS["split_master_weight_for_bf16"], "no")
    monkeypatch.setenv(ENV_VARS["fuse_update_step"], "off")
    accelerator = new_accelerator(mixed_precision="bf16")
    model = make_model()
    model, optimizer = IpexTrainPlugin().prepare(accelerator, model, torch.optim.AdamW(model.parameters()))
    inner = optimizer.optimizer
    masters = inner._ipex_masters
    weight = model[0].weight
    assert weight.dtype == torch.bfloat16
    assert masters.aux[weight].dtype == torch.float32  # an fp32 master copy, not a split int16 residual
    assert inner._ipex_fuse is False


@pytest.mark.parametrize("option, value", [
    ("dtype", torch.int8), ("dtype", "half-ish"), ("level", "O2"), ("split_master_weight_for_bf16", "maybe"),
    ("fuse_update_step", 1), ("bf16_compute", "fast")])
def test_bad_option_is_named(option, value):
    with pytest.raises(ValueError, match=option):
        IpexTrainPlugin(**{option: value})


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VARS["fuse_update_step"], "sometimes")
    with pytest.raises(ValueError, match=ENV_VARS["fuse_update_step"]):
        IpexTrainPlugin()


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_dtype_follows_mixed_precision(precision, dtype):
    accelerator = new_accelerator(mixed_precision=precision)
    plugin = IpexTrainPlugin()
    assert plugin.resolve_dtype(accelerator) == dtype
    model = make_model()
    model, _ = plugin.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[0].weight.dtype == dtype and model[1].weight.dtype == torch.float32


# --------------------------------------------------------------------------- errors


def test_bf16_dtype_needs_bf16_mixed_precision():
    accelerator = new_accelerator(mixed_precision="no")
    model = make_model()
    with pytest.raises(ValueError, match="dtype=torch.bfloat16 needs Accelerator\\(mixed_precision='bf16'\\)"):
        IpexTrainPlugin(dtype=torch.bfloat16).prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))
    assert model[0].weight.dtype == torch.float32  # nothing was modified


def test_fp16_is_refused_on_cpu():
    model = make_model()
    accelerator = new_accelerator(mixed_precision="no")
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        IpexTrainPlugin(dtype="fp16").prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))
    accelerator = new_accelerator(mixed_precision="fp16")
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        IpexTrainPlugin().prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                                  DistributedType.XLA])
def test_sharding_backends_are_refused(monkeypatch, kind):
    accelerator = new_accelerator(mixed_precision="bf16")
    # Building a real DeepSpeed/FSDP accelerator needs those backends; the plugin reads only this attribute.
    monkeypatch.setattr(accelerator.state, "distributed_type", kind)
    model = make_model()
    with pytest.raises(ValueError, match=f"distributed_type is {kind}"):
        IpexTrainPlugin().prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))


def test_step_in_backward_with_ddp_or_accumulation_is_refused(monkeypatch):
    monkeypatch.setenv("IPEX_TRAIN_STEP_IN_BACKWARD", "1")
    model = make_model()
    accelerator = new_accelerator(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        IpexTrainPlugin().prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))
    accelerator = new_accelerator()
    # A real 2-process accelerator needs a launch; the plugin reads only this attribute before anything changes.
    monkeypatch.setattr(accelerator.state, "num_processes", 2)
    with pytest.raises(ValueError, match="before DistributedDataParallel's all-reduce.*2 processes"):
        IpexTrainPlugin().prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))
    assert model[0].weight.dtype == torch.float32
    monkeypatch.setattr(accelerator.state, "num_processes", 1)
    model, opt = IpexTrainPlugin().prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))
    assert opt.optimizer.step_in_backward


def test_non_cpu_device_is_refused(monkeypatch):
    accelerator = new_accelerator(mixed_precision="bf16")
    # An XPU/GPU accelerator needs the device; optimize() trains on the CPU, which the plugin checks up front.
    monkeypatch.setattr(accelerator.state, "device", torch.device("xpu"))
    model = make_model()
    with pytest.raises(ValueError, match="accelerator.device is xpu.*Accelerator\\(cpu=True\\)"):
        IpexTrainPlugin().prepare(accelerator, model, torch.optim.SGD(model.parameters(), 0.1))


def test_prepared_or_wrong_objects_are_refused():
    accelerator = new_accelerator(mixed_precision="bf16")
    plugin = IpexTrainPlugin()
    model, other = make_model(), make_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        plugin.prepare(None, model, opt)
    with pytest.raises(TypeError, match="AcceleratedOptimizer"):
        plugin.prepare(accelerator, model, AcceleratedOptimizer(opt))
    with pytest.raises(ValueError, match="exactly one torch.nn.Module.*2 model\\(s\\) at positions \\[0, 2\\]"):
        plugin.prepare(accelerator, model, opt, other)
    with pytest.raises(ValueError, match="exactly one .*2 optimizer\\(s\\)"):
        plugin.prepare(accelerator, model, opt, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="0 optimizer\\(s\\)"):
        plugin.prepare(accelerator, model)
    foreign = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(other.parameters(), lr=0.1), 1)
    with pytest.raises(ValueError, match="scheduler at position 2 drives another optimizer"):
        plugin.prepare(accelerator, model, opt, foreign)
    assert model[0].weight.dtype == torch.float32
    # DDP-wrapped models are refused in the 2-process test, where a real DistributedDataParallel exists.


# --------------------------------------------------------------------------- prepare-time state round trip


def test_prepare_state_dict_round_trip_is_lossless(monkeypatch):
    """AcceleratedOptimizer runs state_dict() -> load_state_dict() at prepare time, and torch casts floating state
    to the parameter dtype there (bf16 here): the fp32 Adam moments must come through bit for bit."""
    from ipex_train.training.optimizer import TrainingOptimizer

    accelerator = new_accelerator(mixed_precision="bf16")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_data()[:16]
    for _ in range(3):  # real, non-trivial fp32 state before prepare
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    state_before, weights_before = optimizer_state(optimizer), fp32_weights(model)

    loaded = []
    original = TrainingOptimizer.load_state_dict
    monkeypatch.setattr(TrainingOptimizer, "load_state_dict",
                        lambda self, sd: (loaded.append(sd), original(self, sd))[1])
    model, optimizer = IpexTrainPlugin().prepare(accelerator, model, optimizer)

    assert len(loaded) == 1  # the round trip under test did happen
    assert model[0].weight.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in optimizer_state(optimizer).values())
    assert_bitwise_equal(optimizer_state(optimizer), state_before)
    assert_bitwise_equal(fp32_weights(model), weights_before)


# --------------------------------------------------------------------------- the training loop


def _accelerate_loop(accelerator, model, optimizer, loader, scheduler, max_norm, trace):
    """Accelerate's documented loop; records, per micro-step, sync flag, fp32 weights, grads present, lr, norm."""
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), max_norm) if accelerator.sync_gradients else None
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        trace.append({"sync": accelerator.sync_gradients, "weights": fp32_weights(accelerator.unwrap_model(model)),
                      "has_grad": model[0].weight.grad is not None, "lr": optimizer.param_groups[0]["lr"],
                      "norm": None if norm is None else float(norm)})


def _reference_loop(model, optimizer, loader, scheduler, max_norm, accumulation):
    """The same training in plain fp32 PyTorch: loss / accumulation, clip, step, schedule."""
    lrs, norms = [], []
    for i, (x, y) in enumerate(loader):
        (F.cross_entropy(model(x), y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs, norms


@pytest.mark.parametrize("precision, atol", [("bf16", 2e-3), ("no", 1e-5)])
def test_training_loop_matches_fp32_pytorch(precision, atol):
    """accumulate (2 micro-batches), clip_grad_norm_, zero_grad through the wrapper and a scheduler created on the
    user's optimizer before prepare, against the same loop in plain fp32 PyTorch."""
    max_norm, lr = 0.5, 1e-2
    loader = torch.utils.data.DataLoader(make_data(), batch_size=8)

    ref_model = make_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=lr)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1 / (1 + s))
    ref_lrs, ref_norms = _reference_loop(ref_model, ref_opt, loader, ref_sched, max_norm, 2)

    accelerator = new_accelerator(mixed_precision=precision, gradient_accumulation_steps=2)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    start = fp32_weights(model)
    model, optimizer, prepared_loader, scheduler = IpexTrainPlugin().prepare(
        accelerator, model, optimizer, loader, scheduler)
    trace = []
    with warnings.catch_warnings():
        # e.g. torch's "lr_scheduler.step() before optimizer.step()" when the scheduler's optimizer looks unstepped
        warnings.simplefilter("error")
        _accelerate_loop(accelerator, model, optimizer, prepared_loader, scheduler, max_norm, trace)

    assert [t["sync"] for t in trace] == [False, True] * 4
    previous = start
    for t in trace:
        if t["sync"]:
            assert not t["has_grad"]  # zero_grad(set_to_none) ran through AcceleratedOptimizer
            assert any(not torch.equal(t["weights"][k], previous[k]) for k in previous)
        else:
            assert t["has_grad"]  # accumulating: neither step nor zero_grad ran
            assert_bitwise_equal(t["weights"], previous)
        previous = t["weights"]
    assert [t["lr"] for t in trace] == pytest.approx(ref_lrs, rel=1e-12)
    norms = [t["norm"] for t in trace if t["sync"]]
    assert all(n > max_norm for n in ref_norms)  # clipping was active
    assert norms == pytest.approx(ref_norms, rel=2e-2 if precision == "bf16" else 1e-5)
    final = trace[-1]["weights"]
    for key, value in ref_model.state_dict().items():
        torch.testing.assert_close(final[key], value, atol=atol, rtol=0, msg=key)


def test_unwrap_model_and_fp32_export():
    accelerator = new_accelerator(mixed_precision="bf16")
    model = make_model()
    given = model
    model, optimizer = IpexTrainPlugin().prepare(accelerator, model, torch.optim.AdamW(model.parameters(), 1e-2))
    x, y = make_data()[:16]
    for _ in range(3):
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    unwrapped = accelerator.unwrap_model(model)
    assert unwrapped is given  # inplace: the user's module, converted
    export = accelerator.get_state_dict(model)
    assert all(v.dtype == torch.float32 for v in export.values())
    assert_bitwise_equal(export, fp32_weights(unwrapped))
    # The export carries the exact fp32 values, not the bf16 tops the forward uses.
    assert not torch.equal(export["0.weight"], unwrapped[0].weight.float())
    masters = optimizer.optimizer._ipex_masters
    assert torch.equal(export["0.weight"], masters.fp32(unwrapped[0].weight))

    plain = make_model(seed=5)
    plain.load_state_dict(export)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=2e-2, rtol=2e-2)


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of the operands of every matmul-class aten op."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
           torch.ops.aten.convolution_backward.default}

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_autocast_runs_matmuls_in_fp32_with_emulated_policy(dtype):
    """Accelerate's bf16 autocast alone runs bf16 matmuls (very slow without bf16 units); with the plugin's
    compute policy they run in fp32, for bf16 weights and for fp32 weights under autocast alike."""
    accelerator = new_accelerator(mixed_precision="bf16")
    x, y = make_data()[:8]

    bare = make_model()
    bare, bare_opt = accelerator.prepare(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    with _MatmulDtypes() as seen:
        accelerator.backward(F.cross_entropy(bare(x), y))
    assert seen.dtypes == {torch.bfloat16}  # the detector sees Accelerate's bf16 matmuls

    model = make_model()
    model, optimizer = IpexTrainPlugin(dtype=dtype, bf16_compute="emulated").prepare(
        accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with _MatmulDtypes() as seen:
        out = model(x)
        accelerator.backward(F.cross_entropy(out, y))
    assert out.dtype == torch.float32  # Accelerate's convert_outputs_to_fp32
    assert seen.dtypes == {torch.float32}
    optimizer.step()


# --------------------------------------------------------------------------- separate processes


def _worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "IPEX_TRAIN_"))}
    # One thread per process: 2-core machines, and bitwise comparisons across processes need the same reduction
    # order in every run.
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _run_workers(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in zip(commands, envs)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=SUBPROCESS_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, f"worker {p.args} failed:\n{out[-4000:]}"


def test_save_state_load_state_resumes_exactly_in_a_fresh_process(tmp_path):
    """Train 3 epochs saving after the first; a fresh process loads that checkpoint and trains epochs 2-3: same
    losses, same fp32 weights and optimizer state, bit for bit (dropout and shuffling included)."""
    worker = [sys.executable, __file__, "resume"]
    _run_workers([worker + ["full", str(tmp_path / "ckpt"), str(tmp_path / "full.pt")]], [_worker_env()])
    _run_workers([worker + ["resumed", str(tmp_path / "ckpt"), str(tmp_path / "resumed.pt")]], [_worker_env()])
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert len(full["losses"]) == 16 and full["losses"] == resumed["losses"]
    assert full["lr"] == resumed["lr"] and full["lr"] != full["lr_at_save"]
    assert all(v.dtype == torch.float32 for v in full["weights"].values())
    assert_bitwise_equal(full["weights"], resumed["weights"])
    assert_bitwise_equal(full["optimizer"], resumed["optimizer"])
    assert any(not torch.equal(full["weights"][k], full["weights_at_save"][k]) for k in full["weights"])


def test_two_process_ddp_training(tmp_path):
    """2 CPU processes (gloo over 127.0.0.1), seeded differently: prepare gives both rank 0's exact fp32 weights,
    training with accumulate + clip keeps them identical, and re-preparing the DDP model is refused."""
    port = str(free_port())
    commands, envs = [], []
    for rank in range(2):
        commands.append([sys.executable, __file__, "ddp", str(tmp_path / f"rank{rank}.pt")])
        envs.append(_worker_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo"))
    _run_workers(commands, envs)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["num_processes"] == r1["num_processes"] == 2
    assert r0["batches"] == r1["batches"] == 4  # each rank got half of the 8 batches
    assert not torch.equal(r0["init"]["0.weight"], r1["init"]["0.weight"])  # the seeds did differ
    assert_bitwise_equal(r0["prepared"], r0["init"])
    assert_bitwise_equal(r1["prepared"], r0["init"])
    assert_bitwise_equal(r0["final"], r1["final"])
    assert r0["losses"][-1] < r0["losses"][0]
    for r in (r0, r1):
        assert "DistributedDataParallel (already prepared)" in r["reprepare_error"]


def test_recipe_under_accelerate_launch_two_processes(tmp_path):
    """The recipe as documented (accelerate launch, 2 CPU processes); an IPEX_TRAIN_* option in the launcher's
    environment reaches the workers."""
    out = tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(ROOT / "recipes" / "accelerate_train.py"),
           "--steps", "8", "--batch-size", "32", "--json", str(out), "--output-dir", str(tmp_path / "run"),
           "--no-progress"]
    env = _worker_env(GLOO_SOCKET_IFNAME="lo", **{ENV_VARS["split_master_weight_for_bf16"]: "0"})
    _run_workers([cmd], [env])
    metrics = json.loads(out.read_text())
    assert metrics["num_processes"] == 2 and metrics["mixed_precision"] == "bf16"
    assert metrics["dtype"] == "torch.bfloat16" and metrics["plugin"]["split_master_weight_for_bf16"] == "False"
    assert len(metrics["losses"]) == 8 and metrics["final_loss"] < metrics["first_loss"]
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "run" / "model" / "model.safetensors")
    assert exported and all(v.dtype == torch.float32 for v in exported.values())
    assert (tmp_path / "run" / "checkpoint" / "optimizer.bin").exists()


# --------------------------------------------------------------------------- workers (run as a script)


def _resume_worker(mode: str, ckpt: str, out: str) -> None:
    """``full``: 3 epochs, save_state after the first. ``resumed``: load_state, then epochs 2-3."""
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    set_seed(0)
    model = make_model(dropout=0.2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    loader = torch.utils.data.DataLoader(make_data(), batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = IpexTrainPlugin().prepare(accelerator, model, optimizer, loader, scheduler)
    result = {"losses": []}
    if mode == "resumed":
        accelerator.load_state(ckpt)
    for epoch in range(3):
        if mode == "resumed" and epoch == 0:
            continue
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if epoch > 0:
                result["losses"].append(loss.item())
        if mode == "full" and epoch == 0:
            accelerator.save_state(ckpt)
            result["weights_at_save"] = exported(accelerator, model)
            result["lr_at_save"] = optimizer.param_groups[0]["lr"]
    result.update(weights=exported(accelerator, model), optimizer=optimizer_state(optimizer),
                  lr=optimizer.param_groups[0]["lr"])
    torch.save(result, out)


def _ddp_worker(out: str) -> None:
    """One rank of the 2-process run (rank and rendezvous from the environment, as accelerate launch sets them)."""
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = make_model(seed=100 + accelerator.process_index)  # different weights per rank on purpose
    result = {"num_processes": accelerator.num_processes, "init": fp32_weights(model)}
    set_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    loader = torch.utils.data.DataLoader(make_data(), batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = IpexTrainPlugin().prepare(accelerator, model, optimizer, loader, scheduler)
    result["prepared"] = exported(accelerator, model)
    result["batches"] = len(loader)
    losses = []
    for _ in range(3):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    result["losses"] = losses
    result["final"] = exported(accelerator, model)
    try:
        IpexTrainPlugin().prepare(accelerator, model, optimizer.optimizer)
        result["reprepare_error"] = ""
    except TypeError as e:
        result["reprepare_error"] = str(e)
    torch.save(result, out)
    # Both ranks past their last collective before either tears the process group down: a rank destroying it while
    # the other's gloo work is still in flight aborted the process ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _worker_main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv[0] == "resume":
        _resume_worker(*argv[1:])
    elif argv[0] == "ddp":
        _ddp_worker(*argv[1:])
    else:
        raise SystemExit(f"unknown worker {argv[0]!r}")


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
