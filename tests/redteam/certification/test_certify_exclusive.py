"""exclusive_neurons in a certificate: the honest server's reading of an FC client's own first layer."""

from guardfl.redteam.certification.run import certify

FC = {
    "model": {"name": "fc2", "num_classes": 10, "state": "default"},
    "data": {"source": "lfw-faces", "limit": 16},
    "client": {"protocol": "fedsgd", "batch_size": 16},
    "attacks": [{"name": "exclusive_neurons", "threat": {"labels": "known"}}],
    "certify": {"max_ssim": 0.4, "batches": 1},
    "seed": 0,
}


def test_an_undefended_fc_client_on_a_small_batch_gives_its_faces_away():
    """FC-2 on one batch of 16 faces in [0, 1], undefended: the units that fire for one face alone, checked
    and peeled, read most of the batch exactly, and the certificate says how many were checked."""
    result = certify({**FC, "defense": None})
    assert result.status == "NOT CERTIFIED"
    (record,) = result.results
    assert record["attack"] == "exclusive_neurons" and record["threat"]["server"] == "honest"
    assert int(record["info"]["checked"]) >= 8 and record["recovered"]["exact"] >= 8


def test_sign_compression_leaves_it_nothing():
    """The same client with a batch of 64 (enough samples for the leak-rate bound) and sign compression."""
    result = certify({**FC, "data": {"source": "lfw-faces", "limit": 64}, "client": {"protocol": "fedsgd", "batch_size": 64},
                      "defense": {"kind": "sign"}})
    assert result.status == "CERTIFIED"
    (record,) = result.results
    assert int(record["info"]["checked"]) == 0 and record["recovered"]["above_max_ssim"] == 0
