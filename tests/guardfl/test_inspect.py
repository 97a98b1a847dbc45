"""guardfl.inspect_model: malicious-server signatures are found, benign models are never flagged."""

import copy

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st

import guardfl
from guardfl.errors import ConfigError, GuardflError, MaliciousModelError
from guardfl.inspect import (
    duplicate_row_share,
    gradient_shares,
    output_collapse,
    rank_ratio,
    threshold_monotone_share,
    zero_row_share,
)
from tests import malicious as M

pytestmark = pytest.mark.skipif(not M.CIFAR.exists(), reason=f"needs the shared CIFAR-10 sample {M.CIFAR}")


@pytest.fixture(scope="module")
def data():
    return M.cifar(256)


@pytest.fixture(scope="module")
def batch():
    return M.cifar(32, offset=4000)  # the client's own first batch: images the models were not trained on


@pytest.fixture(scope="module")
def trained_cnn(data):
    return M.train(M.small_cnn(0), *data, epochs=3)


@pytest.fixture(scope="module")
def benign(data, trained_cnn):
    """Name -> benign model: default inits, DLG's wide init, trained checkpoints, FedAvg rounds."""
    x, y = data
    models = {
        "cnn default": M.small_cnn(0),
        "lenet default": M.lenet(0),
        "lenet wide-init": M.lenet(0, wide=True),
        "resnet18 default": M.resnet18(0),
        "linear default": M.linear_model(0),
        "cnn trained 3 epochs": trained_cnn,
        "lenet trained 3 epochs": M.train(M.lenet(1), x, y, epochs=3, lr=0.1),
        "lenet wide-init trained": M.train(M.lenet(1, wide=True), x, y, epochs=3, lr=0.01),
        "linear trained 3 epochs": M.train(M.linear_model(1), x, y, epochs=3, lr=0.01),
    }
    for rnd, model in enumerate(M.fedavg(M.small_cnn(2), x, y, clients=4, rounds=2)):
        models[f"cnn fedavg round {rnd + 1}"] = model
    return models


@pytest.fixture(scope="module")
def malicious(trained_cnn):
    """Name -> (modified model, the architecture the client expects)."""
    tv = torchvision.models.resnet18(num_classes=10)
    return {
        "imprint before cnn": (M.with_imprint(M.small_cnn(0)), M.small_cnn(0)),
        "imprint before trained cnn": (M.with_imprint(trained_cnn, bins=128, seed=1), trained_cnn),
        "class fishing cnn": (M.class_fishing(M.small_cnn(0), target=3), M.small_cnn(0)),
        "class fishing trained cnn": (M.class_fishing(trained_cnn, target=0, keep_target_row=True), trained_cnn),
        "class fishing resnet18": (M.class_fishing(tv, target=5), tv),
        "class fishing resnet18 cifar": (M.class_fishing(M.resnet18(0), target=1), M.resnet18(0)),
        "feature fishing trained cnn": (M.feature_fishing(trained_cnn, target=2, feature=7), trained_cnn),
    }


# -- detection: 100% on the attacks' models ------------------------------------------------------------
@pytest.mark.parametrize("with_batch", [False, True])
def test_every_malicious_model_is_flagged_with_reasons(malicious, batch, with_batch):
    for name, (model, _) in malicious.items():
        result = guardfl.inspect_model(model, batch=batch if with_batch else None)
        assert not result.ok and not bool(result), name
        assert result.reasons and all(isinstance(r, str) and "\n" not in r for r in result.reasons), name


def test_imprint_reason_names_the_layer_its_rank_and_the_bins():
    result = guardfl.inspect_model(M.with_imprint(M.small_cnn(0), bins=64))
    first = next(r for r in result.reasons if "'0.1'" in r)
    assert first.startswith("imprint:") and "64 x 3072" in first and "rank one" in first and "monotone" in first
    assert result.checks["imprint"]["min_rank_ratio"] < 1e-5


def test_an_inserted_imprint_block_is_an_architecture_change(malicious):
    model, expected = malicious["imprint before cnn"]
    reasons = guardfl.inspect_model(model, expected).reasons
    assert any(r.startswith("architecture:") and "does not expect" in r and "0.1.weight [64, 3072]" in r for r in reasons)
    assert any("missing" in r and "body.0.weight" in r for r in reasons)


def test_class_fishing_reasons_name_the_classifier_rows_and_bias_gap(malicious):
    model, _ = malicious["class fishing resnet18"]
    reasons = guardfl.inspect_model(model).reasons
    assert any("'fc'" in r and "9 of 10 rows zeroed" in r for r in reasons)
    assert any("'fc'" in r and "1e+03 logits apart" in r for r in reasons)


def test_class_fishing_concentrates_the_batch_gradient_on_the_target_class(trained_cnn, batch):
    x, y = batch
    target = int(y[0])
    result = guardfl.inspect_model(M.class_fishing(trained_cnn, target=target), batch=batch)
    conc = result.checks["gradient_concentration"]
    assert conc["class_share"] == pytest.approx(1.0) and conc["label"] == target
    assert any(r.startswith("gradient concentration:") for r in result.reasons)


def test_a_partial_imprint_of_repeated_rows_is_flagged():
    layer = torch.nn.Linear(32, 16)
    with torch.no_grad():
        layer.weight[8:] = layer.weight[0]  # half the rows one repeated measurement, the rest random
    model = torch.nn.Sequential(torch.nn.Flatten(), layer, torch.nn.ReLU(), torch.nn.Linear(16, 4))
    result = guardfl.inspect_model(model)
    assert any("identical to another row" in r and "'1'" in r for r in result.reasons)


def test_a_rank_one_classifier_is_flagged():
    head = torch.nn.Linear(20, 10)
    with torch.no_grad():
        head.weight.copy_(torch.randn(10, 1) * torch.randn(1, 20))
    result = guardfl.inspect_model(torch.nn.Sequential(torch.nn.Linear(5, 20), head))
    assert any(r.startswith("class fishing:") and "rank one" in r for r in result.reasons)


def test_strict_raises_malicious_model_error_with_the_reasons(malicious):
    model, _ = malicious["class fishing cnn"]
    with pytest.raises(MaliciousModelError) as info:
        guardfl.inspect_model(model, strict=True)
    assert isinstance(info.value, GuardflError) and info.value.reasons == guardfl.inspect_model(model).reasons
    assert "class fishing" in str(info.value) and "\n" not in str(info.value)


def test_a_state_dict_gets_the_verdict_of_its_module(malicious, benign):
    for model, expected in [*malicious.values(), (benign["cnn trained 3 epochs"], M.small_cnn(0))]:
        assert guardfl.inspect_model(model.state_dict(), expected).reasons == guardfl.inspect_model(model, expected).reasons


# -- false positives: exactly 0 on the benign set ---------------------------------------------------------
def test_no_benign_model_is_flagged(benign, batch):
    for name, model in benign.items():
        result = guardfl.inspect_model(model, copy.deepcopy(model), batch=batch)
        assert result.ok, (name, result.reasons)
        assert result.reasons == [] and result.checks["architecture"] == {"matches": True}


def test_benign_models_are_far_from_the_thresholds(benign, batch):
    from guardfl import inspect as I

    for name, model in benign.items():
        c = guardfl.inspect_model(model, batch=batch).checks
        assert c["class_fishing"]["rank_ratio"] > 100 * I.RANK_ONE_RATIO, name
        assert c["class_fishing"]["zero_row_share"] == 0.0 and c["class_fishing"]["bias_gap"] < I.BIAS_GAP_LOGITS / 5, name
        assert c["gradient_concentration"]["sample_share"] < I.CONCENTRATION_SHARE / 3, name
        # a LeNet that predicts mostly one class sends half its gradient through one label's samples
        assert c["gradient_concentration"]["class_share"] < 0.75 * I.CONCENTRATION_SHARE, name


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["cnn", "lenet", "lenet-wide", "linear"]))
def test_random_benign_initialisations_are_never_flagged(seed, kind, batch):
    model = {"cnn": M.small_cnn, "lenet": M.lenet, "linear": M.linear_model,
             "lenet-wide": lambda s: M.lenet(s, wide=True)}[kind](seed)
    result = guardfl.inspect_model(model, batch=batch)
    assert result.ok, result.reasons


@settings(max_examples=12, deadline=None)
@given(labels=st.lists(st.integers(0, 9), min_size=8, max_size=40))
def test_non_iid_batches_on_a_benign_model_are_never_flagged(labels, trained_cnn):
    """A client may hold mostly one class: its majority label carrying the gradient is not fishing."""
    x, _ = M.cifar(len(labels), offset=3000)
    result = guardfl.inspect_model(trained_cnn, batch=(x, torch.tensor(labels)))
    assert result.ok, result.reasons


def test_a_collapsed_output_is_reported_but_no_reason(batch):
    """DLG's wide init can put every sample in one class by itself: collapse is measured, not flagged."""
    model = M.lenet(0)
    with torch.no_grad():
        model.fc.bias[4] = 15.0  # every sample in class 4 at p ~ 1, below the bias-gap threshold
    result = guardfl.inspect_model(model, batch=batch)
    assert result.ok and result.checks["output_collapse"]["collapsed"] and result.checks["output_collapse"]["class"] == 4


def test_the_batch_check_restores_the_training_mode_and_leaves_weights_alone(trained_cnn, batch):
    model = copy.deepcopy(trained_cnn).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guardfl.inspect_model(model, batch=batch)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # eval mode: BN stats untouched


def test_a_state_dict_runs_the_batch_checks_in_a_copy_of_the_reference(trained_cnn, batch):
    x, y = batch
    fished = M.class_fishing(trained_cnn, target=int(y[0])).state_dict()
    result = guardfl.inspect_model(fished, trained_cnn, batch=batch)
    assert "gradient_concentration" in result.checks and not result.ok
    shapes = {k: tuple(v.shape) for k, v in trained_cnn.state_dict().items()}
    assert guardfl.inspect_model(trained_cnn.state_dict(), shapes).ok


# -- the pure checks ---------------------------------------------------------------------------------------
def test_pure_checks_on_hand_made_tensors():
    v = torch.randn(50)
    rank_one = torch.arange(1.0, 11.0)[:, None] * v
    assert rank_ratio(rank_one) < 1e-6 and rank_ratio(torch.randn(10, 50)) > 0.1
    assert rank_ratio(torch.zeros(10, 5)) != rank_ratio(torch.zeros(10, 5))  # nan: nothing to judge
    assert threshold_monotone_share(rank_one, -torch.arange(10.0) * torch.arange(1.0, 11.0)) == 1.0
    assert duplicate_row_share(torch.zeros(8, 3)) == 0.0  # an all-zero (zero-initialised) layer is no imprint
    assert duplicate_row_share(torch.ones(8, 3)) == 1.0
    assert zero_row_share(torch.zeros(4, 3)) == 0.0
    assert zero_row_share(torch.cat([torch.zeros(3, 3), torch.ones(1, 3)])) == 0.75
    probs = torch.tensor([[0.995, 0.005], [0.999, 0.001], [0.998, 0.002]])
    assert output_collapse(probs, torch.tensor([0, 1, 1]))[2] and not output_collapse(probs, torch.tensor([0, 0, 0]))[2]
    onehot = torch.eye(3)[torch.tensor([0, 0, 1, 2])]
    p = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0], [0.5, 0, 0.5]])
    share, i, class_share, label = gradient_shares(p, onehot, torch.eye(3), torch.tensor([0, 0, 1, 2]))
    assert (share, i, class_share, label) == (1.0, 3, 1.0, 2)


# -- bad input: one line naming the argument ---------------------------------------------------------------
@pytest.mark.parametrize("call, field", [
    (lambda: guardfl.inspect_model([1, 2]), "received"),
    (lambda: guardfl.inspect_model({"w": [1.0]}), "received"),
    (lambda: guardfl.inspect_model(torch.nn.Linear(2, 2), reference="resnet"), "reference"),
    (lambda: guardfl.inspect_model(torch.nn.Linear(2, 2), reference={"weight": "big"}), "reference"),
    (lambda: guardfl.inspect_model(torch.nn.Linear(2, 2).state_dict(), batch=(torch.zeros(1, 2), torch.zeros(1).long())), "batch"),
    (lambda: guardfl.inspect_model(torch.nn.Linear(2, 2), batch=torch.zeros(3, 2)), "batch"),
    (lambda: guardfl.inspect_model(torch.nn.Linear(2, 2), batch=(torch.zeros(3, 2), torch.zeros(3))), "batch"),
    (lambda: guardfl.inspect_model(torch.nn.Linear(2, 2), batch=(torch.zeros(3, 2), torch.tensor([0, 1, 5]))), "batch"),
])
def test_bad_input_is_one_config_error_line_naming_the_argument(call, field):
    with pytest.raises(ConfigError) as info:
        call()
    assert str(info.value).startswith(f"{field}:") and "\n" not in str(info.value)


def test_every_listed_check_reports_under_its_key(benign, batch):
    """``CHECKS`` is what the red team's certificate says an inspecting client examined: each one reports."""
    from guardfl.inspect import CHECKS

    model = benign["cnn trained 3 epochs"]
    result = guardfl.inspect_model(model, copy.deepcopy(model), batch=batch)
    assert set(CHECKS) <= set(result.checks) and "parallel_rows" in CHECKS
