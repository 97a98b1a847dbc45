"""A certificate against a malicious server says when the client's defense has a stage whose adapted
construction did not run (``judge.ADAPTED_BY``): its verdict rests on attacks that do not target it."""

from guardfl.redteam.certification.run import certify

TRAP = {"name": "trap_weights", "budget": {"chains": 8, "rows": 1}, "threat": {"server": "malicious", "labels": "known"}}
FC = {
    "model": {"name": "fc2", "num_classes": 10, "state": "default"},
    "data": {"source": "lfw-faces", "limit": 64},
    "client": {"protocol": "fedsgd", "batch_size": 64, "inspect": True},
    "aux": {"source": "lfw-faces", "offset": 64},
    "attacks": [TRAP],
    "certify": {"max_ssim": 0.4, "max_leak_rate": 0.05, "max_updates": 1},
    "seed": 0,
}


def test_sign_compression_against_a_malicious_server_without_sign_bits_is_flagged(tmp_path):
    cert = certify({**FC, "defense": {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5}, {"kind": "sign"}]}},
                   out=tmp_path)
    warned = [w for w in cert.warnings if w.startswith("the malicious-server construction adapted to sign (sign_bits) did not run")]
    assert len(warned) == 1, cert.warnings
    assert "adapted to sign (sign_bits) did not run" in (tmp_path / "report.html").read_text()
    # with sign_bits in the plan, a defense the red team adapts to (pruning: the boost), or an honest server: none
    bits = {"name": "sign_bits", "budget": {"faces": 1, "rounds": 1, "search_rounds": 2}, "threat": {"server": "malicious"}}
    for cfg in ({**FC, "defense": {"kind": "sign"}, "attacks": [TRAP, bits]},
                {**FC, "defense": {"kind": "gradprune", "ratio": 0.9}},
                {**FC, "defense": {"kind": "sign"}, "client": {"protocol": "fedsgd", "batch_size": 64},
                 "attacks": [{"name": "exclusive_neurons", "threat": {"labels": "known"}}]}):
        assert not [w for w in certify(cfg).warnings if "did not run" in w]
