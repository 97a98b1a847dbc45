"""The utility side of a sweep (``guardfl.redteam.sweep.utility``, issue 17): the built-in labelled task
(LFW faces vs non-faces), disjoint seeded train/test splits, accuracy, and training with a defense through
the real client path (``local_update``), reproducibly and without touching the global RNG."""

import math

import numpy as np
import pytest
import torch

from guardfl.errors import ConfigError
from guardfl.redteam.config import load_config
from guardfl.redteam.sweep.config import UtilitySection
from guardfl.redteam.sweep.utility import accuracy, evaluate, lfw_detection, load_task

pytestmark = pytest.mark.filterwarnings("ignore")  # Opacus's warnings about secure RNG and hooks


def red(model="fc2", num_classes=10):
    return load_config({"model": {"name": model, "num_classes": num_classes},
                        "data": {"source": "lfw-faces", "limit": 8}, "attacks": ["idlg"]}).model_dump(mode="json")


def rows(x):
    return {tuple(r.tolist()) for r in x.reshape(len(x), -1)}


@pytest.fixture(scope="module")
def small():
    """The task of the evaluate tests: fc2 on 60 training and 20 test images, 2 epochs, one training."""
    u = UtilitySection(train=60, test=20, epochs=2, repeats=1)
    r = red()
    return u, r, load_task(u, r)


def test_lfw_detection():
    x, y = lfw_detection()
    assert x.shape == (200, 1, 25, 25) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.long and y.shape == (200,)
    assert torch.equal(y[:100], torch.ones(100, dtype=torch.long))
    assert torch.equal(y[100:], torch.zeros(100, dtype=torch.long))
    assert len(rows(x)) == 200  # 200 distinct images (the disjointness checks below rely on it)


def test_load_task_splits_disjointly_and_reproducibly():
    u = UtilitySection(train=150, test=50, seed=3)
    xtr, ytr, xte, yte = load_task(u, red())
    assert xtr.shape == (150, 1, 25, 25) and ytr.shape == (150,)
    assert xte.shape == (50, 1, 25, 25) and yte.shape == (50,)
    assert not rows(xtr) & rows(xte)
    x, y = lfw_detection()
    by_image = {tuple(r.tolist()): int(label) for r, label in zip(x.reshape(200, -1), y)}
    assert all(by_image[tuple(r.tolist())] == int(label) for r, label in zip(xtr.reshape(150, -1), ytr))
    assert 0 < int(ytr.sum()) < 150  # shuffled: both classes in training
    again = load_task(u, red())
    assert all(torch.equal(a, b) for a, b in zip((xtr, ytr, xte, yte), again))
    other = load_task(UtilitySection(train=150, test=50, seed=4), red())
    assert not torch.equal(xtr, other[0])
    small = load_task(UtilitySection(train=20, test=10, seed=3), red())
    assert small[0].shape[0] == 20 and small[2].shape[0] == 10 and not rows(small[0]) & rows(small[2])


def test_load_task_refuses_more_than_the_data():
    with pytest.raises(ConfigError) as info:
        load_task(UtilitySection(train=150, test=51), red())
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("sweep.utility") and "200 samples" in msg and "201" in msg


def _npz(tmp_path, labels):
    path = tmp_path / "task.npz"
    images = np.random.default_rng(0).integers(0, 256, size=(len(labels), 8, 8, 1), dtype=np.uint8)
    np.savez(path, x=images, y=np.asarray(labels, dtype=np.int64))
    return str(path)


def test_load_task_from_an_npz(tmp_path):
    path = _npz(tmp_path, [i % 3 for i in range(30)])
    xtr, ytr, xte, yte = load_task(UtilitySection(source="npz", path=path, train=20, test=10), red(num_classes=3))
    assert xtr.shape == (20, 1, 8, 8) and xte.shape == (10, 1, 8, 8)
    assert float(xtr.max()) <= 1.0 and sorted(torch.cat([ytr, yte]).tolist()) == sorted(i % 3 for i in range(30))


def test_load_task_refuses_labels_beyond_num_classes(tmp_path):
    path = _npz(tmp_path, [i % 12 for i in range(30)])
    with pytest.raises(ConfigError) as info:
        load_task(UtilitySection(source="npz", path=path, train=20, test=10), red(num_classes=10))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("sweep.utility") and "11" in msg and "num_classes=10" in msg


def test_load_task_refuses_negative_labels(tmp_path):
    path = _npz(tmp_path, [-1] + [i % 2 for i in range(29)])
    with pytest.raises(ConfigError) as info:
        load_task(UtilitySection(source="npz", path=path, train=20, test=10), red(num_classes=2))
    assert "\n" not in str(info.value) and "num_classes" in str(info.value)


def test_accuracy_of_a_classifier():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    assert accuracy(logits, torch.tensor([0, 1, 0, 0])) == (3, 4)
    assert accuracy(logits[:0], torch.tensor([], dtype=torch.long)) == (0, 0)


def test_accuracy_of_a_language_model_ignores_minus_100():
    logits = torch.zeros(2, 3, 5)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 1.0  # predicts 1, 2, 3
    logits[1, 0, 4] = logits[1, 1, 4] = logits[1, 2, 0] = 1.0  # predicts 4, 4, 0
    targets = torch.tensor([[1, 0, -100], [4, -100, -100]])
    assert accuracy(logits, targets) == (2, 3)
    assert accuracy(logits, torch.full((2, 3), -100)) == (0, 0)


@pytest.mark.parametrize("defense", [None, {"kind": "gradprune", "ratio": 0.9}])
def test_evaluate(small, defense):
    u, r, task = small
    out = evaluate(u, r, defense, task)
    assert 0.0 <= out["accuracy"] <= 1.0
    assert out["examples"] == 120 and out["steps"] == 8  # 2 epochs of 60 in batches of 16
    assert out["epsilon"] is None and out["train_seconds"] >= 0
    assert out["mean_loss"] is not None and math.isfinite(out["mean_loss"])
    assert out["accuracies"] == [out["accuracy"]] and out["accuracy_std"] == 0.0
    again = evaluate(u, r, defense, task)
    assert (again["accuracy"], again["mean_loss"]) == (out["accuracy"], out["mean_loss"])


def test_evaluate_loads_its_own_task():
    u = UtilitySection(train=20, test=10, epochs=1, repeats=1)
    out = evaluate(u, red(), None)
    assert out["examples"] == 20 and 0.0 <= out["accuracy"] <= 1.0


def test_repeats_average_trainings_from_successive_seeds(small):
    u, r, task = small
    defense = {"kind": "gaussian", "sigma": 0.05, "seed": 5}
    three = evaluate(u.model_copy(update={"repeats": 3}), r, defense, task)
    assert len(three["accuracies"]) == 3 and three["accuracy"] == pytest.approx(sum(three["accuracies"]) / 3)
    assert three["accuracy_std"] >= 0.0 and all(0.0 <= a <= 1.0 for a in three["accuracies"])
    first = evaluate(u, r, defense, task)  # the first repeat is the single training (seed, defense seed)
    assert three["accuracies"][0] == first["accuracy"]
    shifted = evaluate(u.model_copy(update={"seed": u.seed + 1}), r, {**defense, "seed": 5 + 7919}, task)
    assert three["accuracies"][1] == shifted["accuracy"]  # repeat r: seed + r, the defense's seed shifted
    assert evaluate(u.model_copy(update={"repeats": 3}), r, defense, task)["accuracies"] == three["accuracies"]


def test_evaluate_with_dpsgd_reports_epsilon(small):
    u, r, task = small
    out = evaluate(u, r, {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "seed": 1}, task)
    assert out["epsilon"] is not None and math.isfinite(out["epsilon"]) and out["epsilon"] > 0
    assert out["dp_delta"] is not None and 0 < out["dp_delta"] < 1
    assert 0.0 <= out["accuracy"] <= 1.0


@pytest.mark.parametrize("defense", [
    {"kind": "gaussian", "sigma": 0.05, "seed": 5},
    {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "seed": 5},
])
def test_a_seeded_defense_reproduces_and_leaves_the_global_rng_alone(small, defense):
    u, r, task = small
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    first = evaluate(u, r, defense, task)
    assert torch.equal(torch.get_rng_state(), before)
    second = evaluate(u, r, defense, task)
    assert torch.equal(torch.get_rng_state(), before)
    keys = ("accuracy", "mean_loss", "epsilon", "examples", "steps")
    assert {k: first[k] for k in keys} == {k: second[k] for k in keys}
    if defense["kind"] == "gaussian":  # (a third DP-SGD run costs a second on 2 cores)
        other = evaluate(u, r, {**defense, "seed": 6}, task)
        assert other["mean_loss"] != first["mean_loss"]  # the seed is what reproduces, not a constant


def test_dpsgd_on_a_batchnorm_model_is_refused():
    u = UtilitySection(train=20, test=10, epochs=1, repeats=1)
    with pytest.raises(ConfigError) as info:
        evaluate(u, red("convnet"), {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0})
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("defense: ") and "BatchNorm" in msg
