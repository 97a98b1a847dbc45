"""The numerical accountant: composed privacy-loss distributions (Google's ``dp-accounting``) and the
reconstruction bound they imply.

A mechanism's privacy-loss distribution (PLD) between the output with the target and a reference output
that does not depend on it gives the hockey-stick divergence ``delta(eps) = H_{e^eps}(Q || P)`` for every
``eps``. For any event ``E`` (here: "the attacker's reconstruction succeeds"), ``Q(E) <= e^eps P(E) +
delta(eps)``, so the reconstruction bound ``1 - f(kappa)`` of the trade-off function ``f`` is

    rero(kappa) = inf over eps of  kappa * e^eps + delta(eps)

(the convex conjugate form of the trade-off function; Kaissis et al. 2023, Sec. 3, and the PLD recipe of
../shared/NOTES.md). ``kappa * t + H_t`` is convex in ``t = e^eps`` (so unimodal in ``log t``): a coarse grid in
``log t`` plus a golden-section refinement finds its minimum; every evaluated point is itself a valid bound (the PLDs are built with
``pessimistic_estimate=True``: their ``delta(eps)`` is an upper bound at every ``eps``), so the answer is an
upper bound whatever the search's precision. The composition over steps is ``dp-accounting``'s own
(``self_compose``, FFT convolution with a pessimistic tail truncation of 1e-15), never a sum written here.

Mechanisms:

- ``gaussian_pld(noise_multiplier, sample_rate, steps)``: ``steps`` Poisson-subsampled Gaussian mechanisms
  of sensitivity 1 and noise ``noise_multiplier`` (DP-SGD; ``sample_rate`` 1: plain Gaussian noise on a
  clipped update). ``dp-accounting`` keeps both directions (target added, removed) and answers the larger.
- ``pure_dp_pld(epsilon, steps)``: ``steps`` mechanisms that are each ``epsilon``-DP (their tight dominating
  pair, randomised response: Kairouz et al. 2015), the conservative route for Laplace noise on an
  L2-clipped update (``guardfl.bounds.mechanisms``).

>>> round(rero_from_pld(gaussian_pld(1.0, 1.0, 1), 0.1), 4)  # = Phi(Phi^-1(0.1) + 1), the mu-GDP closed form
0.3891
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from guardfl.bounds.checks import check_count, check_kappa, check_positive, check_rate

#: the PLD's loss grid: losses are rounded up to multiples of this (pessimistic). 1e-3 agreed with 1e-4 to
#: 2e-4 (absolute) on DP-SGD at q = 0.001, 10,000 steps, and is ~10x faster
DISCRETIZATION = 1e-3
#: the most grid points one step's privacy loss spans (the grid is coarsened for weak mechanisms beyond it)
MAX_BINS = 100_000
#: the search over t = e^eps: from this up to 1 / kappa (beyond it kappa * t > 1, no bound)
T_MIN = 1e-6
GRID = 24
REFINE = 40
#: the largest composition the accountant is asked for (the round budget's limit times local steps)
MAX_STEPS = 10_000_000


@lru_cache(maxsize=128)
def gaussian_pld(noise_multiplier: float, sample_rate: float, steps: int, discretization: float | None = None):
    """The PLD of ``steps`` Poisson-subsampled Gaussian mechanisms (sensitivity 1, std ``noise_multiplier``,
    sample rate ``sample_rate``), composed by ``dp-accounting`` (``self_compose``). At ``sample_rate`` 1 the
    composition is the exact identity of Gaussian mechanisms (``steps`` of std ``z`` are one of std
    ``z / sqrt(steps)``: a rotation of the product of Gaussians), whose PLD ``dp-accounting`` builds
    directly; the tests check it against ``self_compose``. ``discretization``: None picks
    ``DISCRETIZATION``, coarser for a weak mechanism whose privacy loss spans a wide range (pessimistic
    either way: a coarser grid only loosens the bound)."""
    check_positive(noise_multiplier, "noise_multiplier")
    check_rate(sample_rate, "sample_rate")
    check_count(steps, "steps", 1, MAX_STEPS)
    if sample_rate == 1.0 and steps > 1:
        return gaussian_pld(noise_multiplier / math.sqrt(steps), 1.0, 1, discretization)
    from dp_accounting.pld import privacy_loss_distribution as pld

    mu = 1.0 / noise_multiplier  # the privacy loss of one step spans about mu^2 / 2 +- 10 mu
    disc = discretization or max(DISCRETIZATION, (mu * mu / 2 + 20 * mu) / MAX_BINS)
    single = pld.from_gaussian_mechanism(standard_deviation=float(noise_multiplier), sensitivity=1.0,
                                         sampling_prob=float(sample_rate), pessimistic_estimate=True,
                                         value_discretization_interval=disc)
    return single if steps == 1 else single.self_compose(steps)


@lru_cache(maxsize=128)
def pure_dp_pld(epsilon: float, steps: int, discretization: float = DISCRETIZATION):
    """The PLD of ``steps`` mechanisms, each ``epsilon``-DP (dominated by randomised response), composed by
    ``dp-accounting``."""
    check_positive(epsilon, "epsilon")
    check_count(steps, "steps", 1, MAX_STEPS)
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld

    # the composed losses span 2 * epsilon * steps: a coarser grid for long compositions (pessimistic)
    disc = max(discretization, 2 * epsilon * steps / MAX_BINS)
    single = pld.from_privacy_parameters(common.DifferentialPrivacyParameters(float(epsilon), 0.0),
                                         value_discretization_interval=disc)
    return single if steps == 1 else single.self_compose(steps)


def hockey_stick(pld, eps: float) -> float:
    """``delta(eps)`` of a PLD (an upper bound: pessimistic), for any real ``eps``: ``dp-accounting``'s
    ``get_delta_for_epsilon``."""
    return float(pld.get_delta_for_epsilon(float(eps)))


class _Profile:
    """``delta(eps)`` of a PLD in O(log n) a query: the suffix sums of ``dp-accounting``'s composed PMFs
    (both directions; the larger answers, as ``get_delta_for_epsilon`` does), for the ~70 queries of one
    bound. ``delta(eps) = inf + sum_{L > eps} p_L (1 - e^(eps - L))``, the formula of
    ``get_delta_for_epsilon``; ``tests/guardfl/bounds`` checks the two agree. Built from the PMFs' dense
    form (``to_dense_pmf``); a PLD without it falls back to ``hockey_stick``."""

    def __init__(self, pld) -> None:
        self.pld, self.parts = pld, []
        try:
            pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]  # noqa: SLF001
            for pmf in pmfs:
                dense = pmf.to_dense_pmf()
                probs = np.asarray(dense._probs, dtype=np.float64)  # noqa: SLF001
                losses = (np.arange(len(probs)) + dense._lower_loss) * dense._discretization  # noqa: SLF001
                lower = probs * np.exp(np.minimum(-losses, 700.0))  # the lower distribution's mass at each loss
                self.parts.append((losses, np.cumsum(probs[::-1])[::-1], np.cumsum(lower[::-1])[::-1],
                                   float(dense._infinity_mass)))  # noqa: SLF001
        except AttributeError:  # another dp-accounting layout: the public (slower) path
            self.parts = []

    def delta(self, eps: float) -> float:
        if not self.parts:
            return hockey_stick(self.pld, eps)
        out = 0.0
        for losses, upper, lower, inf in self.parts:
            i = int(np.searchsorted(losses, eps, side="right"))
            tail = 0.0 if i >= len(losses) else float(upper[i] - math.exp(eps) * lower[i])
            out = max(out, inf + max(0.0, tail))
        return out


def rero_from_pld(pld, kappa: float) -> float:
    """``inf_eps kappa e^eps + delta(eps)``, capped at 1 and at least ``kappa``: the reconstruction bound of
    the mechanism whose (pessimistic) PLD is ``pld``, for a prior of baseline ``kappa``."""
    kappa = check_kappa(kappa)
    profile = _profile(pld)
    return _minimise(lambda t: kappa * t + profile.delta(math.log(t)), T_MIN, 1.0 / kappa, kappa)


_PROFILES: dict[int, tuple[object, _Profile]] = {}


def _profile(pld) -> _Profile:
    """The PLD's ``_Profile``, kept for the PLDs the caches hold (several kappas of one PLD)."""
    hit = _PROFILES.get(id(pld))
    if hit is None or hit[0] is not pld:
        if len(_PROFILES) > 256:
            _PROFILES.clear()
        hit = _PROFILES[id(pld)] = (pld, _Profile(pld))
    return hit[1]


def _minimise(g, lo: float, hi: float, kappa: float) -> float:
    """The least value found of ``g`` (convex in ``t``, so unimodal in ``log t``) on ``[lo, hi]``: a grid in
    ``log t``, then golden section in ``log t`` around the best grid point; clipped to ``[kappa, 1]``: every value of ``g`` is a valid bound, so the least seen
    is one too."""
    logs = np.linspace(math.log(lo), math.log(hi), GRID)
    values = [g(math.exp(x)) for x in logs]
    i = int(np.argmin(values))
    best = values[i]
    a, b = float(logs[max(0, i - 1)]), float(logs[min(GRID - 1, i + 1)])
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    gc, gd = g(math.exp(c)), g(math.exp(d))
    for _ in range(REFINE):
        best = min(best, gc, gd)
        if gc <= gd:
            b, d, gd = d, c, gc
            c = b - ratio * (b - a)
            gc = g(math.exp(c))
        else:
            a, c, gc = c, d, gd
            d = a + ratio * (b - a)
            gd = g(math.exp(d))
    best = min(best, gc, gd)
    return float(min(1.0, max(kappa, best)))
