"""The certified samples: a seeded uniform draw from the stated population."""

from collections import Counter

import pytest

from guardfl.redteam.certification.sampling import Population


def test_a_draw_is_reproducible_under_its_seed_and_differs_across_seeds():
    pop = Population("lfw-faces", 0, 60)
    assert pop.draw(20, 0) == pop.draw(20, 0)
    assert pop.draw(20, 0) != pop.draw(20, 1)
    assert len(set(pop.draw(60, 3))) == 60 and sorted(pop.draw(60, 3)) == list(range(60))


def test_a_draw_is_not_the_front_of_the_population_and_is_roughly_uniform():
    pop = Population("npz", 0, 10)
    assert pop.draw(3, 0) != [0, 1, 2]
    counts = Counter(i for seed in range(2000) for i in pop.draw(3, seed))
    assert all(480 < counts[i] < 720 for i in range(10))  # expected 600 each


def test_the_description_names_the_population_and_the_source_indices():
    pop = Population("cifar10", 100, 50, None)
    d = pop.describe(pop.draw(5, 7), 7)
    assert d["size"] == 50 and d["offset"] == 100 and d["drawn"] == 5 and d["seed"] == 7
    assert all(100 <= i < 150 for i in d["indices"])


def test_more_samples_than_the_population_is_refused():
    with pytest.raises(ValueError, match="population of 4"):
        Population("npz", 0, 4).draw(5, 0)
