"""``trap_weights columns: k`` (issue 34, ``trap_groups``): each cut held by k rows, each row its own
classifier column; the server solves each cut's k x k system. Built against the shared-columns check and
the pairwise isolation tests; the isolation check's group test counts it."""

import pytest
import torch
from pydantic import ValidationError

import guardfl.inspect_isolation as isolation
from guardfl.inspect import inspect_model
from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.attacks.malicious.trap_config import TrapWeightsConfig
from guardfl.redteam.attacks.malicious.trap_groups import group_columns
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.modality.image.models import FC2, FC2BN
from tests.redteam.attacks.malicious.test_trap_weights import lfw_client


def exact(rec, x):
    return sum(row["ssim"] > 0.9 for row in metrics.evaluate(rec, x)["per_image"])


@pytest.mark.parametrize("k", [2, 3])
def test_reads_faces_exactly(k):
    x, y, model, setting, threat, client = lfw_client(FC2, FedSGD())
    rec = get("trap_weights", seed=0, columns=k).interrogate(client, setting, threat)
    assert exact(rec, x) >= 10 and rec.info["columns"] == f"{k} rows per cut, each its own column"
    assert rec.info["column_noise"].startswith(f"0 (auto: columns {k}")
    if k == 2:  # (with 3, two units of this draw hold one and the same face alone: parallel, whatever the columns)
        reasons = inspect_model(rec.info["malicious_model"], model, batch=(x, y)).reasons
        assert not any(r.startswith("shared columns") for r in reasons)


def test_the_rows_of_one_cut_get_orthogonal_columns_of_the_honest_norm():
    g = torch.Generator().manual_seed(0)
    second = torch.nn.Linear(12, 10)
    basis = torch.linalg.qr(torch.randn(10, 3, generator=g, dtype=torch.float64))[0].T * 0.4
    rows = torch.arange(12).reshape(4, 3)
    mixes = group_columns(second.weight.data, rows, basis, g)
    cols = second.weight.detach().double()
    for cut in rows[:-1]:  # the top cut holds one row
        c = cols[:, cut]
        assert torch.allclose(c.norm(dim=0), torch.full((3,), 0.4, dtype=c.dtype), rtol=1e-5)
        assert float((c.T @ c - torch.diag(c.norm(dim=0) ** 2)).abs().max()) < 1e-6
    assert torch.allclose((mixes @ basis)[:-1], cols.T.reshape(4, 3, 10)[:-1], atol=1e-6)


def test_a_small_trap_of_grouped_cuts_keeps_the_honest_rows():
    x, y, model, setting, threat, client = lfw_client(FC2, FedSGD())
    rec = get("trap_weights", seed=0, columns=2, chains=2, rows=4).interrogate(client, setting, threat)
    sent = rec.info["malicious_model"].state_dict()["net.1.weight"]
    assert int((sent == model.state_dict()["net.1.weight"]).all(dim=1).sum()) == 256 - 2 * (4 * 2 - 1)  # the top cut: one row
    assert rec.info["bins"] == 8 and rec.info["disguised"].startswith("14 rows")


def test_the_group_test_counts_what_pairs_of_rows_do_not(monkeypatch):
    """On 64 LFW faces (centred: the honest FC-2 then isolates nothing, so every count is a finding): pairs
    of rows of the disguised whole-layer trap of 2 rows per cut read under a quarter of the batch (where a
    bin shares one sample); the group test counts most of it."""
    x, y, model, setting, threat, client = lfw_client(FC2, FedSGD())
    x, threat = x - 0.5, threat.with_aux(type(threat.aux)(threat.aux.images - 0.5, threat.aux.labels))
    setting = Setting(model, FedSGD(), 64, setting.input_shape, 10, (-0.5, 0.5), None)
    rec = get("trap_weights", seed=0, columns=2).interrogate(ClientQuery(x, y, None, FedSGD()), setting, threat)
    sent = rec.info["malicious_model"]
    found = inspect_model(sent, model, batch=(x, y))
    assert not found.ok and any(r.startswith("isolation:") for r in found.reasons)
    assert found.checks["isolation"]["layers"]["net.1"]["isolated"] >= 32
    monkeypatch.setattr(isolation, "group_sets", lambda d, *a: (torch.zeros(0, d.shape[0], dtype=torch.bool), {}))
    assert inspect_model(sent, model, batch=(x, y)).checks["isolation"]["layers"]["net.1"]["isolated"] < 16


def test_not_for_a_normalised_layer_with_the_reason():
    _, _, _, setting, threat, _ = lfw_client(FC2BN, FedSGD())
    assert "columns: 2" in get("trap_weights", columns=2).refuses(setting) and "BatchNorm1d" in get("trap_weights", columns=2).refuses(setting)
    assert get("trap_weights").refuses(setting) is None
    _, _, _, plain, _, _ = lfw_client(FC2, FedSGD())
    assert "columns: 11 is past the 10 outputs" in get("trap_weights", columns=11).refuses(plain)


@pytest.mark.parametrize("bad", [0, 17, 2.5, "two"])
def test_columns_out_of_range_is_one_line_naming_it(bad):
    with pytest.raises(ValidationError, match="columns"):
        TrapWeightsConfig(columns=bad)
