"""The sequential rule (``certification.sequential``): its error rates against populations of known rate,
computed exactly (a dynamic programme over every 0/1 path) and simulated (shares of correlated samples),
and the properties of its capitals and bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from guardfl.redteam.certification import evidence, sequential


def _crossing_probability(p: float, claim: float, alpha: float, budget: int, side: str) -> float:
    """Exactly P[the rule says ``side`` at some n <= budget] for i.i.d. Bernoulli(p) updates: the capital of
    0/1 data depends on (n, k) only, so a dynamic programme over k carries the mass of the paths not yet
    decided (independent of the implementation's bisection and of any simulation)."""
    level = math.log(1 / alpha)
    alive = np.zeros(budget + 1)
    alive[0] = 1.0
    crossed = 0.0
    for n in range(1, budget + 1):
        nxt = np.zeros(budget + 1)
        nxt[1:] += alive[:-1] * p
        nxt[:] += alive * (1 - p)
        for k in range(n + 1):
            if nxt[k] == 0:
                continue
            xs = [1.0] * k + [0.0] * (n - k)
            cap = sequential.log_capital_certify(xs, claim) if side == "certify" else sequential.log_capital_refute(xs, claim)
            if cap >= level:
                crossed += nxt[k]
                nxt[k] = 0.0
        alive = nxt
    return crossed


def _certifies(xs, claim: float, alpha: float = 0.05) -> bool:
    """``decide``'s certify test alone (no bounds computed): the capital reached 1/alpha."""
    return sequential.log_capital_certify(xs, claim) >= math.log(1 / alpha)


@settings(max_examples=10, deadline=None)
@given(claim=st.floats(0.03, 0.5), ratio=st.floats(1.0, 3.0), budget=st.integers(5, 120))
def test_false_certified_rate_over_rates_and_budgets(claim, ratio, budget):
    """Property: for any claim, any population at or above it, any budget, the exact probability that the
    rule ever certifies is at most alpha."""
    assert _crossing_probability(min(0.99, claim * ratio), claim, 0.05, budget, "certify") <= 0.05


@pytest.mark.parametrize("claim", [0.05, 0.1, 0.3])
@pytest.mark.parametrize("ratio", [1.0, 1.1, 2.0])
def test_false_certified_rate_is_below_alpha_exactly(claim, ratio):
    """A population that leaks at or above the claim (1x, 1.1x, 2x) is certified with probability <= 5% over
    the whole budget, however often the rule looks: computed exactly over every path."""
    p = min(0.95, claim * ratio)
    assert _crossing_probability(p, claim, 0.05, 150, "certify") <= 0.05


@pytest.mark.parametrize("ratio", [0.5, 0.9, 1.0])
def test_false_refuted_rate_is_below_alpha_exactly(ratio):
    """A population that leaks at or below the claim is refuted with probability <= 5%."""
    assert _crossing_probability(0.1 * ratio, 0.1, 0.05, 150, "refute") <= 0.05


def test_peeking_at_clopper_pearson_after_every_round_errs_more_than_the_sequential_rule():
    """The fixed-sample rule, looked at after every round, certifies a population leaking at exactly the
    claim more often than its 5% (the reason for the sequential rule); the sequential rule stays below."""
    rng = np.random.default_rng(0)
    claim, ends, runs = 0.1, [4, 8, 16, 32, 48, 64, 76], 2000
    peeking = sequential_errors = 0
    for _ in range(runs):
        x = (rng.random(76) < claim).astype(float)
        peeking += any(evidence.upper_bound(int(x[:e].sum()), e, 0.95) < claim for e in ends)
        sequential_errors += any(_certifies(x[:e], claim) for e in ends)
    assert sequential_errors / runs <= 0.05
    assert peeking / runs > sequential_errors / runs


@settings(max_examples=12, deadline=None)
@given(rate=st.floats(0.05, 0.4), ratio=st.sampled_from([1.0, 1.5, 3.0]), per_update=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**16))
def test_correlated_samples_in_an_update_do_not_inflate_false_certification(rate, ratio, per_update, seed):
    """Updates whose samples leak together (a whole batch leaks at once with probability ``p``, else a few of
    its samples): the per-update share is what the rule averages, so a deployment at or above the claim is
    certified in at most 5% of simulated runs (plus three standard errors)."""
    rng = np.random.default_rng(seed)
    p = min(0.9, rate * ratio)
    runs, budget = 200, 60
    wrong = 0
    for _ in range(runs):
        whole = rng.random(budget) < p / 2  # a trap that reads the whole batch
        some = rng.binomial(per_update, p / 2, budget) / per_update  # independent leaks, mean p / 2
        shares = np.where(whole, 1.0, some)
        truth = p / 2 + (1 - p / 2) * p / 2  # the mean share per update: the claim at exactly the truth
        claim = min(truth, 0.95)
        wrong += any(_certifies(shares[:e], claim) for e in (8, 16, 32, 60))
    assert wrong / runs <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.floats(0, 1), min_size=1, max_size=30), claim=st.floats(0.02, 0.9))
def test_capitals_are_monotone_in_the_claim_and_order_free(xs, claim):
    """The capital against ``p >= m`` grows with m, the one against ``p <= m`` falls; both are symmetric in
    the observations (the verdict does not depend on the order jobs finished in)."""
    a = sequential.log_capital_certify(xs, claim)
    assert sequential.log_capital_certify(xs, min(0.99, claim + 0.05)) >= a - 1e-9
    assert sequential.log_capital_refute(xs, min(0.99, claim + 0.05)) <= sequential.log_capital_refute(xs, claim) + 1e-9
    assert sequential.log_capital_certify(list(reversed(xs)), claim) == pytest.approx(a, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.floats(0, 1), min_size=1, max_size=40))
def test_bounds_hold_the_mean_and_match_the_decision(xs):
    lo, hi = sequential.lower_bound(xs, 0.05), sequential.upper_bound(xs, 0.05)
    assert 0 <= lo <= np.mean(xs) + 1e-9 and np.mean(xs) - 1e-9 <= hi <= 1
    for claim in (0.05, 0.2, 0.5):
        d = sequential.decide(xs, claim, 0.05)
        if d.status == sequential.CERTIFIED:
            assert hi <= claim + 1e-6
        if d.status == sequential.REFUTED:
            assert lo >= claim - 1e-6


def test_leak_free_updates_needed():
    """38 clean updates certify a 10% claim at 95%, 78 a 5% claim; the fixed-sample rule's 29 and 59 are the
    floor no anytime rule beats (its zero-leak count is the least any valid rule needs: (1 - c)^n <= alpha)."""
    assert sequential.zero_leak_updates(0.1, 0.05) == 38
    assert sequential.zero_leak_updates(0.05, 0.05) == 78
    for claim in (0.05, 0.1, 0.2):
        floor = math.ceil(math.log(0.05) / math.log(1 - claim))
        assert sequential.zero_leak_updates(claim, 0.05) >= floor
    assert sequential.decide([0.0] * 37, 0.1, 0.05).status == sequential.UNDECIDED
    assert sequential.decide([0.0] * 38, 0.1, 0.05).status == sequential.CERTIFIED


def test_a_leaking_client_is_refuted_within_a_few_updates():
    assert sequential.decide([1.0, 1.0], 0.1, 0.05).status == sequential.REFUTED
    assert sequential.decide([1.0, 0.0, 1.0, 1.0], 0.1, 0.025).status == sequential.REFUTED


def test_more_needed_is_seeded_and_says_when_it_cannot_tell():
    a = sequential.more_needed([0.0] * 10, 0.1, 0.05, 0.05, seed=3)
    assert a == sequential.more_needed([0.0] * 10, 0.1, 0.05, 0.05, seed=3)
    assert a["more"] == 28 and a["decides"] == 1.0  # 10 + 28 = 38 clean updates
    near = sequential.more_needed([0.0] * 7 + [1.0], 0.1, 0.05, 0.05)
    assert near["more"] is None and "close to the claim" in near["note"]


@pytest.mark.parametrize("bad", [[-0.1], [1.5], [float("nan")]])
def test_observations_outside_the_unit_interval_are_refused(bad):
    with pytest.raises(ValueError, match="observations"):
        sequential.decide(bad, 0.1, 0.05)
