"""A malicious server in the certificate of a client that encodes its inputs (MixUp, InstaHide): the
constructions read encodings, over many rounds, and the certificate judges them demixed, never raw."""

from guardfl.redteam.certification.run import certify
from tests.seeding import seeded
from tests.claims import leaked


def _config(defense: dict, **client) -> dict:
    """FC-2 on 32 faces against ``trap_weights``; the defense seeded (a deployed encoding draws from OS entropy:
    one CI run read 4 faces past 0.4 where these runs read 11; a test takes one fixed draw)."""
    return {"model": {"name": "fc2", "num_classes": 10, "state": "default"},
            "data": {"source": "lfw-faces", "limit": 32}, "client": {"protocol": "fedsgd", "batch_size": 32, **client},
            "defense": seeded(defense), "aux": {"source": "lfw-faces", "offset": 64},
            "attacks": [{"name": "trap_weights", "threat": {"server": "malicious", "labels": "known"}}],
            "certify": {"max_ssim": 0.4, "max_leak_rate": 0.05, "max_updates": 1}, "seed": 0}


def test_instahide_against_a_malicious_server_that_reads_and_demixes_its_encodings():
    """Intra-InstaHide (k = 4) on 32 faces: read raw, the trap's encodings passed nothing (the config's 64-face
    form certified, worst SSIM 0.17); 16 rounds of reads demixed leave 4-11 of 32 faces past 0.4 over unseeded runs (up to 0.92)."""
    cert = certify(_config({"kind": "instahide", "k": 4, "max_coeff": 0.65}))
    assert leaked(cert) > 0
    (record,) = cert.results
    info = record["info"]
    assert info["encoded_rounds"].endswith("over 16 rounds of fresh encodings of the batch")
    assert info["decode"].startswith("blind demixing of") and int(info["rounds_answered"]) == 16
    assert record["recovered"]["above_max_ssim"] >= 3


def test_mixup_soft_labels_and_a_round_budget():
    """MixUp's soft labels reach the trap's peeling (it crashed on them); the client's round budget bounds
    the rounds the server collects."""
    cert = certify(_config({"kind": "mixup", "k": 4, "max_coeff": 0.65}, max_rounds=4))
    (record,) = cert.results
    assert record["info"]["encoded_rounds"].endswith("over 4 rounds of fresh encodings of the batch")
    assert leaked(cert) > 0 and record["recovered"]["above_max_ssim"] >= 10


def test_a_refused_construction_is_nothing_sent_and_not_decoded():
    """The inspecting client refuses the imprint block at once: the record is the grey guess of the private
    images (in their range, not the encodings'), with the reason, and no decoding line."""
    cfg = _config({"kind": "instahide", "k": 4, "max_coeff": 0.65}, inspect=True)
    cfg["attacks"] = [{"name": "robbing_the_fed", "threat": {"server": "malicious", "labels": "known"}}]
    cert = certify(cfg)
    (record,) = cert.results
    assert record["info"]["refused"].startswith("architecture") and "decode" not in record["info"]
    assert record["recovered"]["above_max_ssim"] == 0


def test_inter_instahide_reads_have_their_known_public_partners_subtracted():
    """Inter-InstaHide (each face mixed with 3 public non-faces) and a server holding the public set: the 16
    rounds' encodings are decoded with their public partners subtracted (15 of 32 past 0.4, 1 exact)."""
    from pathlib import Path

    public = Path(__file__).resolve().parents[3] / "configs" / "public" / "lfw-nonfaces-64.npz"
    cfg = _config({"kind": "instahide", "k": 4, "max_coeff": 0.65, "mode": "inter", "public": str(public)})
    cfg["attacks"][0]["threat"]["public_data"] = "known"
    cert = certify(cfg)
    (record,) = cert.results
    assert record["info"]["decode"].startswith("public partners identified in the known public set (64 images)")
    assert leaked(cert) > 0 and record["recovered"]["above_max_ssim"] >= 5


def test_fedavg_and_an_encoding_under_noise_are_read_the_same_way():
    """FedAvg (every local step its own encodings) and InstaHide stacked under Gaussian noise: the rounds are
    collected, never averaged (each round's reads are of other encodings), and decoded."""
    cfg = _config({"kind": "instahide", "k": 4, "max_coeff": 0.65})
    cfg["client"] = {"protocol": "fedavg", "batch_size": 8, "epochs": 1, "lr": 0.1, "samples": 8}
    (record,) = certify(cfg).results
    assert record["info"]["encoded_rounds"].endswith("over 16 rounds of fresh encodings of the batch")
    assert record["info"]["decode"].startswith("blind demixing of")
    noisy = _config({"kind": "stack", "defenses": [{"kind": "instahide", "k": 4, "max_coeff": 0.65},
                                                   {"kind": "gaussian", "sigma": 0.001}]})
    (record,) = certify(noisy).results
    assert record["info"]["repeats"].startswith("1 (the client encodes its inputs afresh every round")
    assert "over 16 rounds" in record["info"]["encoded_rounds"]
