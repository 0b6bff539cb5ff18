"""Confidence intervals: how far a cell of n answers (accuracy) or of n seeds (a mean) can be trusted.

The Wilson score interval (Wilson 1927; Brown, Cai & DasGupta 2001, "Interval Estimation for a
Binomial Proportion", who recommend it over the normal approximation for small n and accuracies near
0 or 1): for k correct of n at z = 1.96 (95%),

    centre = (k + z^2 / 2) / (n + z^2),  half = z / (n + z^2) * sqrt(k (n - k) / n + z^2 / 4).

At n = 20 a cell reading 0.90 is compatible with 0.70 to 0.97. The answers of one example (several
queries of assoc_recall, several needles of niah) are not independent draws, so for such tasks the
interval is narrower than it should be; each table says n in answers.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval for `correct` successes of `n`; (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= correct <= n:
        raise ValueError(f"{correct} correct of {n}")
    centre = (correct + z * z / 2) / (n + z * z)
    half = z / (n + z * z) * math.sqrt(correct * (n - correct) / n + z * z / 4)
    # the bounds are exactly 0 at k = 0 and 1 at k = n (centre -/+ half cancel there), which rounding
    # misses by an ulp (5.6e-17 at 0 of 3, 0.9999999999999999 at 29 of 29) in the CSV and JSON
    low = 0.0 if correct == 0 else max(0.0, centre - half)
    high = 1.0 if correct == n else min(1.0, centre + half)
    return low, high


def separated(best: tuple[float, float], other: tuple[float, float]) -> bool:
    """Whether two intervals do not overlap: the best cell's lower bound above the other's upper
    bound. What a table's bold needs against every other cell; overlapping intervals cannot tell
    two cells apart."""
    return best[0] > other[1]


# Student's t, 97.5% quantile, by degrees of freedom 1..30 (any statistics table; e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, 1.3.6.7.2): a 95% interval of a mean over n = df + 1 seeds
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def student_t975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom: the table to 30, then the
    Cornish-Fisher expansion about the normal's (Abramowitz & Stegun 26.7.5), within 2e-4 past 30."""
    if df < 1:
        raise ValueError(f"{df} degrees of freedom")
    if df <= len(T975):
        return T975[df - 1]
    z = Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_interval(mean: float, std: float | None, n: int) -> tuple[float, float] | None:
    """The 95% interval of a mean over n seeds, mean -/+ t(n - 1) std / sqrt(n); None for one seed
    (no spread) or a spread that is not finite (a diverged run)."""
    if n < 2 or std is None or not math.isfinite(std) or not math.isfinite(mean):
        return None
    half = student_t975(n - 1) * std / math.sqrt(n)
    return mean - half, mean + half
