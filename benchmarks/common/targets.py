"""The one kind of pass/fail target the benchmarks print and write: a named bound on a measured value.

    Target("resnet50 b16 int8 vs fp32 export", 2.5, ">=").judge(2.7)        # PASS
    Target("optimize_bf16 vs autocast", 0.8, "<=", noise="fail").judge(0.82, spread=0.05)  # FAIL (within noise)

``noise`` says how a value past the limit but within the measured spread of it is judged: ``"fail"`` (the
default: a target is met only by a measurement), ``"noise"`` (the verdict reads ``NOISE``: neither met nor missed;
``pass`` stays False) or ``"pass"``.
"""
from __future__ import annotations

from dataclasses import dataclass

DIRECTIONS = ("<=", ">=")
NOISE_RULES = ("fail", "noise", "pass")


@dataclass(frozen=True)
class Target:
    """``name``: what is held to the bound (the row's text); ``limit`` and ``direction`` (``"<="`` or ``">="``):
    the bound; ``noise``: the verdict when the value misses the bound by less than its spread (see the module
    docstring); ``text``: the row's full wording where ``"<name> <direction> <limit>"`` does not read well."""

    name: str
    limit: float
    direction: str = "<="
    noise: str = "fail"
    text: str | None = None

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"Target {self.name!r}: direction must be one of {DIRECTIONS}; got {self.direction!r}")
        if self.noise not in NOISE_RULES:
            raise ValueError(f"Target {self.name!r}: noise must be one of {NOISE_RULES}; got {self.noise!r}")

    def met(self, value: float) -> bool:
        """Whether ``value`` is on the right side of the limit."""
        return value <= self.limit if self.direction == "<=" else value >= self.limit

    def judge(self, value: float, spread: float = 0.0, band: tuple[float, float] | None = None, **extra) -> dict:
        """The JSON row of this target at ``value``: ``target``, ``value``, ``limit``, ``direction``, ``band``,
        ``within_noise`` (missed, but the limit lies inside the band), ``pass`` and ``verdict`` (PASS / FAIL /
        NOISE), plus ``extra`` fields. The band is ``band`` (e.g. the quartiles of paired ratios) or ``value``
        plus and minus ``spread`` times itself."""
        lo, hi = band if band is not None else (value * (1 - spread), value * (1 + spread))
        within = not self.met(value) and min(lo, hi) <= self.limit <= max(lo, hi)
        if self.met(value) or (within and self.noise == "pass"):
            verdict = "PASS"
        else:
            verdict = "NOISE" if within and self.noise == "noise" else "FAIL"
        return {"target": self.text or f"{self.name} {self.direction} {self.limit:g}", "value": value,
                "limit": self.limit, "direction": self.direction, "band": [lo, hi], "within_noise": within,
                "pass": verdict == "PASS", "verdict": verdict, **extra}


def print_targets(rows: list[dict], digits: int = 3) -> None:
    """The ``targets:`` block every benchmark prints: one ``PASS/FAIL/NOISE  target  (measured v)`` line a row."""
    print("\ntargets:")
    for t in rows:
        floor = f"; moving Lamb's bytes alone: {t['floor']:.2f}" if t.get("floor") else ""
        noise = " (within noise)" if t.get("within_noise") and t["verdict"] == "FAIL" else ""
        print(f"  {t['verdict']}{noise}  {t['target']}  (measured {t['value']:.{digits}f}{floor})")
