"""kappa's upper confidence bound: its coverage against a simulation with known truth, and its input."""

import numpy as np
import pytest
import torch

from guardfl.bounds import estimate_kappa, kappa_upper
from guardfl.errors import ConfigError


def test_zero_of_n_is_about_three_over_n():
    assert kappa_upper(0, 100, 0.95) == pytest.approx(1 - 0.05 ** (1 / 100))
    assert 2.9 / 100 < kappa_upper(0, 100, 0.95) < 3.1 / 100
    assert kappa_upper(100, 100, 0.95) == 1.0 and kappa_upper(0, 0, 0.95) == 1.0


@pytest.mark.parametrize("p, n", [(0.02, 60), (0.1, 59), (0.3, 200)])
def test_the_bound_covers_the_truth_at_its_confidence(p, n):
    """10,000 replications with a known success rate: the bound lies below the truth at most 5% of the time
    (Clopper-Pearson is conservative: the miss rate is at most 1 - confidence)."""
    rng = np.random.default_rng(1)
    counts = rng.binomial(n, p, 10_000)
    misses = np.mean([kappa_upper(int(k), n, 0.95) < p for k in counts])
    assert misses <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 10_000)


def test_the_best_of_many_guesses_is_bounded_together():
    """G guesses, one of them good (rate 0.2), the others never succeed: the estimate covers the best guess's
    rate at 95% over replications (Bonferroni), and names it."""
    rng = np.random.default_rng(2)
    misses = 0
    for _ in range(2000):
        hits = np.zeros((20, 50), dtype=bool)
        hits[7] = rng.random(50) < 0.2
        est = estimate_kappa(np.zeros(20), np.zeros(50), lambda g, t, h=hits: h)
        misses += est.kappa < 0.2
        assert est.guesses == 20 and est.trials == 50
    assert misses / 2000 <= 0.05


def test_the_predicate_decides_with_tensors():
    aux = torch.tensor([[0.0], [1.0], [2.0]])
    private = torch.tensor([[1.0], [1.05], [5.0], [0.98]])
    close = lambda g, t: (torch.cdist(g, t) < 0.1).numpy()  # noqa: E731
    est = estimate_kappa(aux, private, close)
    assert (est.best, est.successes, est.trials) == (1, 3, 4)
    assert est.kappa == pytest.approx(kappa_upper(3, 4, 1 - 0.05 / 3))


def test_bad_input_is_one_line():
    for call, field in ((lambda: kappa_upper(1, 10, 1.0), "confidence"), (lambda: kappa_upper(11, 10, 0.9), "successes"),
                        (lambda: estimate_kappa([], [1], lambda g, t: None), "aux"),
                        (lambda: estimate_kappa([1], [], lambda g, t: None), "data")):
        with pytest.raises(ConfigError) as info:
            call()
        assert field in str(info.value) and "\n" not in str(info.value)
