"""How sure a certificate is: the verdicts, and each claim's evidence from the client updates attacked.

A red-team run attacks client updates drawn independently from the deployment (``sampling``): each gives
the share of its private samples that leaked (some attack reconstructed them past a threshold) or were
re-identified (``reid``). A claim a reviewer signs off is about the deployment, not the updates attacked:
"the mean share of an update's samples that leak is below ``max_leak_rate``, at ``confidence``". The
update is the unit: samples of one update share one draw of the client's randomness and one attack run,
so their leaks are correlated; the per-update share is a bounded mean whatever that correlation is.

Each claim is decided by the sequential rule (``sequential.decide``: anytime-valid, so the run may stop as
soon as it is decided): CERTIFIED when the bound on the rate is below the claim (a false one with
probability at most ``1 - confidence``), NOT CERTIFIED when the data show the claim false (a true claim
refuted with probability at most ``1 - confidence``, shared among the claims: Bonferroni), INCONCLUSIVE
when the budget ran out first (it says how many more updates would most likely decide). A certificate is
CERTIFIED when every claim is, NOT CERTIFIED when any is refuted (or another requirement fails),
INCONCLUSIVE otherwise. Only CERTIFIED is green.

The exact fixed-sample (Clopper-Pearson) bound below is the rule certificates used before the sequential
one: valid only when the sample size is fixed in advance and looked at once; ``bench_sequential`` measures
how it errs when peeked at after every round.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from scipy.special import betaincinv

from guardfl.redteam.certification import sequential

#: the verdicts a certificate can carry (the CLI's exit status: 0, 1, 3)
CERTIFIED, NOT_CERTIFIED, INCONCLUSIVE = "CERTIFIED", "NOT CERTIFIED", "INCONCLUSIVE"
VERDICTS = (CERTIFIED, NOT_CERTIFIED, INCONCLUSIVE)
#: a claim the config does not make (``max_leak_rate: null``): its figures are reported, nothing is decided
NO_CLAIM = "no claim"
_STATUS = {sequential.CERTIFIED: CERTIFIED, sequential.REFUTED: NOT_CERTIFIED, sequential.UNDECIDED: INCONCLUSIVE}


def claim_evidence(per_update: Sequence[float], max_rate: float | None, confidence: float, refute_alpha: float, *,
                   per_update_samples: int, leaked: int, what: str, seed: int = 0) -> dict[str, Any]:
    """One claim (``what``: 'leak' or 're-identification') from the attacked updates' shares
    ``per_update``: the sequential decision, the anytime confidence bounds on the rate, the samples
    behind it, and, when undecided, how many more updates would most likely decide
    (``sequential.more_needed``) and the fewest leak-free updates that could certify it at all."""
    alpha = 1 - confidence
    xs = list(per_update)
    n = len(xs)
    out: dict[str, Any] = {
        "unit": "update", "samples_per_update": per_update_samples, "updates": n, "samples": n * per_update_samples,
        "leaked": leaked, "observed_rate": (sum(xs) / n) if n else None, "per_update": xs, "confidence": confidence,
        "max_rate": max_rate, "upper_bound": sequential.upper_bound(xs, alpha), "lower_bound": sequential.lower_bound(xs, refute_alpha),
        "alpha_certify": alpha, "alpha_refute": refute_alpha,
    }
    if max_rate is None:
        out.update(status=NO_CLAIM, rule=f"no claim on the {what} rate (its figures are information)")
        return out
    d = sequential.decide(xs, max_rate, alpha, refute_alpha)
    out.update(status=_STATUS[d.status], e_certify=d.e_certify, e_refute=d.e_refute,
               updates_needed_without_leaks=sequential.zero_leak_updates(max_rate, alpha),
               rule=(f"anytime-valid (mixture of bets): certified when the {confidence:.0%} upper bound on the mean "
                     f"{what} share of an update is below {max_rate:g}; not certified when the lower bound "
                     f"(level {refute_alpha:.3g}) is above it"))
    out["more_updates"] = sequential.more_needed(xs, max_rate, alpha, refute_alpha, seed=seed) \
        if d.status == sequential.UNDECIDED else None
    return out


def upper_bound(k: int, n: int, confidence: float) -> float:
    """The fixed-sample rule: the exact one-sided upper ``confidence`` bound on the rate of an event seen ``k`` times in ``n``
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


def _check(k: int, n: int, confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a probability in (0, 1) (got {confidence!r})")
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"leaks: expected 0 <= k <= n (got k={k}, n={n})")
