"""Learned inversion against Inter-InstaHide: the simulated client mixes with the client's public set only
when the attacker holds it (``threat.public_data: known``), else with the attacker's own aux images."""

from __future__ import annotations

import numpy as np
import torch

from guardfl.redteam.attacks.learned.learned_inversion import simulated_public
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.threat import ThreatModel


def test_the_public_set_is_the_clients_only_when_known(tmp_path):
    public = (np.random.default_rng(0).random((6, 8, 8, 1)) * 255).astype(np.uint8)
    path = tmp_path / "public.npz"
    np.savez(path, x=public)
    aux = AuxData(torch.rand(5, 1, 8, 8), torch.zeros(5, dtype=torch.long))
    inter = {"kind": "instahide", "k": 2, "mode": "inter", "public": str(path)}
    known = simulated_public(inter, ThreatModel(public_data="known", aux=aux))
    assert known.shape[0] == 6 and not torch.equal(known[:5], aux.images)
    stack = {"kind": "stack", "defenses": [inter, {"kind": "gradprune", "ratio": 0.5}]}
    assert torch.equal(simulated_public(stack, ThreatModel(public_data="known", aux=aux)), known)
    assert simulated_public(inter, ThreatModel(aux=aux)) is aux.images  # unknown: the attacker's stand-ins
    assert simulated_public({"kind": "mixup"}, ThreatModel(public_data="known", aux=aux)) is aux.images
