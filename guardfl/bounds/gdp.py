"""The Gaussian closed forms: mu-GDP's trade-off function and its reconstruction bound.

A Gaussian mechanism whose output moves by at most ``D`` (L2) when the target changes, with noise of std
``s`` per entry, is ``mu``-GDP with ``mu = D / s`` (Dong, Roth, Su 2022); ``steps`` adaptive uses compose
to ``mu = sqrt(steps) * D / s``. Its trade-off function is ``G_mu(a) = Phi(Phi^-1(1 - a) - mu)``, and the
reconstruction-robustness bound of an attacker whose prior succeeds with probability ``kappa`` is
(Kaissis et al. 2023, Sec. 4; Hayes, Mahloujifar, Balle 2023, Sec. 3)::

    P[success] <= 1 - G_mu(kappa) = Phi(Phi^-1(kappa) + mu).

This is exact for full-batch (unsubsampled) Gaussian noise and is the cross-check of the numerical
accountant (``guardfl.bounds.accountant``), which the certificate uses for every mechanism.

>>> round(gdp_rero(0.1, 1.0), 4)
0.3891
"""

from __future__ import annotations

import math

from scipy.special import ndtr, ndtri

from guardfl.errors import ConfigError

from guardfl.bounds.checks import check_count, check_kappa, check_positive


def gaussian_mu(sensitivity: float, sigma: float, steps: int = 1) -> float:
    """``mu = sqrt(steps) * sensitivity / sigma``: the GDP parameter of ``steps`` Gaussian mechanisms of
    L2 ``sensitivity`` and per-entry noise std ``sigma``."""
    check_positive(sigma, "sigma")
    check_positive(sensitivity, "sensitivity")
    check_count(steps, "steps")
    return math.sqrt(steps) * sensitivity / sigma


def gdp_tradeoff(alpha: float, mu: float) -> float:
    """``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``: the least type-II error of a test at type-I error
    ``alpha`` between N(0, 1) and N(mu, 1)."""
    if not 0 <= alpha <= 1:
        raise ConfigError(f"alpha: expected a probability in [0, 1] (got {alpha!r})")
    return float(ndtr(ndtri(1.0 - alpha) - mu))


def gdp_rero(kappa: float, mu: float) -> float:
    """``Phi(Phi^-1(kappa) + mu)``: the reconstruction bound of a ``mu``-GDP mechanism for a prior whose
    baseline success probability is ``kappa``."""
    check_kappa(kappa)
    if not mu >= 0 or math.isinf(mu):
        raise ConfigError(f"mu: expected a finite number >= 0 (got {mu!r})")
    return float(ndtr(ndtri(kappa) + mu))
