"""benchmarks.common.timing: interleaved rounds (warm-up, steady warm-up, per-variant rounds), best / median /
spread, and ratios paired within a round."""
import pytest

from benchmarks.common.timing import Summary, best_of_rounds, interleaved, steady, summarize


def test_best_of_rounds_calls_and_keeps_the_best_round():
    calls = {"a": 0, "b": 0}

    def variant(name):
        def fn():
            calls[name] += 1
        return fn

    best = best_of_rounds({name: variant(name) for name in calls}, rounds=3, repeats=4)
    assert calls == {"a": 13, "b": 13}
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())


def _self_timed(order, name, times):
    """A variant that returns its own seconds (as bench_train_step's workers do), from ``times`` in turn."""
    it = iter(times)

    def fn():
        order.append(name)
        return next(it)
    return fn


def test_rounds_interleave_variants_and_pair_their_ratios():
    order = []
    rounds = interleaved({"a": _self_timed(order, "a", [9, 2.0, 4.0, 3.0]),
                          "b": _self_timed(order, "b", [9, 1.0, 1.0, 2.0])}, rounds=3, warmup=1, self_timed=True)
    assert order == ["a", "b"] * 4  # warm-up round, then three timed rounds, one call of each in turn
    assert rounds.per_round == {"a": (2.0, 4.0, 3.0), "b": (1.0, 1.0, 2.0)}
    a = rounds.summary("a")
    assert (a.best, a.median) == (2.0, 3.0)
    assert a.spread == pytest.approx((3.5 - 2.5) / 3.0)  # inclusive quartiles of (2, 3, 4): 2.5 and 3.5
    # Paired: a / b in each round (2, 4, 1.5), not the ratio of the medians (3 / 1).
    assert rounds.paired("a", "b").samples == (2.0, 4.0, 1.5)
    assert rounds.paired("a", "b").median == 2.0 and rounds.median()["a"] / rounds.median()["b"] == 3.0


def test_steady_warmup_stops_when_two_calls_agree_and_is_bounded():
    order = []
    # a settles after its third call (1.0 then 1.02: within 5%); b never does and stops at max_warmup.
    rounds = interleaved({"a": _self_timed(order, "a", [5.0, 2.0, 1.0, 1.02, 1.0]),
                          "b": _self_timed(order, "b", [1.0, 2.0, 1.0, 2.0, 1.0, 0.5])},
                         rounds=1, warmup=1, steady_within=0.05, max_warmup=5, self_timed=True)
    assert rounds.warmup_calls == {"a": 4, "b": 5}
    assert rounds.per_round == {"a": (1.0,), "b": (0.5,)}
    assert order[:2] == ["a", "b"] and order.count("a") == 5 and order.count("b") == 6


def test_per_variant_rounds_and_warmup():
    order = []
    rounds = interleaved({"slow": _self_timed(order, "slow", [1.0] * 2), "fast": _self_timed(order, "fast", [1.0] * 5)},
                         rounds={"slow": 2, "fast": 4}, warmup={"slow": 0, "fast": 1}, self_timed=True)
    assert {k: len(v) for k, v in rounds.per_round.items()} == {"slow": 2, "fast": 4}
    assert rounds.paired("slow", "fast").samples == (1.0, 1.0)  # only the rounds both ran in


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="variants is empty"):
        interleaved({}, 1)
    with pytest.raises(ValueError, match="rounds"):
        interleaved({"a": lambda: None}, {"b": 1})
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"a": lambda: None}, 1, repeats=0)
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_summary_of_one_sample_and_steady():
    one = Summary((2.0,))
    assert (one.best, one.median, one.spread, one.band) == (2.0, 2.0, 0.0, (2.0, 2.0))
    assert steady([1.0, 1.04], 0.05) and not steady([1.0, 1.1], 0.05) and not steady([1.0], 0.05)
