"""The certified samples: a seeded uniform draw from the stated population."""

from collections import Counter

import numpy as np
import pytest

from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.certification.batches import load_aux, read_section
from guardfl.redteam.certification.sampling import Population
from guardfl.redteam.config import load_config


def test_an_update_draw_is_reproducible_under_its_seed_and_differs_across_seeds_and_updates():
    pop = Population("lfw-faces", 0, 60)
    assert pop.draw_update(3, 20, 0) == pop.draw_update(3, 20, 0)
    assert pop.draw_update(3, 20, 0) != pop.draw_update(3, 20, 1)
    assert pop.draw_update(3, 20, 0) != pop.draw_update(4, 20, 0)
    assert sorted(pop.draw_update(0, 60, 3)) == list(range(60))  # distinct within an update


def test_updates_are_independent_draws_roughly_uniform_over_the_population():
    """Each update draws from the whole population, whatever the others drew (a sample can come back: the
    updates are i.i.d., which the sequential rule needs), never the front of the population."""
    pop = Population("npz", 0, 10)
    assert pop.draw_update(0, 3, 0) != [0, 1, 2]
    counts = Counter(i for b in range(2000) for i in pop.draw_update(b, 3, 0))
    assert all(480 < counts[i] < 720 for i in range(10))  # expected 600 each
    firsts = [pop.draw_update(b, 1, 0)[0] for b in range(200)]
    assert len(set(firsts)) == 10 and any(firsts[i] == firsts[i + 1] for i in range(199))  # repeats happen


def test_the_description_names_the_population_and_each_updates_source_indices():
    pop = Population("cifar10", 100, 50, None)
    updates = {b: pop.draw_update(b, 5, 7) for b in range(3)}
    d = pop.describe(updates, 7)
    assert d["size"] == 50 and d["offset"] == 100 and d["drawn"] == 15 and d["updates"] == 3 and d["seed"] == 7
    assert all(100 <= i < 150 for i in d["indices"]) and [len(u) for u in d["per_update"]] == [5, 5, 5]


def test_more_samples_in_one_update_than_the_population_is_refused():
    with pytest.raises(ValueError, match="population of 4"):
        Population("npz", 0, 4).draw_update(0, 5, 0)


def test_the_description_gives_the_source_indices_of_a_shuffled_population():
    pop = Population("npz", 10, 4, None, shuffle=3, index=(7, 2, 13, 0))
    d = pop.describe({0: [2, 0]}, 5)
    assert d["indices"] == [13, 7] and d["shuffle"] == 3 and d["offset"] == 10


def _class_ordered_npz(path, per_class=10, classes=4):
    """An npz stored by class (as the CIFAR-10 sample in ../shared/data is): image i is the constant i / 64."""
    n = per_class * classes
    x = np.repeat(np.arange(n, dtype=np.uint8)[:, None, None, None] * 4, 8 * 8 * 3).reshape(n, 8, 8, 3)
    np.savez(path, x=x, y=np.repeat(np.arange(classes), per_class))
    return str(path)


def _split(path, shuffle):
    return load_config({"model": {"name": "fc2", "num_classes": 4},
                        "data": {"source": "npz", "path": path, "offset": 20, "shuffle": shuffle},
                        "aux": {"source": "npz", "path": path, "limit": 20, "shuffle": shuffle},
                        "attacks": [{"name": "inverting_gradients"}]})


def test_one_shuffle_on_aux_and_data_splits_a_class_ordered_file_into_disjoint_parts_of_the_same_classes(tmp_path):
    path = _class_ordered_npz(tmp_path / "ordered.npz")
    stored = _split(path, None)
    assert set(load_aux(stored).labels.tolist()) == {0, 1}  # the offsets alone: the attacker never sees classes 2, 3
    cfg = _split(path, 3)
    aux = load_aux(cfg)
    x, y, index = read_section(modality.of(cfg), cfg.data, None, num_classes=4)
    assert set(aux.labels.tolist()) == {0, 1, 2, 3} and set(y.tolist()) == {0, 1, 2, 3}
    ids = lambda images: {round(float(v) * 255 / 4) for v in images[:, 0, 0, 0]}  # noqa: E731
    assert ids(aux.images).isdisjoint(ids(x)) and ids(aux.images) | ids(x) == set(range(40))
    assert ids(x) == set(index) and all(y[i] == index[i] // 10 for i in range(len(index)))
    again = read_section(modality.of(cfg), cfg.data, None, num_classes=4)[2]
    assert again == index  # the same seed, the same split (resume, workers)


def test_a_negative_shuffle_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.shuffle.*integer >= 0") as err:
        _split(_class_ordered_npz(tmp_path / "o.npz"), -1)
    assert "\n" not in str(err.value)
