"""The one timing loop of the benchmarks: variants called in interleaved rounds, so that drifting load on a shared
machine hits them alike, summarised as best / median / spread, and ratios paired within a round.

    rounds = interleaved({"ours": ours, "torch": theirs}, rounds=15, warmup=3)
    rounds.summary("ours").median          # seconds per call
    rounds.paired("ours", "torch").median  # median over rounds of ours / torch measured in the same round

A variant is a zero-argument callable. With ``self_timed=True`` each call returns its own seconds instead of being
timed here (bench_train_step's workers time their step in their own process). ``steady`` keeps warming a variant up
until two consecutive warm-up calls agree within that fraction (at most ``max_warmup`` calls).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Samples of one quantity (seconds per call, or a paired ratio) and their best, median and spread."""

    samples: tuple[float, ...]

    @property
    def best(self) -> float:
        """The smallest sample."""
        return min(self.samples)

    @property
    def median(self) -> float:
        """The median sample."""
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 with fewer than two samples): how far a typical sample strays."""
        q1, q3 = self.band
        return (q3 - q1) / self.median

    @property
    def band(self) -> tuple[float, float]:
        """The first and third quartiles (the sample twice with one sample)."""
        if len(self.samples) < 2:
            return (self.samples[0], self.samples[0])
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q1, q3)

    def as_dict(self, unit: str = "s") -> dict:
        """JSON fields: ``best_<unit>``, ``median_<unit>``, ``spread`` and the samples."""
        return {f"best_{unit}": self.best, f"median_{unit}": self.median, "spread": self.spread,
                f"samples_{unit}": list(self.samples)}


def summarize(samples) -> Summary:
    """A :class:`Summary` of ``samples`` (at least one)."""
    samples = tuple(float(s) for s in samples)
    if not samples:
        raise ValueError("summarize: samples is empty; at least one sample is needed")
    return Summary(samples)


def steady(samples, tolerance: float) -> bool:
    """True when the last two of ``samples`` agree within ``tolerance`` (a fraction of the larger one)."""
    if len(samples) < 2:
        return False
    a, b = samples[-2], samples[-1]
    return abs(a - b) <= tolerance * max(a, b)


@dataclass(frozen=True)
class Rounds:
    """Per variant, the seconds per call of each timed round (round k of every variant ran in the same sweep)."""

    per_round: Mapping[str, tuple[float, ...]]
    warmup_calls: Mapping[str, int]

    def summary(self, name: str) -> Summary:
        """best / median / spread of ``name``'s rounds."""
        return Summary(self.per_round[name])

    def best(self) -> dict[str, float]:
        """Each variant's best round."""
        return {name: min(s) for name, s in self.per_round.items()}

    def median(self) -> dict[str, float]:
        """Each variant's median round."""
        return {name: statistics.median(s) for name, s in self.per_round.items()}

    def paired(self, a: str, b: str) -> Summary:
        """The ratio ``a / b`` of each round both ran in: drift between rounds cancels out of each ratio."""
        return Summary(tuple(x / y for x, y in zip(self.per_round[a], self.per_round[b])))


def _per_variant(value, names, what: str) -> dict[str, int]:
    out = dict(value) if isinstance(value, Mapping) else dict.fromkeys(names, value)
    bad = {n: out.get(n) for n in names if not isinstance(out.get(n), int) or out[n] < 0}
    if bad:
        raise ValueError(f"interleaved: {what} must be a non-negative int per variant; got {bad}")
    return out


def _call(fn: Callable, repeats: int, self_timed: bool) -> float:
    if self_timed:
        return sum(fn() for _ in range(repeats)) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def interleaved(variants: Mapping[str, Callable[[], object]], rounds: int | Mapping[str, int],
                repeats: int = 1, warmup: int | Mapping[str, int] = 1, steady_within: float | None = None,
                max_warmup: int | Mapping[str, int] = 8, self_timed: bool = False) -> Rounds:
    """Time ``variants`` in interleaved rounds; see the module docstring.

    Each variant gets ``warmup`` untimed calls (then, with ``steady_within``, more until two consecutive ones agree
    within that fraction, at most ``max_warmup`` in all), every variant's warm-up advancing round by round; then
    ``rounds`` timed rounds of ``repeats`` back-to-back calls each (``rounds``, ``warmup`` and ``max_warmup`` may
    be per-variant mappings: a variant whose rounds are done sits out the later ones)."""
    if not variants:
        raise ValueError("interleaved: variants is empty")
    if repeats < 1:
        raise ValueError(f"interleaved: repeats must be >= 1; got {repeats}")
    rounds_of = _per_variant(rounds, variants, "rounds")
    warm_of = _per_variant(warmup, variants, "warmup")
    most_of = _per_variant(max_warmup, variants, "max_warmup")
    warm_times: dict[str, list[float]] = {n: [] for n in variants}

    def warming(name: str) -> bool:
        done = len(warm_times[name])
        if done < warm_of[name]:
            return True
        return steady_within is not None and done < most_of[name] and not steady(warm_times[name], steady_within)

    while any(warming(n) for n in variants):
        for name, fn in variants.items():
            if warming(name):
                warm_times[name].append(_call(fn, 1, self_timed))
    per_round: dict[str, list[float]] = {n: [] for n in variants}
    for k in range(max(rounds_of.values())):
        for name, fn in variants.items():
            if k < rounds_of[name]:
                per_round[name].append(_call(fn, repeats, self_timed))
    return Rounds({n: tuple(s) for n, s in per_round.items()}, {n: len(w) for n, w in warm_times.items()})


def best_of_rounds(variants: Mapping[str, Callable[[], object]], rounds: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each variant: its best over ``rounds`` interleaved rounds of ``repeats`` back-to-back
    calls each, after one warm-up call."""
    return interleaved(variants, rounds, repeats, warmup=1).best()


def routed_against_unrouted(routed: Callable[[], object], unrouted: Callable[[], object],
                            control: Callable[[], object], rounds: int, warmup: int = 2) -> dict:
    """A route's whole-step study: steps of the routed model, the same model unrouted, and a second unrouted
    instance (``control``: how far two identical models' steps differ here, the noise floor of the ratio), in
    interleaved rounds. Median ms of each, the paired median ratio routed / unrouted and its spread, control /
    unrouted, and every round's sample."""
    rs = interleaved({"unrouted": unrouted, "routed": routed, "control": control}, rounds, warmup=warmup)
    med = rs.median()
    return {"unrouted_ms": med["unrouted"] * 1e3, "routed_ms": med["routed"] * 1e3, "control_ms": med["control"] * 1e3,
            "ratio": rs.paired("routed", "unrouted").median, "ratio_spread": rs.paired("routed", "unrouted").spread,
            "control_ratio": rs.paired("control", "unrouted").median,
            "samples_ms": {name: [t * 1e3 for t in times] for name, times in rs.per_round.items()}}


def op_and_step_arguments(description: str, argv: list[str] | None = None):
    """The command line of a fused op's study (op rows, then whole-step rows): --json, --threads (applied here),
    --op-rounds, --step-rounds, --no-step, --no-op."""
    import argparse

    import torch

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--op-rounds", type=int, default=15)
    p.add_argument("--step-rounds", type=int, default=5)
    p.add_argument("--no-step", action="store_true", help="only the op rows")
    p.add_argument("--no-op", action="store_true", help="only the step rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args
