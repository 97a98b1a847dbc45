"""How sure a certificate is: the leak rate of a population from the private samples the red team attacked.

A red-team run attacks ``n`` private samples drawn at random from a stated population; ``k`` of them leak
(some attack reconstructs them past a threshold). The claim a reviewer signs off is about the population,
not the ``n`` samples: "fewer than ``max_leak_rate`` of the population's samples leak, at ``confidence``".
The exact (Clopper-Pearson) one-sided upper confidence bound on a binomial proportion supports it:

    upper(k, n) = the p with P[Binomial(n, p) <= k] = 1 - confidence   (1 when k = n),

the ``confidence`` quantile of Beta(k + 1, n - k). With 0 of n it is ``1 - (1 - confidence)^(1/n)``, about
3/n at 95% (the "rule of three"). The verdict rule: certified only when ``upper(k, n) < max_leak_rate``.

Pure functions; ``certify`` applies them. Assumptions, stated in every certificate: samples are drawn
independently from the population (guardfl draws without replacement from a finite population, for which
the binomial bound is conservative), and samples that share a client update (batch size B > 1) are
counted one by one, although their leaks are correlated (one update, one attack run): the bound is then
optimistic, and the per-update figure (``upper(k_updates, updates)``) is reported beside it.
"""

from __future__ import annotations

import math
from typing import Any

from scipy.special import betaincinv

#: the verdicts a certificate can carry
CERTIFIED, NOT_CERTIFIED, INSUFFICIENT = "CERTIFIED", "NOT CERTIFIED", "INSUFFICIENT EVIDENCE"


def upper_bound(k: int, n: int, confidence: float) -> float:
    """The exact one-sided upper ``confidence`` bound on the rate of an event seen ``k`` times in ``n``
    independent trials (Clopper-Pearson). 1.0 with no trials or when every trial was an event."""
    _check(k, n, confidence)
    if n == 0 or k >= n:
        return 1.0
    if k == 0:  # closed form (and exact in floating point where betaincinv is not)
        return 1.0 - (1.0 - confidence) ** (1.0 / n)
    return float(betaincinv(k + 1, n - k, confidence))


def samples_needed(max_rate: float, confidence: float, leaks: int = 0, limit: int = 10_000_000) -> int | None:
    """The fewest samples ``n`` with ``upper_bound(leaks, n, confidence) < max_rate``: how many samples,
    ``leaks`` of them leaking, would support the claim. None when no ``n`` up to ``limit`` does."""
    if not 0 < max_rate < 1:
        raise ValueError(f"max_rate: expected a rate in (0, 1) (got {max_rate!r})")
    _check(leaks, leaks, confidence)
    if leaks == 0:
        n = max(1, math.floor(math.log(1 - confidence) / math.log(1 - max_rate)))
        while upper_bound(0, n, confidence) >= max_rate:  # the closed form's boundary, exactly
            n += 1
        return n
    lo, hi = leaks + 1, leaks + 1  # upper_bound(leaks, n) falls as n grows: double, then bisect
    while upper_bound(leaks, hi, confidence) >= max_rate:
        if hi >= limit:
            return None
        lo, hi = hi, min(limit, hi * 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if upper_bound(leaks, mid, confidence) < max_rate:
            hi = mid
        else:
            lo = mid + 1
    return hi


def leak_rate(k: int, n: int, max_rate: float, confidence: float) -> dict[str, Any]:
    """The population claim from ``k`` leaks among ``n`` samples: the bound, the verdict it supports, and
    how many samples would be needed.

    ``status``: CERTIFIED when the bound is below ``max_rate``; INSUFFICIENT EVIDENCE when nothing leaked
    but ``n`` is too small for any result to certify (``samples_needed`` says how many would); NOT
    CERTIFIED when samples leaked and the bound does not rule out the rate (``samples_needed`` is then
    the sample size at which the same observed leak rate would certify, None when it is at or above the
    rate)."""
    bound = upper_bound(k, n, confidence)
    zero_needed = samples_needed(max_rate, confidence, 0)
    if bound < max_rate:
        status, needed = CERTIFIED, None
    elif k == 0:
        status, needed = INSUFFICIENT, zero_needed
    else:
        status, needed = NOT_CERTIFIED, _needed_at_rate(k / n, max_rate, confidence)
    return {
        "samples": n, "leaked": k, "observed_rate": k / n if n else None, "upper_bound": bound,
        "confidence": confidence, "max_leak_rate": max_rate, "status": status,
        "samples_needed": needed, "samples_needed_without_leaks": zero_needed,
        "rule": f"certified when the one-sided {confidence:.0%} Clopper-Pearson upper bound on the leak rate is "
                f"below {max_rate:g}",
    }


def _needed_at_rate(rate: float, max_rate: float, confidence: float, limit: int = 1_000_000) -> int | None:
    """The fewest samples at which ``round(rate * n)`` leaks would certify (None when ``rate`` is not
    below ``max_rate``: no sample size certifies a population that leaks at the rate)."""
    if rate >= max_rate:
        return None
    n = samples_needed(max_rate, confidence, 0)
    while n <= limit:
        if upper_bound(round(rate * n), n, confidence) < max_rate:
            return n
        n = max(n + 1, int(n * 1.05))
    return None


def _check(k: int, n: int, confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a probability in (0, 1) (got {confidence!r})")
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"leaks: expected 0 <= k <= n (got k={k}, n={n})")
