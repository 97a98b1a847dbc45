"""Anytime-valid decisions on a bounded mean: the sequential rule a certificate's claims are decided by.

A run attacks client updates one round after another. Each attacked update ``t`` gives a number
``x_t`` in [0, 1]: the share of its private samples that leaked (or were re-identified). The updates are
drawn independently (``sampling``): each is a fresh batch of the population with the client's own fresh
randomness, so ``x_1, x_2, ...`` are i.i.d. with mean ``p``, the deployment's leak rate. A claim says
``p < c``. After every round the rule asks two questions, each a test whose error holds however often
it is asked and whenever the run stops (a test supermartingale and Ville's inequality, so peeking after
every round costs nothing):

- **certify** (reject ``p >= c``): the capital ``K_t(c) = sum_j w_j prod_i (1 + u_j (c - x_i) / (1 - c))``,
  a mixture over constant bets ``u_j`` in (0, 1). Under ``p >= c`` each factor has mean <= 1, so ``K_t`` is a
  nonnegative supermartingale started at 1, and ``P[sup_t K_t >= 1/alpha] <= alpha``: the claim is
  certified falsely with probability at most ``alpha = 1 - confidence``.
- **refute** (reject ``p <= c``): ``K'_t(c) = sum_j w'_j prod_i (1 + u_j (x_i - c) / c)``, likewise: a true
  claim is refuted with probability at most ``alpha``.

Each factor is the likelihood ratio of a Bernoulli alternative against the boundary ``c`` (for 0/1 data,
``1 + u (c - x) / (1 - c)`` is exactly ``(q / c)^x ((1 - q) / (1 - c))^(1 - x)`` with ``q = c (1 - u)``), so
the mixture is the betting form of a mixture likelihood-ratio test (Waudby-Smith and Ramdas 2023,
"Estimating means of bounded random variables by betting", JRSS-B, Sec. 4, mixtures of constant bets;
Robbins 1970 for the mixture); it holds for any [0, 1] values, not only 0/1. A mixture of constant bets
is a symmetric function of the observations: the verdict depends on which updates were attacked, never
on the order their attacks finished in (worker processes, Ray). Inverting the tests over ``c`` gives a
confidence sequence: ``upper`` is the least ``m`` at which ``p >= m`` is rejected, ``lower`` the largest
``m`` at which ``p <= m`` is. Weights: ``w_j`` proportional to ``u_j`` on the certify side (a little more
on the bolder bets: 39 clean updates certify a 10% claim at 95%, 43 with uniform weights; the fixed-sample
Clopper-Pearson rule, which may not peek, needs 29), uniform ``w'_j`` on the refute side (2 updates that
all leak refute it, 5 at a leak rate of one half). Grid: ``GRID`` midpoints.

Pure functions on plain sequences; ``judge`` applies them, ``bench/bench_sequential.py`` measures their
error rates and sample sizes on simulated populations with known rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

#: the bets of the mixtures (midpoints of (0, 1))
GRID = 200
_U = (np.arange(GRID) + 0.5) / GRID
_W_CERTIFY = _U / _U.sum()
_W_REFUTE = np.full(GRID, 1.0 / GRID)

#: the verdicts of one claim
CERTIFIED, REFUTED, UNDECIDED = "certified", "refuted", "undecided"


def _values(xs: Iterable[float]) -> np.ndarray:
    x = np.asarray(list(xs), dtype=np.float64)
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0 or x.max() > 1):
        raise ValueError(f"observations: expected values in [0, 1] (got {x.min()!r}..{x.max()!r})")
    return x


def _log_mixtures(log_terms: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Row-wise ``_log_mixture`` of a 2-D array (rows: capitals, columns: bets)."""
    m = log_terms.max(1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = m_safe[:, 0] + np.log(np.sum(weights * np.exp(log_terms - m_safe), axis=1))
    return np.where(np.isfinite(m[:, 0]), out, -np.inf)


def _log_mixture(log_terms: np.ndarray, weights: np.ndarray) -> float:
    """log sum_j w_j exp(log_terms[j]), stably (-inf terms allowed)."""
    m = np.max(log_terms)
    if not np.isfinite(m):
        return -math.inf
    return float(m + math.log(float(np.sum(weights * np.exp(log_terms - m)))))


def log_capital_certify(xs: Sequence[float] | np.ndarray, c: float) -> float:
    """log K_t(c): the capital against ``p >= c`` after the observations ``xs`` (0 with none)."""
    x = _values(xs)
    if not 0 < c < 1:
        raise ValueError(f"claim: expected a rate in (0, 1) (got {c!r})")
    with np.errstate(divide="ignore"):
        logs = np.log1p(_U[:, None] * ((c - x)[None, :] / (1 - c))).sum(1) if x.size else np.zeros(GRID)
    return _log_mixture(logs, _W_CERTIFY)


def log_capital_refute(xs: Sequence[float] | np.ndarray, c: float) -> float:
    """log K'_t(c): the capital against ``p <= c`` after the observations ``xs`` (0 with none)."""
    x = _values(xs)
    if not 0 < c < 1:
        raise ValueError(f"claim: expected a rate in (0, 1) (got {c!r})")
    with np.errstate(divide="ignore"):
        logs = np.log1p(_U[:, None] * ((x - c)[None, :] / c)).sum(1) if x.size else np.zeros(GRID)
    return _log_mixture(logs, _W_REFUTE)


def _bisect(pred, lo: float, hi: float, iters: int = 50) -> float:
    """The boundary of a predicate monotone on (lo, hi): ``pred(lo)`` False, ``pred(hi)`` True."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi


def upper_bound(xs: Sequence[float], alpha: float) -> float:
    """The confidence sequence's upper end: the least ``m`` with ``K_t(m) >= 1/alpha`` (``p >= m``
    rejected); 1.0 when none is. ``K_t(m)`` grows with ``m`` (each factor does), so bisection finds it."""
    x = _values(xs)
    level = math.log(1 / alpha)
    if x.size == 0 or log_capital_certify(x, 1 - 1e-9) < level:
        return 1.0
    return _bisect(lambda m: log_capital_certify(x, m) >= level, 1e-12, 1 - 1e-9)


def lower_bound(xs: Sequence[float], alpha: float) -> float:
    """The confidence sequence's lower end: the largest ``m`` with ``K'_t(m) >= 1/alpha`` (``p <= m``
    rejected); 0.0 when none is. ``K'_t(m)`` falls as ``m`` grows."""
    x = _values(xs)
    level = math.log(1 / alpha)
    if x.size == 0 or log_capital_refute(x, 1e-9) < level:
        return 0.0
    # the boundary of "not rejected" (monotone: True above it)
    return _bisect(lambda m: log_capital_refute(x, m) < level, 1e-9, 1 - 1e-12)


@dataclass(frozen=True)
class Decision:
    """One claim after ``t`` observations: its status, the two capitals (as e-values), the confidence
    sequence's two ends, and the levels used."""

    status: str
    n: int
    mean: float | None
    e_certify: float
    e_refute: float
    upper: float
    lower: float
    alpha_certify: float
    alpha_refute: float
    claim: float
    extra: dict = field(default_factory=dict)


def decide(xs: Sequence[float], claim: float, alpha_certify: float, alpha_refute: float | None = None) -> Decision:
    """The claim ``p < claim`` after the observations ``xs``: CERTIFIED when the capital against
    ``p >= claim`` reached ``1/alpha_certify``, REFUTED when the capital against ``p <= claim`` reached
    ``1/alpha_refute`` (default: ``alpha_certify``), else UNDECIDED (also, to be safe, if both did: no data
    seen in the simulations of ``bench_sequential`` did both)."""
    x = _values(xs)
    alpha_refute = alpha_certify if alpha_refute is None else alpha_refute
    for name, a in (("alpha_certify", alpha_certify), ("alpha_refute", alpha_refute)):
        if not 0 < a < 1:
            raise ValueError(f"{name}: expected a level in (0, 1) (got {a!r})")
    lc, lr = log_capital_certify(x, claim), log_capital_refute(x, claim)
    certified, refuted = lc >= math.log(1 / alpha_certify), lr >= math.log(1 / alpha_refute)
    status = CERTIFIED if certified and not refuted else REFUTED if refuted and not certified else UNDECIDED
    return Decision(status=status, n=int(x.size), mean=float(x.mean()) if x.size else None,
                    e_certify=float(math.exp(min(lc, 700))), e_refute=float(math.exp(min(lr, 700))),
                    upper=upper_bound(x, alpha_certify), lower=lower_bound(x, alpha_refute),
                    alpha_certify=alpha_certify, alpha_refute=alpha_refute, claim=claim)


def zero_leak_updates(claim: float, alpha: float, limit: int = 1_000_000) -> int | None:
    """The fewest observations, all 0, that certify ``p < claim``: no budget below it can certify.
    None when none up to ``limit`` does. log K_t grows with t for all-zero data: bisection."""
    level = math.log(1 / alpha)

    def ok(n: int) -> bool:
        return _log_mixture(n * np.log1p(_U * claim / (1 - claim)), _W_CERTIFY) >= level

    if not ok(limit):
        return None
    lo, hi = 0, 1
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def more_needed(xs: Sequence[float], claim: float, alpha_certify: float, alpha_refute: float, *,
                seed: int = 0, simulations: int = 200, cap: int | None = None) -> dict:
    """How many more observations would most likely decide an undecided claim: continuations of ``xs``
    drawn from its own empirical distribution (the plug-in estimate of the population; with no observation
    yet, nothing can be said), each run until it decides or ``cap`` more (default: 10x the observations
    so far, at least 100); the median of those that decided, and the share that did. Seeded, so a
    certificate says the same thing every time it is rebuilt."""
    x = _values(xs)
    if x.size == 0:
        return {"more": None, "decides": None, "note": "no update attacked yet"}
    cap = cap or max(100, 10 * x.size)
    rng = np.random.default_rng(seed)
    lc_level, lr_level = math.log(1 / alpha_certify), math.log(1 / alpha_refute)
    # running per-bet log capitals, continued one draw at a time (vectorised over simulations)
    with np.errstate(divide="ignore"):
        base_c = np.log1p(_U[:, None] * ((claim - x)[None, :] / (1 - claim))).sum(1)
        base_r = np.log1p(_U[:, None] * ((x - claim)[None, :] / claim)).sum(1)
    run_c = np.repeat(base_c[None, :], simulations, axis=0)
    run_r = np.repeat(base_r[None, :], simulations, axis=0)
    first = np.zeros(simulations, dtype=np.int64)
    for step in range(1, cap + 1):  # one draw per continuation at a time: memory O(simulations x GRID)
        live = first == 0
        if not live.any():
            break
        draw = rng.choice(x, size=int(live.sum()), replace=True)[:, None]
        with np.errstate(divide="ignore"):
            run_c[live] += np.log1p(_U[None, :] * ((claim - draw) / (1 - claim)))
            run_r[live] += np.log1p(_U[None, :] * ((draw - claim) / claim))
        done = (_log_mixtures(run_c[live], _W_CERTIFY) >= lc_level) | (_log_mixtures(run_r[live], _W_REFUTE) >= lr_level)
        idx = np.flatnonzero(live)[done]
        first[idx] = step
    ok = first[first > 0]
    share = float(ok.size / simulations)
    likely = share >= 0.5  # "most likely": the median continuation decides
    return {"more": int(np.median(first[first > 0])) if likely else None, "decides": share,
            "within": cap, "simulations": simulations,
            "note": (f"{share:.0%} of continuations drawn from the updates attacked so far (their empirical "
                     f"distribution) decide within {cap} more; the median one after the figure given" if likely else
                     f"only {share:.0%} of continuations drawn from the updates attacked so far decide within {cap} "
                     f"more updates: the leak rate looks close to the claim {claim:g}")}
