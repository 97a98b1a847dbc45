"""inspect_model's near-parallel-rows check (issue 34, ``guardfl.inspect_rows``): a hidden layer whose rows
repeat one measurement direction, as trap weights' chains do, while the layer stays full rank and no row
equals another."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl import inspect_rows as R
from guardfl.inspect import inspect_model
from guardfl.inspect_rows import parallel_rows
from guardfl.redteam.attacks.malicious.trap_chain import auto_rho, disguise, unseen
from guardfl.redteam.attacks.malicious.trap_weights import craft, trap_layers
from guardfl.redteam.modality.image.models import FC2, FC2LN


def brute_force(w):
    u = w.double() / w.double().norm(dim=1, keepdim=True)
    c = (u @ u.T).abs()
    c.fill_diagonal_(0)
    return float(c.max()), (c >= R.PARALLEL_COS).any(1)


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 2**16), st.integers(2, 40), st.integers(64, 300), st.floats(1e-3, 1e3))
def test_the_largest_cosine_and_the_flagged_rows_are_exact_and_scale_free(seed, rows, cols, scale):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w[rows // 2] = -3 * w[0] + 1e-3 * torch.randn(cols, generator=g, dtype=torch.float64)  # a near-multiple (sign flipped)
    top, flagged, info = parallel_rows(w * scale)
    want_top, want_flagged = brute_force(w)
    assert top == pytest.approx(want_top, abs=1e-5)
    assert torch.equal(flagged, want_flagged) and info["screened"] == 0
    assert (flagged[0] and flagged[rows // 2]) == (rows // 2 != 0)


def test_a_large_layer_is_screened_in_a_projection_and_finds_the_same_rows(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 2000, generator=g)
    w[[7, 99, 250]] = torch.randn(1, 2000, generator=g) * torch.tensor([[1.0], [-2.0], [0.5]])
    w[[7, 99, 250]] += 1e-3 * torch.randn(3, 2000, generator=g)
    exact_top, exact_rows, _ = parallel_rows(w)
    monkeypatch.setattr(R, "EXACT_ELEMENTS", 1000)
    top, rows, info = parallel_rows(w)
    assert info["screened"] == 1 and info["pairs"] == 3
    assert torch.equal(rows, exact_rows) and rows.nonzero().flatten().tolist() == [7, 99, 250]
    assert top == pytest.approx(exact_top, abs=1e-6)


def test_zero_rows_and_degenerate_layers_are_not_parallel():
    w = torch.randn(6, 80)
    w[2] = 0
    w[4] = 0  # two zero rows: no direction, not a pair
    top, rows, _ = parallel_rows(w)
    assert top < 0.9 and not rows.any()
    assert parallel_rows(torch.randn(1, 80))[0] == 0.0 and parallel_rows(torch.zeros(5, 80))[0] == 0.0
    huge = torch.randn(4, 80, dtype=torch.float64) * 1e300  # no overflow in the norms
    assert parallel_rows(huge)[0] < 0.9


def lfw_trap(model_cls, rows, aux):
    """(honest model, trap) of one chain of ``rows`` rows in a fresh ``model_cls`` for 25 x 25 faces."""
    torch.manual_seed(0)
    model = model_cls((1, 25, 25), 10)
    return model, craft(model, trap_layers(model, (1, 25, 25)), (1, 25, 25), aux, 1, 0.0, (0.0, 1.0),
                        torch.Generator().manual_seed(0), rows=rows, samples=64)


def test_trap_rows_are_refused_and_the_reason_names_the_layer(lfw):
    model, trap = lfw_trap(FC2, 3, lfw[2])
    result = inspect_model(trap.sent, model)
    assert not result.ok and result.reasons[0].startswith("parallel rows: layer 'net.1' (256 x 625) has 3 row(s)")
    assert result.checks["parallel_rows"]["layers"]["net.1"]["rows"] == 3
    assert inspect_model(model, model).checks["parallel_rows"]["max_cos"] < 0.2


def test_the_classifier_and_narrow_layers_are_not_judged():
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with torch.no_grad():
        model[0].weight[1] = 2 * model[0].weight[0]  # 8 inputs: random rows are near-parallel by chance
        model[2].weight[1] = 2 * model[2].weight[0]  # the classifier: class fishing's checks own it
    result = inspect_model(model)
    assert result.ok and result.checks["parallel_rows"]["layers"] == {}


def test_a_layer_with_too_many_rows_is_named_not_examined(monkeypatch):
    from guardfl import inspect as I

    monkeypatch.setattr(I, "PARALLEL_MAX_ROWS", 100)
    model = torch.nn.Sequential(torch.nn.Linear(128, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))
    result = inspect_model(model)
    assert result.checks["parallel_rows"]["not_examined"] == {"0": "more than 100 rows"}


def test_the_disguise_keeps_what_images_see_and_passes_the_check(lfw):
    """The red team's answer (``trap_weights disguise``): each trapped row gets a part images barely see."""
    x, _, aux = lfw
    _, trap = lfw_trap(FC2, 8, aux)
    weight = trap.sent.net[1].weight
    before = (x.flatten(1) @ weight[trap.chains[0]].detach().T)
    rows = disguise(weight, auto_rho(), (1, 25, 25), aux, torch.Generator().manual_seed(1))
    after = (x.flatten(1) @ weight[trap.chains[0]].detach().T)
    top, flagged, _ = parallel_rows(weight.detach())
    assert rows == 8 and not flagged.any() and 0.95 < top < R.PARALLEL_COS
    spread = before.std(0)
    assert float(((after - before).std(0) / spread).max()) < 0.1  # the measurement moves by < 10% of its spread
    h = unseen(4, (1, 25, 25), aux, torch.Generator().manual_seed(2))
    assert torch.allclose(h.norm(dim=1), torch.ones(4, dtype=torch.float64))


@pytest.fixture(scope="module")
def lfw():
    from guardfl.redteam.modality.image.data import lfw_faces

    x, y = lfw_faces(10)
    return x[:64], y[:64], x[64:]


def test_layer_norm_traps_keep_no_parallel_rows_once_disguised(lfw):
    aux = lfw[2]
    model, trap = lfw_trap(FC2LN, 3, aux)
    assert not inspect_model(trap.sent, model).ok
    disguise(trap.sent.net[1].weight, auto_rho(), (1, 25, 25), aux, torch.Generator().manual_seed(1))
    assert "parallel_rows" in inspect_model(trap.sent, model).checks
    assert not any(r.startswith("parallel rows") for r in inspect_model(trap.sent, model).reasons)


def test_a_layer_of_repeated_rows_is_bounded_and_still_flagged(monkeypatch):
    """A hostile layer whose every row repeats one (a zero-stride tensor): the pairs kept are capped, the layer
    is flagged all the same."""
    monkeypatch.setattr(R, "EXACT_ELEMENTS", 1000)
    monkeypatch.setattr(R, "MAX_CANDIDATES", 50)
    w = torch.randn(1, 100).expand(40, 100)
    top, rows, info = parallel_rows(w)
    assert info == {"pairs": 50, "screened": 1, "capped": 1} and rows.any() and top == pytest.approx(1.0)
    monkeypatch.setattr(R, "EXACT_ELEMENTS", 10**6)
    top, rows, info = parallel_rows(w)
    assert rows.all() and info["pairs"] == 40 * 39 // 2 and info["screened"] == 0


def test_rows_that_fill_the_screen_ahead_of_a_parallel_pair_get_the_layer_refused(monkeypatch):
    """Fail closed: where a large layer is screened, rows just under the threshold (|cos| 0.97) could fill
    the pairs compared exactly ahead of a trap's parallel pair; a layer past that cap is refused even when
    the pairs compared hold no parallel one."""
    monkeypatch.setattr(R, "EXACT_ELEMENTS", 1000)
    monkeypatch.setattr(R, "MAX_CANDIDATES", 50)
    torch.manual_seed(0)
    model = FC2((1, 8, 8), 10, hidden=64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = model.net[1].weight
        base = torch.randn(64, generator=g)
        w[:12] = base + 0.15 * base.norm() / 8 * torch.randn(12, 64, generator=g)  # 66 pairs near 0.98
        w[60] = torch.randn(64, generator=g)
        w[63] = 2.0 * w[60]
    top, rows, info = parallel_rows(w)
    assert info["capped"] == 1 and not rows[60]  # the parallel pair came after the cap
    verdict = inspect_model(model)
    assert not verdict.ok
    assert any(r.startswith("parallel rows: layer 'net.1'") and "not judged whole, refused" in r for r in verdict.reasons)
