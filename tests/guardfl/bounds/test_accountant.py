"""The numerical accountant against two independent computations (Opacus's PRV accountant, and a Monte
Carlo of the Neyman-Pearson test between the two worlds, Hayes et al. 2023's estimator) and its monotonicity."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from guardfl.bounds import gaussian_pld, pure_dp_pld, rero_from_pld
from guardfl.bounds.mechanisms import Mechanism
from guardfl.bounds.rero import rero

#: the PLD (dp-accounting, pessimistic) against Opacus's PRV accountant (an estimate, eps_error 0.01)
PRV_TOLERANCE = 1e-3


def _prv_rero(z: float, q: float, steps: int, kappa: float) -> float:
    """The bound from Opacus's PRV accountant: its discrete PRV's delta estimate on a grid of eps."""
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(z, q, steps)]
    dprv = acc._get_dprv(eps_error=0.01, delta_error=1e-7)
    with np.errstate(divide="ignore"):
        return min(1.0, min(kappa * math.exp(e) + float(dprv.compute_delta_estimate(e))
                            for e in np.linspace(-2, math.log(1 / kappa), 600)))


@pytest.mark.parametrize("z, q, steps", [(1.0, 0.01, 1000), (2.0, 0.1, 100), (0.8, 0.05, 200)])
@pytest.mark.parametrize("kappa", [0.1, 0.01])
def test_subsampled_gaussian_matches_opacus_prv(z, q, steps, kappa):
    ours = rero_from_pld(gaussian_pld(z, q, steps), kappa)
    assert ours == pytest.approx(_prv_rero(z, q, steps, kappa), abs=PRV_TOLERANCE)


def _monte_carlo(z: float, q: float, steps: int, kappa: float, n: int, seed: int = 0) -> tuple[float, float]:
    """The best test's power at level kappa between P = N(0, z^2)^T (target absent) and Q = ((1 - q) N(0, z^2)
    + q N(1, z^2))^T, by sampling P: the likelihood ratios' lowest (1 - kappa) share (Neyman-Pearson),
    1 - E_P[LR; lowest] (Hayes et al. 2023, Sec. 3.2); and its standard error."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, z, (n, steps))
    log_lr = np.log1p(q * np.expm1((2 * x - 1) / (2 * z * z))).sum(1)
    lr = np.sort(np.exp(log_lr))
    keep = lr[: int(n * (1 - kappa))]
    tail = np.concatenate([keep, np.zeros(n - len(keep))])
    return 1.0 - tail.mean(), tail.std() / math.sqrt(n)


@pytest.mark.parametrize("z, q, steps", [(1.0, 0.1, 20), (2.0, 0.5, 10), (0.7, 0.02, 50)])
def test_subsampled_gaussian_matches_a_monte_carlo_of_the_two_worlds(z, q, steps):
    kappa = 0.1
    mc, se = _monte_carlo(z, q, steps, kappa, 200_000)
    ours = rero_from_pld(gaussian_pld(z, q, steps), kappa)
    assert mc - 4 * se - 1e-3 <= ours <= mc + 4 * se + 2e-3


def _gauss(z, q=1.0, steps=1):
    return Mechanism(leaf="t", noise="gaussian", sample_rate=q, steps_per_round=steps, reference="", description="",
                     noise_multiplier=z)


@settings(max_examples=12, deadline=None)
@given(z1=st.floats(0.3, 8), z2=st.floats(0.3, 8), q=st.sampled_from([1.0, 0.2, 0.05]), kappa=st.floats(1e-3, 0.5))
def test_bound_falls_with_noise(z1, z2, q, kappa):
    lo, hi = sorted((z1, z2))
    assert rero(_gauss(hi, q, 4), kappa, 2) <= rero(_gauss(lo, q, 4), kappa, 2) + 1e-6


@settings(max_examples=12, deadline=None)
@given(r1=st.integers(1, 64), r2=st.integers(1, 64), q=st.sampled_from([1.0, 0.1]), kappa=st.floats(1e-3, 0.5))
def test_bound_rises_with_rounds(r1, r2, q, kappa):
    lo, hi = sorted((r1, r2))
    assert rero(_gauss(2.0, q), kappa, lo) <= rero(_gauss(2.0, q), kappa, hi) + 1e-6


@settings(max_examples=20, deadline=None)
@given(k1=st.floats(1e-4, 0.95), k2=st.floats(1e-4, 0.95), z=st.sampled_from([0.7, 2.0, 6.0]))
def test_bound_rises_with_kappa_and_never_falls_below_it(k1, k2, z):
    lo, hi = sorted((k1, k2))
    m = _gauss(z, 0.1, 8)
    assert lo <= rero(m, lo, 3) <= rero(m, hi, 3) + 1e-6 <= 1 + 1e-6


def test_pure_dp_matches_its_closed_form_for_one_step():
    """One eps-DP step: 1 - f(kappa) = min(1, e^eps kappa, 1 - e^-eps (1 - kappa)) (randomised response)."""
    for eps in (0.1, 1.0, 3.0):
        for kappa in (0.01, 0.2, 0.6):
            closed = min(1.0, math.exp(eps) * kappa, 1 - math.exp(-eps) * (1 - kappa))
            assert rero_from_pld(pure_dp_pld(eps, 1), kappa) == pytest.approx(closed, abs=2e-3 * max(1, eps))


@pytest.mark.parametrize("args", [(0.47, 0.001, 256), (1.0, 1.0, 1), (2.0, 0.1, 100), (0.8, 0.05, 200)])
def test_the_fast_profile_is_dp_accountings_own_delta(args):
    """The suffix-sum evaluation ``rero_from_pld`` queries agrees with ``get_delta_for_epsilon``."""
    from guardfl.bounds.accountant import _Profile, hockey_stick

    pld = gaussian_pld(*args)
    profile = _Profile(pld)
    assert profile.parts  # the fast path, not the fallback
    for eps in np.linspace(-5, 10, 61):
        assert profile.delta(eps) == pytest.approx(hockey_stick(pld, eps), abs=1e-12)
    assert rero_from_pld(pure_dp_pld(1.0, 10), 0.1) == pytest.approx(
        min(1.0, min(0.1 * math.exp(e) + hockey_stick(pure_dp_pld(1.0, 10), e) for e in np.linspace(-3, 2.3, 2000))), abs=1e-3)
