"""End to end: a certificate under DP-SGD, MixUp, InstaHide, Soteria and GradDefense lists learned
inversion as ran (the defense simulated as augmentation), at tiny budgets."""

import pytest

from guardfl.redteam.certification.run import certify
from tests.claims import LOOSE_CLAIM

LTI_TINY = {"hidden": 32, "epochs": 2, "batch": 32, "lr": 1e-3, "refresh_every": 1}
BASE = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"limit": 4},
    "aux": {"source": "lfw-faces", "offset": 10, "limit": 40},
    "attacks": [{"name": "learned_inversion", "budget": LTI_TINY}],
    "certify": {"max_ssim": 0.99, "max_updates": 1, **LOOSE_CLAIM},  # one update: the verdict is not what this tests
}


@pytest.mark.parametrize("defense, batch", [
    ({"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}, 1),
    ({"kind": "mixup", "k": 2}, 2),
    ({"kind": "instahide", "k": 2}, 2),
    ({"kind": "soteria", "prune": 0.5}, 1),
    ({"kind": "graddefense"}, 1),
], ids=["dpsgd", "mixup", "instahide", "soteria", "graddefense"])
def test_learned_inversion_ran_under_the_defense(defense, batch):
    cert = certify({**BASE, "defense": defense, "client": {"batch_size": batch}})
    status = {a["attack"]: a for a in cert.attacks}
    assert status["learned_inversion"]["status"] == "ran"
    (result,) = [r for r in cert.results if r["attack"] == "learned_inversion"]
    assert len(result["metrics"]["per_image"]) == batch  # the private images themselves, never the encodings
    assert "encodings" not in result
    (prep,) = cert.preparations.values()
    assert prep["defense_augmentation"] is True
    assert prep["fresh_draws"] is (defense["kind"] != "soteria")  # Soteria is deterministic: one draw


def test_inter_instahide_trains_with_the_attackers_images_as_partners(tmp_path):
    """The client's public set stays the client's: the inverter mixes with the attacker's aux faces."""
    import numpy as np

    path = tmp_path / "public.npz"
    np.savez(path, x=(np.random.default_rng(0).random((8, 25, 25)) * 255).astype(np.uint8))
    defense = {"kind": "instahide", "k": 2, "mode": "inter", "public": str(path)}
    cert = certify({**BASE, "defense": defense, "client": {"batch_size": 1}})
    assert {a["attack"]: a["status"] for a in cert.attacks}["learned_inversion"] == "ran"
