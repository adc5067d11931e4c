"""Timing shared by the kernel benchmarks: every variant warmed up once, then timed in interleaved rounds (so that
drifting load on a shared machine hits them alike), keeping each variant's best round."""
import time


def best_of_rounds(variants: dict, rounds: int, repeats: int) -> dict:
    """Seconds per call of each zero-argument callable in ``variants``: the best over ``rounds`` interleaved rounds
    of ``repeats`` back-to-back calls each, after one warm-up call."""
    best = dict.fromkeys(variants, float("inf"))
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / repeats)
    return best
