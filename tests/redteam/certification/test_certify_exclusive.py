"""exclusive_neurons in a certificate: the honest server's reading of an FC client's own first layer."""

from guardfl.redteam.certification.run import certify

FC = {
    "model": {"name": "fc2", "num_classes": 10, "state": "default"},
    "data": {"source": "lfw-faces", "limit": 16},
    "client": {"protocol": "fedsgd", "batch_size": 16},
    "attacks": [{"name": "exclusive_neurons", "threat": {"labels": "known"}}],
    "certify": {"max_ssim": 0.4, "max_updates": 1},
    "seed": 0,
}


def test_an_undefended_fc_client_on_a_small_batch_gives_its_faces_away():
    """FC-2 on one batch of 16 faces in [0, 1], undefended: the units that fire for one face alone, checked
    and peeled, read most of the batch exactly, and the certificate says how many were checked."""
    result = certify({**FC, "defense": None, "certify": {**FC["certify"], "max_updates": 2}})
    assert result.status == "NOT CERTIFIED"  # two updates that give half their faces away refute a 5% claim
    record = result.results[0]
    assert record["attack"] == "exclusive_neurons" and record["threat"]["server"] == "honest"
    assert int(record["info"]["checked"]) >= 8 and record["recovered"]["exact"] >= 8


def test_sign_compression_leaves_it_nothing():
    """The same client with a batch of 64 and sign compression: nothing read. One update decides nothing
    (the unit is the update: 78 clean ones certify a 5% claim), so the verdict is INCONCLUSIVE and says so."""
    result = certify({**FC, "data": {"source": "lfw-faces", "limit": 64}, "client": {"protocol": "fedsgd", "batch_size": 64},
                      "defense": {"kind": "sign"}})
    rate = result.evidence["leak_rate"]
    assert result.status == "INCONCLUSIVE" and rate["leaked"] == 0 and rate["more_updates"]["more"] == 77
    (record,) = result.results
    assert int(record["info"]["checked"]) == 0 and record["recovered"]["above_max_ssim"] == 0
