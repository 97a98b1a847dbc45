"""The report's overview grid ("Every attacked sample"): an attack run several times shows, for each sample,
its run closest to that sample, so a red frame sits on the picture that leaked it."""

from guardfl.redteam.certification.run import certify
from guardfl.redteam.reports.image import closest_run, overview


def test_an_attack_run_twice_shows_the_run_that_leaked_each_sample():
    """Two runs of ``trap_weights`` against an inspecting client: the whole-layer trap is refused (a grey
    guess, and the last run listed), the single-row trap passes and reads faces. The grid drew the last run
    of each attack and framed, on its grey cells, the faces the other run leaked."""
    trap = {"name": "trap_weights", "threat": {"server": "malicious", "labels": "known"}}
    cert = certify({"model": {"name": "fc2", "num_classes": 10, "state": "default"},
                    "data": {"source": "lfw-faces", "limit": 32},
                    "client": {"protocol": "fedsgd", "batch_size": 32, "inspect": True},
                    "aux": {"source": "lfw-faces", "offset": 64},
                    "attacks": [{**trap, "budget": {"chains": 8, "rows": 1}}, trap],
                    "certify": {"max_ssim": 0.4, "max_leak_rate": 0.05, "max_updates": 1}, "seed": 0})
    reading, refused = cert.results
    assert refused["info"].get("refused") and not reading["info"].get("refused")
    leaked = [row["image"] for row in cert.evidence["leaked_samples"]]
    assert leaked
    for i in leaked:
        run, row = closest_run([reading, refused], i)
        assert run is reading and row["ssim"] > 0.4
    assert closest_run([], 0) is None
    (caption, png), = overview(cert, per_picture=32)
    assert "rows: original / trap_weights / attacker's answer" in caption and png.startswith(b"\x89PNG")  # the last row: re-identification
