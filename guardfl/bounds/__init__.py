"""Proven bounds on reconstruction: what a randomised defense guarantees against ANY attacker, beside what
the red team's attacks found.

Reconstruction robustness (ReRo; Balle, Cherubin, Hayes 2022; Hayes, Mahloujifar, Balle 2023): if what the
client sends is f-DP against a reference that does not depend on the target (f its trade-off function), an
attacker whose prior already succeeds with probability ``kappa`` succeeds with probability at most
``1 - f(kappa)`` (Kaissis et al. 2023); for mu-GDP that is ``Phi(Phi^-1(kappa) + mu)``.

One purpose a module:

- ``gdp``: the Gaussian closed forms (the cross-check);
- ``accountant``: composed privacy-loss distributions (``dp-accounting``) and the bound they imply;
- ``mechanisms``: which part of a defense is a mechanism, with what sensitivity, noise, rate and steps;
- ``rero``: the bound of a mechanism over rounds, and of a whole defense (``defense_bound``, ``verdict``);
- ``kappa``: the prior's baseline from auxiliary data, with an upper confidence bound;
- ``calibrate``: the least noise that proves a target bound.

>>> from guardfl.bounds import Client, defense_bound
>>> b = defense_bound({"kind": "gaussian", "sigma": 0.5, "clip": 1.0}, Client(max_rounds=1), kappa=0.01)
>>> round(b.rero, 3)
0.372
"""

from guardfl.bounds.accountant import gaussian_pld, pure_dp_pld, rero_from_pld
from guardfl.bounds.calibrate import calibrate
from guardfl.bounds.gdp import gaussian_mu, gdp_rero, gdp_tradeoff
from guardfl.bounds.kappa import KappaEstimate, estimate_kappa, kappa_upper
from guardfl.bounds.mechanisms import NO_MECHANISM, NOT_PROVEN, PROVEN, Client, Mechanism, Unbounded, analyse
from guardfl.bounds.rero import ASSUMPTION, COMPUTED, Bound, defense_bound, rero, verdict

__all__ = [
    "ASSUMPTION", "Bound", "COMPUTED", "Client", "KappaEstimate", "Mechanism", "NOT_PROVEN", "NO_MECHANISM", "PROVEN",
    "Unbounded", "analyse", "calibrate", "defense_bound", "estimate_kappa", "gaussian_mu", "gaussian_pld", "gdp_rero",
    "gdp_tradeoff", "kappa_upper", "pure_dp_pld", "rero", "rero_from_pld", "verdict",
]
