"""benchmarks.timing: each variant is warmed up once and called rounds x repeats times, its best round kept."""
from benchmarks.timing import best_of_rounds


def test_best_of_rounds_calls_and_keeps_the_best_round():
    calls = {"a": 0, "b": 0}

    def variant(name):
        def fn():
            calls[name] += 1
        return fn

    best = best_of_rounds({name: variant(name) for name in calls}, rounds=3, repeats=4)
    assert calls == {"a": 13, "b": 13}
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())
