"""The shared-columns check (guardfl/inspect_columns.py): two hidden units that the next layer gives the same
coefficient per sample over the client's batch, compared on the batch rather than the weights."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.inspect import CHECKS, inspect_model
from guardfl.inspect_columns import COLUMN_COS, COLUMN_MIN_DIMENSIONS, check, coefficients, dimensions, shared_columns


def mlp(seed=0, hidden=64, classes=10, inputs=48):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def batch(n=32, classes=10, inputs=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, inputs, generator=g), torch.arange(n) % classes


def test_dimensions_is_the_rank_for_equal_directions_and_little_for_a_dominant_one():
    assert dimensions(torch.eye(9)) == pytest.approx(9.0)
    skew = torch.diag(torch.tensor([10.0, 0.1, 0.1, 0.1]))
    assert dimensions(skew) < 1.1 and dimensions(torch.zeros(4, 3)) == 0.0


@settings(max_examples=30, deadline=None)
@given(scale=st.floats(1e-3, 1e3), seed=st.integers(0, 50))
def test_parallel_columns_are_found_whatever_their_scale(scale, seed):
    g = torch.Generator().manual_seed(seed)
    coeffs = torch.randn(32, 20, generator=g, dtype=torch.float64)
    coeffs[:, 7] = -scale * coeffs[:, 3]
    top, flagged, info = shared_columns(coeffs)
    assert top >= COLUMN_COS and flagged.nonzero().flatten().tolist() == [3, 7] and info["pairs"] == 1


def test_a_benign_mlp_passes_and_two_units_with_one_classifier_column_are_refused():
    model, (x, y) = mlp(), batch()
    clean = inspect_model(model, mlp(1), batch=(x, y))
    assert clean.ok and "shared_columns" in CHECKS and clean.checks["shared_columns"]["max_cos"] < 0.999
    with torch.no_grad():
        model[2].weight[:, 5] = model[2].weight[:, 9]
    found = inspect_model(model, mlp(1), batch=(x, y))
    assert any(r.startswith("shared columns: layer '2' gives 2 of its 64 input units") for r in found.reasons)


def test_columns_that_differ_only_along_softmaxs_all_ones_direction_are_caught():
    """Cross-entropy's error sums to zero over the classes: adding a constant to one column changes no
    coefficient. The weights' cosine drops; the coefficients' does not."""
    model, (x, y) = mlp(), batch()
    with torch.no_grad():
        model[2].weight[:, 5] = model[2].weight[:, 9] + 0.5
    w = model[2].weight.detach()
    assert float(torch.nn.functional.cosine_similarity(w[:, 5], w[:, 9], dim=0)) < 0.9
    assert any(r.startswith("shared columns") for r in inspect_model(model, batch=(x, y)).reasons)


def test_a_batch_of_mostly_one_label_is_not_judged_and_says_so():
    model, (x, y) = mlp(), batch()
    y = torch.where(torch.arange(32) < 30, torch.tensor(3), y)
    with torch.no_grad():
        model[2].weight[:, 5] = model[2].weight[:, 9]
    layer = inspect_model(model, batch=(x, y)).checks["shared_columns"]["layers"]["2"]
    assert layer["judged"] is False and layer["dimensions"] < COLUMN_MIN_DIMENSIONS and layer["units"] == 2


def test_a_layer_reading_the_models_input_is_not_examined():
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 10)  # its columns are the input's features, not units
    found = inspect_model(model, batch=batch()).checks["shared_columns"]
    assert found["layers"] == {} and found["skipped"].startswith("no nn.Linear layer that reads hidden units")


def test_check_reports_what_it_did_not_examine():
    delta = torch.randn(16, 10, dtype=torch.float64)
    reasons, found = check([("big", delta, torch.zeros(10, 9000))])
    assert reasons == [] and found["not_examined"] == {"big": "more than 8192 input units"}
    assert coefficients(delta, torch.ones(10, 3)).shape == (16, 3)
