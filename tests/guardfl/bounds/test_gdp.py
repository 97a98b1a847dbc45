"""The Gaussian closed forms: values, limits, and the accountant for full-batch Gaussian noise."""

import math

import pytest
from hypothesis import given, settings, strategies as st
from scipy.stats import norm

from guardfl.bounds import gaussian_mu, gaussian_pld, gdp_rero, gdp_tradeoff, rero_from_pld
from guardfl.errors import ConfigError

#: the accountant (pessimistic PLD on a 1e-3 loss grid) against the closed form, full batch: it may only be
#: above (an upper bound) and by at most this much
TOLERANCE = 2e-4


def test_closed_form_values_and_limits():
    assert gdp_rero(0.1, 1.0) == pytest.approx(norm.cdf(norm.ppf(0.1) + 1.0), abs=1e-12)
    assert gdp_rero(0.3, 0.0) == pytest.approx(0.3)  # no information: the prior's baseline
    assert gdp_rero(0.5, 10.0) == pytest.approx(1.0)
    assert gaussian_mu(2.0, 1.0, 4) == pytest.approx(4.0)  # sqrt(4) * 2 / 1
    # 1 - f(kappa) with f the trade-off function
    assert 1 - gdp_tradeoff(0.1, 1.3) == pytest.approx(gdp_rero(0.1, 1.3), abs=1e-12)


@pytest.mark.parametrize("z, steps", [(1.0, 1), (2.0, 4), (5.0, 100), (0.5, 1), (8.0, 16)])
@pytest.mark.parametrize("kappa", [0.5, 0.1, 0.01, 1e-3])
def test_accountant_matches_the_gdp_closed_form_at_full_batch(z, steps, kappa):
    closed = gdp_rero(kappa, math.sqrt(steps) / z)
    numeric = rero_from_pld(gaussian_pld(z, 1.0, steps), kappa)
    assert closed - 1e-9 <= numeric <= closed + TOLERANCE


@pytest.mark.parametrize("z, steps", [(2.0, 4), (4.0, 10)])
def test_the_accountants_own_composition_agrees_with_the_gaussian_identity(z, steps):
    """``gaussian_pld`` composes full-batch steps by the exact identity (one Gaussian of std z / sqrt(T));
    dp-accounting's ``self_compose`` of T single steps gives the same bound."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    composed = pld.from_gaussian_mechanism(z, sensitivity=1.0, value_discretization_interval=1e-3).self_compose(steps)
    for kappa in (0.1, 0.01):
        assert rero_from_pld(composed, kappa) == pytest.approx(rero_from_pld(gaussian_pld(z, 1.0, steps), kappa), abs=TOLERANCE)


@settings(max_examples=30)
@given(kappa=st.floats(1e-4, 0.9), mu1=st.floats(0, 5), mu2=st.floats(0, 5), k2=st.floats(1e-4, 0.9))
def test_closed_form_is_monotone_in_mu_and_kappa(kappa, mu1, mu2, k2):
    lo, hi = sorted((mu1, mu2))
    assert gdp_rero(kappa, lo) <= gdp_rero(kappa, hi) + 1e-12
    a, b = sorted((kappa, k2))
    assert gdp_rero(a, mu1) <= gdp_rero(b, mu1) + 1e-12
    assert gdp_rero(kappa, mu1) >= kappa - 1e-12


@pytest.mark.parametrize("kappa", [0, 1, -0.1, 1.5, float("nan"), True])
def test_kappa_outside_the_open_interval_is_one_line(kappa):
    with pytest.raises(ConfigError) as info:
        gdp_rero(kappa, 1.0)
    assert "kappa" in str(info.value) and "(0, 1)" in str(info.value) and "\n" not in str(info.value)


def test_zero_noise_is_refused():
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="sigma"):
            gaussian_mu(1.0, bad)
        with pytest.raises(ConfigError, match="noise_multiplier"):
            gaussian_pld(bad, 1.0, 1)
