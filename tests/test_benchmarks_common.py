"""benchmarks.common: the target type (directions, how a miss within the spread is judged) and the report writer
(its header: date, machine, torch, command line)."""
import json
import sys

import pytest
import torch

from benchmarks.common import report
from benchmarks.common.targets import Target


def test_target_directions_and_noise_rules():
    at_most = Target("x", 0.8)
    assert at_most.judge(0.79)["verdict"] == "PASS" and at_most.judge(0.8)["pass"]
    row = at_most.judge(0.82, spread=0.05)  # misses by 0.02, inside its 5% spread (0.779-0.861)
    assert (row["verdict"], row["pass"], row["within_noise"]) == ("FAIL", False, True)
    assert at_most.judge(0.9, spread=0.05)["within_noise"] is False
    assert Target("x", 0.8, noise="noise").judge(0.82, spread=0.05)["verdict"] == "NOISE"
    assert Target("x", 0.8, noise="pass").judge(0.82, spread=0.05)["verdict"] == "PASS"
    at_least = Target("y", 2.5, ">=", text="y: >= 2.5x")
    assert at_least.judge(2.6)["pass"] and not at_least.judge(2.4)["pass"]
    row = at_least.judge(2.4, band=(2.3, 2.55))  # the paired ratios' quartiles reach the goal
    assert row["verdict"] == "FAIL" and row["within_noise"] and row["target"] == "y: >= 2.5x"
    assert Target("z", 1.0).judge(0.5, floor=0.4)["floor"] == 0.4


def test_target_refuses_unknown_direction_or_rule():
    with pytest.raises(ValueError, match="direction"):
        Target("x", 1.0, "<")
    with pytest.raises(ValueError, match="noise"):
        Target("x", 1.0, noise="maybe")


def test_report_writes_the_payload_under_a_header(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--quick"])
    path = tmp_path / "r.json"
    written = report.write(path, {"rows": [1, 2]})
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(written))
    assert data["rows"] == [1, 2]
    head = data["report"]
    assert head["torch"] == torch.__version__ and head["command"][1:] == ["bench.py", "--quick"]
    assert head["date"][:4].isdigit() and head["machine"]["cpu"] and head["machine"]["threads"] >= 1
    assert report.write(None, {"a": 1})["a"] == 1  # no path: nothing written, the payload still returned


def test_plain_loop_agreement_compares_like_with_like():
    from benchmarks.suite.bench_train_step import _agreement_targets, plain_loop_agreement

    by_variant = {"fp32": {"min_step_s": 1.0, "median_step_s": 1.2, "ratio_vs_fp32": 1.0},
                  "optimize_bf16": {"min_step_s": 0.7, "median_step_s": 0.9, "ratio_vs_fp32": 0.75}}
    plain = {"fp32": {"best_s": 2.0, "median_s": 2.0}, "optimize_bf16": {"best_s": 1.4, "median_s": 1.6}}
    [row] = plain_loop_agreement("m", by_variant, plain)
    assert row["harness_ratio"] == {"best": 0.7, "median": 0.75}
    assert row["plain_loop_ratio"] == {"best": 0.7, "median": 0.8}
    assert row["agreement"]["best"] == pytest.approx(1.0) and row["agreement"]["median"] == pytest.approx(0.9375)
    verdicts = {t["target"].split("(")[1].split(")")[0]: t["verdict"] for t in _agreement_targets([row])}
    assert verdicts == {"best": "PASS", "median": "FAIL"}  # 6.25% apart: outside 5%
