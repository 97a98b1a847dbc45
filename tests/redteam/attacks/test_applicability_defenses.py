"""No attack drops out because of the defense: for every defense kind guardfl ships (at a valid default
configuration) and every registered attack, on image and text settings (FedSGD and FedAvg) and under
several threats, ``Attack.applicable`` (and the quick budget's ``refuses``, which a planner asks next) with the defense
equals its answer without it. "Not applicable"
may come from the modality, the threat or the architecture, never from the defense (an attack that cannot
adapt to a defense attacks it as it is; the certificate then rests on what it does)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from guardfl.defenses import REGISTRY, from_config
from guardfl.redteam import FedAvg, FedSGD, ThreatModel, simulate_client
from guardfl.redteam.attacks import Setting
from guardfl.redteam.attacks.registry import ATTACKS
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.modality.image.models import LeNetZhu, set_model_state
from guardfl.redteam.modality.text.models import Transformer3, next_token_labels

L = 8


def default_configs(public: str) -> dict[str, dict]:
    """A valid configuration of every registered kind (its defaults where it has them)."""
    configs = {
        "dpsgd": {"kind": "dpsgd", "noise_multiplier": 1.0},
        "instahide-inter": {"kind": "instahide", "mode": "inter", "public": public},
        "gaussian": {"kind": "gaussian", "sigma": 0.01},
        "laplace": {"kind": "laplace", "scale": 0.01},
        "gradprune": {"kind": "gradprune", "ratio": 0.9},
        "stack": {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5}, {"kind": "sign"}]},
    }
    for kind in REGISTRY:
        if kind not in configs and kind != "identity":
            configs[kind] = {"kind": kind}
    assert set(REGISTRY) - {"identity"} <= {c["kind"] for c in configs.values()}, "a registered kind has no config here"
    # every configuration is valid, and what the certificate records (the parsed config) is what we pass
    return {name: from_config(c).config.model_dump(mode="json") for name, c in configs.items()}


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    path = tmp_path_factory.mktemp("public") / "public.npz"
    np.savez(path, x=(np.random.default_rng(0).random((8, 25, 25)) * 255).astype(np.uint8))
    return str(path)


@pytest.fixture(scope="module")
def image():
    model = set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)
    x, y = torch.rand(4, 1, 25, 25), torch.arange(4)
    aux = (torch.rand(16, 1, 25, 25), torch.arange(16) % 10)
    return [Setting.of(simulate_client(model, x[:1], y[:1])),
            Setting.of(simulate_client(model, x, y, protocol=FedAvg(batch_size=2)))], aux


@pytest.fixture(scope="module")
def text():
    torch.manual_seed(0)
    lm = Transformer3(vocab_size=100, width=16, heads=2, ffn=32, layers=1, context=16)
    ids = torch.randint(0, 100, (4, L))
    aux_ids = torch.randint(0, 100, (16, L))
    return [Setting.of(simulate_client(lm, ids[:1], next_token_labels(ids[:1]))),
            Setting.of(simulate_client(lm, ids, next_token_labels(ids), protocol=FedAvg(batch_size=2)))], \
        AuxData(aux_ids, next_token_labels(aux_ids))


def threats(aux) -> list[ThreatModel]:
    return [ThreatModel(), ThreatModel(labels="known", defense="known", aux=aux),
            ThreatModel(labels="known", defense="unknown", aux=aux), ThreatModel(fedavg="unknown", defense="known", aux=aux),
            ThreatModel(server="malicious", defense="known", aux=aux)]


@pytest.mark.parametrize("modality", ["image", "text"])
def test_no_attack_is_inapplicable_because_of_the_defense(modality, image, text, public):
    settings, aux = image if modality == "image" else text
    found = []
    for setting in settings:
        assert setting.defense_config is None and setting.modality == modality
        for threat in threats(aux):
            for name, attack in sorted(ATTACKS.items()):
                budget = attack(**attack.budget_for("quick"))
                plain = attack.applicable(setting, threat) or budget.refuses(setting)
                for kind, config in default_configs(public).items():
                    with_defense = replace(setting, defense_config=config)
                    defended = attack.applicable(with_defense, threat) or budget.refuses(with_defense)
                    if defended != plain:
                        found.append(f"{name} under {kind} ({setting.protocol.name}, {threat.labels}/{threat.defense}/"
                                     f"{threat.fedavg}/{threat.server}): {defended!r} (undefended: {plain!r})")
    assert not found, "\n".join(found)


def test_learned_inversion_runs_under_every_defense_kind(image, public):
    """The attack the issue is about: applicable under every kind with the defense known."""
    (fedsgd, fedavg), aux = image
    threat = ThreatModel(labels="known", defense="known", aux=aux)
    for config in default_configs(public).values():
        for setting in (fedsgd, fedavg):
            assert ATTACKS["learned_inversion"].applicable(replace(setting, defense_config=config), threat) is None
