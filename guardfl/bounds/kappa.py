"""kappa, the prior's baseline: how often the attacker's best guess WITHOUT the client's updates already
meets the success criterion, estimated with a one-sided upper confidence bound.

The ReRo theorem needs ``kappa = sup over guesses x of P_{z ~ prior}[success(x, z)]``: the chance of the
single best fixed guess (Hayes et al. 2023, Def. 2), not the chance of an average draw (smaller, and not
what the theorem uses). ``estimate_kappa`` takes the attacker's candidate guesses (its auxiliary data), the
private samples (draws from the population the certificate speaks for) and the success predicate, counts
for each guess the private samples it already reconstructs, and bounds the best guess's rate from above:
the exact (Clopper-Pearson) one-sided bound at ``confidence``, Bonferroni-corrected over the ``G`` guesses
(each guess bounded at ``1 - (1 - confidence) / G``, so all hold together at ``confidence``). With one guess
and none of ``N`` succeeding that is about ``3 / N`` at 95%; with ``G`` guesses about ``(3 + ln G) / N``.

Assumptions, stated in every certificate: the private samples are independent draws from the population;
the best guess of any attacker is no better than the best of the given guesses (a guess outside them
could do better: the estimate then understates kappa, and the bound with it).

>>> import torch
>>> aux, private = torch.zeros(4, 1), torch.ones(100, 1)
>>> round(estimate_kappa(aux, private, lambda g, t: torch.zeros(len(g), len(t), dtype=torch.bool)).kappa, 4)
0.0429
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from scipy.special import betaincinv

from guardfl.errors import ConfigError


def kappa_upper(successes: int, trials: int, confidence: float) -> float:
    """The one-sided ``confidence`` upper bound (Clopper-Pearson) on a rate seen ``successes`` times in
    ``trials`` independent trials; 1 when ``trials`` is 0 or every trial succeeded."""
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence: expected a probability in (0, 1) (got {confidence!r})")
    if trials < 0 or not 0 <= successes <= max(trials, 0):
        raise ConfigError(f"successes: expected 0 <= successes <= trials (got {successes} of {trials})")
    if trials == 0 or successes >= trials:
        return 1.0
    if successes == 0:
        return 1.0 - (1.0 - confidence) ** (1.0 / trials)
    return float(betaincinv(successes + 1, trials - successes, confidence))


@dataclass(frozen=True)
class KappaEstimate:
    """An upper bound ``kappa`` on the prior's baseline: the best guess (index ``best``) succeeded on
    ``successes`` of ``trials`` private samples; ``guesses`` were tried; each bounded at
    ``per_guess_confidence`` so that all hold at ``confidence``."""

    kappa: float
    successes: int
    trials: int
    guesses: int
    best: int
    confidence: float
    per_guess_confidence: float

    def describe(self) -> str:
        return (f"estimated from {self.guesses} auxiliary guesses against {self.trials} private samples: the best "
                f"guess succeeds on {self.successes}; {self.confidence:.0%} upper bound {self.kappa:.4g} (Clopper-Pearson, "
                f"Bonferroni over the guesses)")


Success = Callable[..., "np.ndarray"]


def estimate_kappa(guesses, private, success: Success, confidence: float = 0.95) -> KappaEstimate:
    """An upper confidence bound on the prior's baseline from ``guesses`` (the attacker's auxiliary samples,
    ``G`` of them) and ``private`` (``N`` samples of the population), with ``success(guesses, private)`` a
    ``(G, N)`` boolean matrix: whether guess ``g`` already meets the success criterion for private sample
    ``n``."""
    g, n = len(guesses), len(private)
    if g < 1:
        raise ConfigError("aux: kappa's estimate needs at least one auxiliary sample (a guess)")
    if n < 1:
        raise ConfigError("data: kappa's estimate needs at least one private sample")
    hits = np.asarray(success(guesses, private), dtype=bool)
    if hits.shape != (g, n):
        raise ValueError(f"success: expected a ({g}, {n}) boolean matrix (got shape {hits.shape})")
    counts = hits.sum(axis=1)
    best = int(np.argmax(counts))
    per = 1.0 - (1.0 - confidence) / g
    # the upper bound grows with the count: the best guess's bound is the largest of the G bounds
    return KappaEstimate(kappa_upper(int(counts[best]), n, per), int(counts[best]), n, g, best, confidence, per)
