"""The rule that turns seeds' eval losses into a verdict on a paper's claim.

Written down before any run of ``diloco bench claims`` (docs/claims.md says the same
in words), so that no verdict is chosen after seeing the numbers.

A claim is tested by one or more ``Test``s. A test compares a measured side ``a``
(one value per seed: an eval loss, or a per-seed gap between two contenders) with a
reference side ``b`` (the same, or nothing: a one-sample test against 0). Let

    d     = mean(a) - mean(b)                          (or mean(a) without b)
    sp    = the pooled standard deviation over seeds   (two samples, n_a + n_b - 2
            degrees of freedom), or sd(a) for one sample (n_a - 1)
    se    = sp * sqrt(1/n_a + 1/n_b)                   (or sd(a) / sqrt(n_a))
    k     = Student's t, two-sided 95%, at those degrees of freedom
    [lo, hi] = [d - k se, d + k se]                    (the 95% interval of d)

and, in the claim's own unit (nats, or a relative gap), ``tol`` the margin the
claim allows ("matches", "costs little": 1% of the reference's loss by default).
Per kind:

- ``within`` (A is no worse than B by more than tol): holds if hi <= tol; does not
  hold if lo > tol; otherwise not distinguishable at this size.
- ``better`` (A's loss is lower than B's): holds if hi < 0; does not hold if lo > 0
  (significantly worse); otherwise not distinguishable.
- ``worse`` (A's loss is higher than B's): holds if lo > 0; does not hold if hi < 0;
  otherwise not distinguishable.
- ``at_least`` (a deterministic figure, such as a bandwidth ratio, is at least
  ``tol``; no seeds needed): holds if mean(a) >= tol, else does not hold.

Fewer than two seeds on a side that needs a spread gives no interval: the test is
not distinguishable (the quick profile, one seed, ends there by design).

A claim does not hold when any one of its tests does not hold, holds when every
one holds, and is not distinguishable otherwise (not yet run while a test lacks
its runs). Tests that only report a figure
(``report``) take no part.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

HOLDS = "holds"
FAILS = "does not hold"
UNCLEAR = "not distinguishable at this size"
NOT_RUN = "not yet run"
VERDICTS = (HOLDS, FAILS, UNCLEAR, NOT_RUN)

Kind = Literal["within", "better", "worse", "at_least", "report"]
KINDS: tuple[str, ...] = ("within", "better", "worse", "at_least", "report")

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; beyond 30 the
# normal's 1.96 is close enough.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 12: 2.179, 14: 2.145, 16: 2.120, 18: 2.101, 20: 2.086,
       25: 2.060, 30: 2.042}


def t95(df: int) -> float:
    """The two-sided 95% Student t value at ``df`` degrees of freedom (the table's
    entry at or below ``df``: slightly conservative between entries)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df > 30:
        return 1.96
    return T95[max(k for k in T95 if k <= df)]


@dataclass(frozen=True)
class Outcome:
    """What a test found: the difference, its interval and the verdict."""

    verdict: str
    d: float
    lo: float | None = None
    hi: float | None = None

    def to_dict(self) -> dict[str, float | str | None]:
        return {"verdict": self.verdict, "d": self.d, "lo": self.lo, "hi": self.hi}


def interval(a: Sequence[float], b: Sequence[float] | None = None
             ) -> tuple[float, float | None, float | None]:
    """(d, lo, hi): the difference of means and its 95% interval; no interval
    (None, None) when a side has fewer than two values."""
    d = statistics.fmean(a) - (statistics.fmean(b) if b else 0.0)
    if b:
        na, nb = len(a), len(b)
        if na < 2 or nb < 2:
            return d, None, None
        sp2 = ((na - 1) * statistics.variance(a) + (nb - 1) * statistics.variance(b)) \
            / (na + nb - 2)
        se, df = math.sqrt(sp2) * math.sqrt(1 / na + 1 / nb), na + nb - 2
    else:
        if len(a) < 2:
            return d, None, None
        se, df = statistics.stdev(a) / math.sqrt(len(a)), len(a) - 1
    k = t95(df)
    return d, d - k * se, d + k * se


def decide(kind: str, a: Sequence[float], b: Sequence[float] | None = None,
           tol: float = 0.0) -> Outcome:
    """The verdict of one test (the rules of this module's docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: allowed {', '.join(KINDS)}")
    if not a:
        return Outcome(NOT_RUN, math.nan)
    if b is not None and not b:
        return Outcome(NOT_RUN, math.nan)
    if kind in ("at_least", "report"):
        d = statistics.fmean(a)
        if kind == "report":
            return Outcome("", d)
        return Outcome(HOLDS if d >= tol else FAILS, d)
    d, lo, hi = interval(a, b)
    if lo is None or hi is None or not all(map(math.isfinite, (d, lo, hi))):
        return Outcome(UNCLEAR, d, lo, hi)
    if kind == "within":
        verdict = HOLDS if hi <= tol else FAILS if lo > tol else UNCLEAR
    elif kind == "better":
        verdict = HOLDS if hi < 0 else FAILS if lo > 0 else UNCLEAR
    else:  # worse
        verdict = HOLDS if lo > 0 else FAILS if hi < 0 else UNCLEAR
    return Outcome(verdict, d, lo, hi)


def combine(verdicts: Sequence[str]) -> str:
    """A claim's verdict from its tests' (``report`` tests give ""): does not hold if
    any test does not hold, not yet run if any test has not run, holds if all hold,
    otherwise not distinguishable."""
    vs = [v for v in verdicts if v]
    if FAILS in vs:
        return FAILS
    if not vs or NOT_RUN in vs:
        return NOT_RUN
    if all(v == HOLDS for v in vs):
        return HOLDS
    return UNCLEAR
