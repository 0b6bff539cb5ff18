"""Confidence intervals for accuracy cells: how far a cell of n answers can be trusted.

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
