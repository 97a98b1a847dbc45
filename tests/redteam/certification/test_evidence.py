"""The population claim: the exact binomial bound, the sample size it needs, the verdict it supports."""

import math

import pytest
from hypothesis import given, settings, strategies as st
from scipy.stats import binomtest

from guardfl.redteam.certification import evidence


@pytest.mark.parametrize("k,n", [(0, 1), (0, 3), (0, 59), (1, 59), (2, 64), (5, 100), (10, 20), (0, 1000), (37, 500)])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_the_bound_is_scipys_one_sided_clopper_pearson(k, n, confidence):
    reference = binomtest(k, n, alternative="less").proportion_ci(confidence_level=confidence).high
    assert evidence.upper_bound(k, n, confidence) == pytest.approx(reference, rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), data=st.data(), confidence=st.floats(0.5, 0.999))
def test_the_bound_matches_scipy_and_covers_the_observed_rate(n, data, confidence):
    k = data.draw(st.integers(0, n))
    bound = evidence.upper_bound(k, n, confidence)
    reference = binomtest(k, n, alternative="less").proportion_ci(confidence_level=confidence).high
    assert bound == pytest.approx(reference, rel=1e-7, abs=1e-10)
    assert k / n <= bound <= 1.0


def test_no_leak_in_n_is_about_three_over_n_at_95_percent():
    for n in (100, 300, 1000):
        assert evidence.upper_bound(0, n, 0.95) == pytest.approx(3 / n, rel=0.02)
    assert evidence.upper_bound(3, 3, 0.95) == 1.0 and evidence.upper_bound(0, 0, 0.95) == 1.0


@pytest.mark.parametrize("rate,confidence,leaks", [(0.05, 0.95, 0), (0.1, 0.95, 0), (0.01, 0.99, 0), (0.05, 0.95, 2), (0.2, 0.9, 5)])
def test_samples_needed_is_the_fewest_that_certify(rate, confidence, leaks):
    n = evidence.samples_needed(rate, confidence, leaks)
    assert evidence.upper_bound(leaks, n, confidence) < rate <= evidence.upper_bound(leaks, n - 1, confidence)


def test_59_samples_for_5_percent_at_95_percent():
    assert evidence.samples_needed(0.05, 0.95) == 59 == math.floor(math.log(0.05) / math.log(0.95)) + 1


def test_a_claim_with_too_few_clean_updates_is_inconclusive_and_says_how_many_would_do():
    for n in (1, 20, 77):
        found = evidence.claim_evidence([0.0] * n, 0.05, 0.95, 0.05, per_update_samples=1, leaked=0, what="leak")
        assert found["status"] == evidence.INCONCLUSIVE and found["updates_needed_without_leaks"] == 78
        assert found["more_updates"]["more"] == 78 - n
    clean = evidence.claim_evidence([0.0] * 78, 0.05, 0.95, 0.05, per_update_samples=1, leaked=0, what="leak")
    assert clean["status"] == evidence.CERTIFIED and clean["more_updates"] is None and clean["upper_bound"] < 0.05


def test_updates_that_show_the_rate_above_the_claim_are_not_certified():
    found = evidence.claim_evidence([1.0, 0.0, 1.0, 1.0, 0.5], 0.05, 0.95, 0.05, per_update_samples=2, leaked=7,
                                    what="leak")
    assert found["status"] == evidence.NOT_CERTIFIED and found["lower_bound"] > 0.05
    assert found["unit"] == "update" and found["samples"] == 10 and found["updates"] == 5
    near = evidence.claim_evidence([0.0] * 60 + [1.0] * 4, 0.05, 0.95, 0.05, per_update_samples=1, leaked=4, what="leak")
    assert near["status"] == evidence.INCONCLUSIVE and near["more_updates"]["more"] is None  # 6%: close to 5%


def test_no_claim_reports_the_figures_and_decides_nothing():
    found = evidence.claim_evidence([0.0, 1.0], None, 0.95, 0.05, per_update_samples=1, leaked=1, what="leak")
    assert found["status"] == evidence.NO_CLAIM and 0 < found["upper_bound"] <= 1


@pytest.mark.parametrize("call", [lambda: evidence.upper_bound(3, 2, 0.95), lambda: evidence.upper_bound(0, 5, 1.0),
                                  lambda: evidence.samples_needed(0.0, 0.95), lambda: evidence.samples_needed(0.05, 0.0)])
def test_bad_arguments_are_refused(call):
    with pytest.raises(ValueError):
        call()
