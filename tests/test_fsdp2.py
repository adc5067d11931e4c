"""optimize() on FSDP2 (fully_shard on a CPU mesh, gloo on 127.0.0.1): parity with one process on the global batch
for every fused optimizer, the bf16 MixedPrecisionPolicy, the refused orders, DCP checkpoints (same and other
world size, and into a plain one-process torch model), clip_grad_norm_, step_in_backward and reduced-byte state on
shards, per-rank memory accounting.

Each world size is spawned once (module fixtures) and runs every case of that size; the ranks' code is
tests/fsdp_ranks.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ipex_train import _summary, compute_policy

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_ranks as R

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _ok(result: dict) -> dict:
    if "traceback" in result:
        pytest.fail(result["traceback"])
    return result


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp_ckpt")


@pytest.fixture(scope="module")
def two(tmp_path_factory, ckpt):
    tasks = [("fp32", ()), ("bf16", ()), ("refusals", ()), ("dcp_save", (str(ckpt),)), ("clip", ()),
             ("step_in_backward", ()), ("memory", ())]
    return R.spawn(2, tasks, tmp_path_factory.mktemp("fsdp2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory, ckpt, two):
    # `two` first: the 4-rank run loads the checkpoints the 2-rank run saved.
    return R.spawn(4, [("fp32", ()), ("dcp_load", (str(ckpt),)), ("memory", ())], tmp_path_factory.mktemp("fsdp4"))


def _close(a: list[torch.Tensor], b, atol: float) -> float:
    worst = max(float((x - y.detach()).abs().max()) for x, y in zip(a, b))
    assert worst <= atol, worst
    return worst


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(R.OPTIMIZERS))
def test_fp32_matches_one_process(two, four, world, name):
    """Weights after 10 steps within 1e-6 of one process on the global batch (uneven shards; at 4 ranks one rank
    holds no row of the last Linear)."""
    got = _ok((two if world == 2 else four)[0]["fp32"])
    ref, _, _ = R.reference(R.model, R.OPTIMIZERS[name], R.STEPS)
    assert got[f"{name}_class"] == type(R.OPTIMIZERS[name](ref.parameters())).__name__
    _close(got[name], ref.parameters(), 1e-6)
    start = R.model()
    assert max(float((a - b).abs().max()) for a, b in zip(got[name], start.parameters())) > 1e-3  # it trained


def test_bf16_policy_matches_one_process(two):
    """The bf16 MixedPrecisionPolicy vs one-process optimize(dtype=bfloat16): the first loss equal, every loss of
    20 steps within 1%."""
    got = _ok(two[0]["bf16"])
    _, _, ref = R.reference(R.model, R.OPTIMIZERS["adamw"], 20, dtype=torch.bfloat16)
    assert got["policy"] is not None and got["fused"] == "adam"
    assert got["reasons"] == [_summary.SHARD]  # every parameter is an fp32 shard
    # Native policy: the same bf16 computation, so the same first loss. The emulated policy keeps a one-process
    # model's activations fp32, while FSDP2's policy casts the inputs to bf16 (cast_forward_inputs): close only.
    same = compute_policy.resolve() == "native"
    assert got["losses"][0] == pytest.approx(ref[0], rel=1e-5 if same else 1e-3)
    for a, b in zip(got["losses"], ref):
        assert a == pytest.approx(b, rel=0.01)
    assert got["losses"][-1] < got["losses"][0]


def test_refused_orders(two):
    got = _ok(two[0]["refusals"])
    assert got["inplace_false"].startswith("ValueError") and "inplace=True" in got["inplace_false"]
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in got["no_policy"]
    assert got["unchanged"]
    assert "dtype=torch.bfloat16" in got["fp32_on_bf16_policy"]
    for key in ("optimize_then_shard_bf16", "optimize_then_shard_fp32"):
        assert got[key].startswith("RuntimeError") and "no longer parameters of the model" in got[key], got[key]
    assert got["then_shard_unchanged"]
    assert "optimize()d before fully_shard" in got["split_weights_in_unit"]
    assert got["lamb_int8"].startswith("ValueError") and "optimizer_state_dtype" in got["lamb_int8"]


@pytest.mark.parametrize("state", list(R.STATE_DTYPES))
def test_dcp_resume_same_world_size_is_bit_identical(two, state):
    got = _ok(two[0]["dcp_save"])
    assert got[f"{state}_resumed"] == got[f"{state}_continued"]


def test_dcp_reduced_state_is_smaller(two):
    got = _ok(two[0]["dcp_save"])
    assert got["int8_state_bytes"] < got["bf16_state_bytes"] < got["fp32_state_bytes"]


@pytest.mark.parametrize("state", list(R.STATE_DTYPES))
def test_dcp_resume_other_world_size(two, four, state):
    """2-rank checkpoints load at 4 ranks: the same losses up to reduction order (fp32 state), or to the
    re-encoding of reduced state in 4-rank shards' blocks."""
    saved = _ok(two[0]["dcp_save"])[f"{state}_continued"]
    got = _ok(four[0]["dcp_load"])[f"{state}_resumed"]
    assert got == pytest.approx(saved, rel=1e-5 if state == "fp32" else 1e-3)


def test_dcp_into_plain_torch_one_process(two, ckpt):
    """The 2-rank fp32 checkpoint loads into a plain torch model and torch AdamW in one process."""
    saved = _ok(two[0]["dcp_save"])["fp32_continued"]
    m = R.wide_model()
    opt = R.OPTIMIZERS["adamw"](m.parameters())
    R.load(m, opt, str(ckpt / "fp32"))
    assert len(opt.state) == len(list(m.parameters()))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = R.loss_fn(m(R.X), R.Y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses == pytest.approx(saved, rel=1e-5)


def test_clip_grad_norm_matches_one_process(two):
    got = _ok(two[0]["clip"])
    m = R.model()
    R.loss_fn(m(R.X), R.Y).backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
    assert got["norm"] == pytest.approx(float(norm), rel=1e-5)
    _close(got["grads"], [p.grad for p in m.parameters()], 1e-7)


def test_step_in_backward_on_shards(two):
    got = _ok(two[0]["step_in_backward"])
    _close(got["weights_True"], got["weights_False"], 0.0)
    # Lamb inside backward: one parameter at a time, its norms summed across the ranks in the hook
    _close(got["lamb_weights_True"], got["lamb_weights_False"], 1e-6)
    losses = got["int8_losses"]
    assert losses[-1] < 0.8 * losses[0]
    assert "torch.int8" in got["int8_state_dtypes"] and "torch.uint8" in got["int8_state_dtypes"]


@pytest.mark.parametrize("world", [2, 4])
def test_memory_report_counts_this_rank(two, four, world):
    ranks = [_ok(r["memory"]) for r in (two if world == 2 else four)]
    for r in ranks:
        assert r["weights"] == 4 * r["local_elements"]
        assert r["parameters"] == r["global_elements"]
        # AdamW: two fp32 moments of this rank's shards, and a 4-byte step counter per parameter
        assert r["state"] == 2 * 4 * r["local_elements"] + 4 * r["tensors"]
    assert sum(r["local_elements"] for r in ranks) == ranks[0]["global_elements"]
