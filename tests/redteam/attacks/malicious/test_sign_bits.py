"""``sign_bits``: faces read through sign compression from which first-layer units fired, past the client's
inspection."""

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from guardfl.redteam.attacks import Setting, get
from guardfl.redteam.attacks.malicious.sign_bits import crossing, dct_basis
from guardfl.redteam.client.simulate import ClientQuery, FedSGD
from guardfl.redteam.modality.image.data import load
from guardfl.redteam.modality.image.metrics import ssim_matrix
from guardfl.redteam.modality.image.models import FC2, FC2BN
from guardfl.redteam.threat import ThreatModel
from tests import malicious as M

SHAPE = (1, 25, 25)


def test_sign_compression_behind_the_inspection_gives_faces_away():
    """FC-2, 64 LFW faces, sign compression, a client that inspects every model with its own batch: every
    model passes, and the 8 reads include faces past SSIM 0.5 (measured 0.38-0.64, 2026-11-29)."""
    x, y = load("lfw-faces")
    torch.manual_seed(0)
    setting = Setting(FC2(SHAPE), FedSGD(), 64, SHAPE, 10, (0.0, 1.0), {"kind": "sign"})
    client = ClientQuery(x[:64], y[:64], {"kind": "sign"}, FedSGD(), inspect=True, reference=setting.model)
    rec = get("sign_bits", seed=0, faces=8).interrogate(client, setting, ThreatModel(server="malicious", aux=(x[64:], y[64:])))
    assert "refused" not in rec.info and client.queries == 8 * (4 + 4) and client.refused == 0
    s = ssim_matrix(rec.inputs[:8], x[:64], 1.0)
    rows, cols = linear_sum_assignment(-s)
    assert (s[rows, cols] > 0.5).sum() >= 2, s.max(0)
    assert rec.info["rounds"] == "4 of search and 4 of bits per face"


def test_the_crossing_splits_fired_from_silent():
    t = torch.linspace(0, 1, 101, dtype=torch.float64)
    assert crossing(t, t < 0.42) == pytest.approx(0.415, abs=1e-9)  # between 0.41 and 0.42
    noisy = (t < 0.6) ^ (torch.arange(101) % 17 == 0)  # a few units flipped either way
    assert crossing(t, noisy) == pytest.approx(0.6, abs=0.02)
    assert crossing(t, torch.zeros(101, dtype=torch.bool)) == 0.0 and crossing(t, torch.ones(101, dtype=torch.bool)) == 1.0


def test_the_dct_basis_is_orthonormal_and_smooth_first():
    b = dct_basis((3, 8, 8), 30)
    assert b.shape == (192, 30) and torch.allclose(b.T @ b, torch.eye(30, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(b[:64, 0], torch.full((64,), 1 / 8, dtype=torch.float64))  # the first: the constant
    assert torch.equal(dct_basis((1, 4, 4), 0), torch.eye(16, dtype=torch.float64))


def test_not_applicable_where_thresholds_move_with_the_batch_or_nothing_is_dense():
    threat = ThreatModel(server="malicious", aux=(torch.rand(8, *SHAPE), torch.zeros(8, dtype=torch.long)))
    bn = Setting(FC2BN(SHAPE), FedSGD(), 8, SHAPE, 10, (0.0, 1.0), {"kind": "sign"})
    assert "BatchNorm1d" in get("sign_bits").applicable(bn, threat)
    conv = Setting(M.lenet(), FedSGD(), 8, (3, 32, 32), 10, (0.0, 1.0), {"kind": "sign"})
    assert "nn.Linear on the whole flattened input" in get("sign_bits").applicable(conv, threat)
    assert get("sign_bits").applicable(Setting(FC2(SHAPE), FedSGD(), 8, SHAPE, 10, (0.0, 1.0), None),
                                       ThreatModel(server="malicious")) is not None  # no auxiliary images


@pytest.mark.parametrize("field, bad", [("faces", 0), ("rounds", 1000), ("eps", 0), ("honest", 1.0), ("basis", -1)])
def test_a_bad_budget_is_one_line_naming_the_field(field, bad):
    with pytest.raises(Exception) as info:
        get("sign_bits", **{field: bad})
    assert field in str(info.value) and len(str(info.value).splitlines()) == 1


def test_a_budget_that_runs_out_leaves_the_server_the_faces_it_read():
    x, y = load("lfw-faces")
    torch.manual_seed(0)
    setting = Setting(FC2(SHAPE), FedSGD(), 64, SHAPE, 10, (0.0, 1.0), {"kind": "sign"})
    client = ClientQuery(x[:64], y[:64], {"kind": "sign"}, FedSGD(), max_rounds=20)  # two faces of 8 rounds, then refused
    rec = get("sign_bits", seed=0, faces=4).interrogate(client, setting, ThreatModel(server="malicious", aux=(x[64:], y[64:])))
    assert rec.info["stopped"].startswith("after 2 of 4 faces: the client's round budget refused a model")
    assert "refused" not in rec.info and ssim_matrix(rec.inputs[:2], x[:64], 1.0).max() > 0.4


def test_noise_on_every_entry_leaves_no_bits_and_no_guess_dressed_as_a_read():
    """Gaussian noise on the update: no bias entry is ever zero, every unit reads as fired, and the attack
    returns grey placeholders (no read) with the reason, rather than a mean face pushed in a random direction."""
    x, y = load("lfw-faces")
    torch.manual_seed(0)
    defense = {"kind": "gaussian", "sigma": 0.01}
    setting = Setting(FC2(SHAPE), FedSGD(), 64, SHAPE, 10, (0.0, 1.0), defense)
    client = ClientQuery(x[:64], y[:64], defense, FedSGD())
    rec = get("sign_bits", seed=0, faces=2).interrogate(client, setting, ThreatModel(server="malicious", aux=(x[64:], y[64:])))
    assert rec.info["stopped"].startswith("no unit was ever silent") and client.queries == 4
    assert torch.all(rec.inputs == 0.5)
