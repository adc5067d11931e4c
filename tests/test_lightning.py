"""ipex_train's Lightning precision plugin (``IpexTrainPrecision``): a Lightning fit trains exactly as a plain loop
with optimize() (bf16 weights, fused AdamW step, the StepLR schedule), ``fit(ckpt_path=...)`` continues a run
exactly, two DDP processes (gloo) match one process on the global batch, optimize() options through ``config``,
and the refused settings. The module, data and DDP ranks are in tests/lightning_ranks.py."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import ipex_train

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).parent))
import lightning_ranks as R  # noqa: E402

from ipex_train.integrations.lightning import IpexTrainPrecision  # noqa: E402

BF16 = torch.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def manual(steps: int, batch: int, dtype=BF16):
    """The plain loop: configure_optimizers, optimize(inplace=True), then step and schedule by hand."""
    module = R.Net().train()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    module, opt = ipex_train.optimize(module, opt, dtype=dtype, inplace=True)
    batches = (b for _ in range(steps) for b in R.loader(batch))  # epochs, in order
    for i in range(steps):
        loss = module.training_step(next(batches), i)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return module, opt


@pytest.mark.parametrize("precision, dtype", [("bf16", BF16), ("32", torch.float32)])
def test_fit_trains_exactly_as_the_plain_loop(precision, dtype):
    module = R.Net()
    trainer = R.trainer(IpexTrainPrecision(precision), max_steps=6)
    trainer.fit(module, R.loader(8))
    want, want_opt = manual(6, 8, dtype)
    assert module.embed.weight.dtype == dtype and module.head.weight.dtype == dtype
    assert module.norm.weight.dtype == torch.float32
    opt = trainer.optimizers[0]
    assert ipex_train.summary(module, opt).fused_step == "adam"
    assert module.losses == want.losses and module.losses[-1] < module.losses[0]
    assert_same(state(module), state(want))
    # The StepLR schedule drove the optimizer: 1e-2 halved every 2 steps.
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in want_opt.param_groups] == [1e-2 / 8]
    assert trainer.precision == ("bf16-true" if dtype == BF16 else "32-true")


def test_resume_from_checkpoint_is_exact(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        module = R.Net()
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        R.trainer(IpexTrainPrecision("bf16"), max_epochs=4, enable_checkpointing=True,
                  callbacks=[saver]).fit(module, R.loader(8), ckpt_path=ckpt_path)
        return module

    whole = run()
    ckpt = torch.load(tmp_path / "epoch=1.ckpt", weights_only=False)
    assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values())  # the fp32 truth, not bf16 tops
    state0 = ckpt["optimizer_states"][0]["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state0.values())
    resumed = run(tmp_path / "epoch=1.ckpt")
    assert resumed.losses == whole.losses[len(whole.losses) // 2:]
    assert_same(state(resumed), state(whole))


def test_two_ddp_processes_match_one_process_on_the_global_batch(tmp_path):
    """2 ranks x 4 rows vs 1 process x 8 rows, 4 steps. fp32: within 1e-5 (summation order only). bf16: each
    rank's bf16 grads are rounded before the all-reduce, so the weights' distance from the one-process run is
    bounded relative to how far they moved: within 5%. The ranks agree with each other exactly."""
    ranks = R.spawn(2, batch=4, steps=4, out=tmp_path)
    for r in ranks:
        if "traceback" in r:
            pytest.fail(r["traceback"])
    start = state(R.Net())
    for precision in ("32", "bf16"):
        want = R.fit(precision, batch=8, steps=4)
        # Each rank's loss is its half batch's: their mean is the one-process loss.
        mean = (ranks[0][precision].pop("losses") + ranks[1][precision].pop("losses")) / 2
        torch.testing.assert_close(mean, want.pop("losses"), rtol=1e-5 if precision == "32" else 2e-2, atol=0)
        got = ranks[0][precision]
        assert_same(ranks[1][precision], got)
        if precision == "32":
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5)
        else:
            moved = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
            off = sum(float((got[k] - want[k]).norm() ** 2) for k in want) ** 0.5
            assert moved > 0.1 and off < 0.05 * moved, (off, moved)


def test_optimize_options_through_config():
    config = ipex_train.OptimizeConfig(step_in_backward=True, optimizer_state_dtype="int8")
    module = R.Net()
    trainer = R.trainer(IpexTrainPrecision("bf16", config=config), max_steps=3)
    before = state(module)
    trainer.fit(module, R.loader(8))
    opt = trainer.optimizers[0]
    assert opt.step_in_backward and all(g["state_dtype"] == "int8" for g in opt.param_groups)
    assert all(p.grad is None for p in module.parameters())
    after = state(module)
    assert all(not torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("args, kw, error, match", [
    (("16-mixed",), {}, ValueError, r"precision must be 'bf16' or '32'"),
    (("bf16",), dict(config=ipex_train.OptimizeConfig(dtype=torch.float32)), ValueError, r"config.dtype"),
    (("bf16",), dict(config={"dtype": "bf16"}), TypeError, r"config must be an ipex_train.OptimizeConfig"),
])
def test_bad_arguments(args, kw, error, match):
    with pytest.raises(error, match=match):
        IpexTrainPrecision(*args, **kw)


@pytest.mark.parametrize("kw, match", [(dict(accumulate_grad_batches=2), r"accumulate_grad_batches=2"),
                                       (dict(gradient_clip_val=1.0), r"gradient_clip_val=1.0")])
def test_step_in_backward_refusals_leave_the_module_alone(kw, match):
    module = R.Net()
    before = state(module)
    plugin = IpexTrainPrecision("bf16", config=ipex_train.OptimizeConfig(step_in_backward=True))
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        R.trainer(plugin, max_steps=2, **kw).fit(module, R.loader(8))
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert_same(state(module), before)


def test_recipe_runs_and_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    import json

    from recipes import lightning_train

    metrics = tmp_path / "metrics.json"
    rc = lightning_train.main(["--steps", "3", "--batches", "2", "--batch-size", "2", "--width", "16", "--layers", "1",
                               "--seq", "8", "--vocab", "16", "--no-progress", "--no-compare-fp32", "--out",
                               str(tmp_path), "--json", str(metrics)])
    data = json.loads(metrics.read_text())
    assert rc == 0 and data["checks"] == {"resume_exact": True}
    [run] = data["runs"]
    assert run["name"] == "ipex_train plugin bf16" and len(run["losses"]) == 3
    assert (tmp_path / "lightning_train.png").stat().st_size > 0
