import pytest
import torch

from guardfl.defenses import GradPrune, Stack, SignCompression
from guardfl.redteam import FedAvg, ThreatModel, simulate_client
from guardfl.redteam.modality.image.models import ConvNetSmall
from guardfl.redteam.threat import defense_kinds, unseeded


def test_knowledge_follows_the_threat(wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([3]), GradPrune(0.5), FedAvg())
    k = ThreatModel(labels="known").knowledge(obs)
    assert torch.equal(k.labels, torch.tensor([3])) and k.defense_config.kind == "gradprune"
    k = ThreatModel(labels="inferred", defense="unknown", fedavg="unknown").knowledge(obs)
    assert k.labels is None and k.defense_config is None and k.protocol is None


def test_unavailable_knowledge_is_refused(wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([3]))
    with pytest.raises(ValueError, match="no BatchNorm layers"):
        ThreatModel(bn="exact").knowledge(obs)
    bn_obs = simulate_client(ConvNetSmall((1, 25, 25)), faces[:2], torch.tensor([0, 1]))
    assert len(ThreatModel(bn="exact").knowledge(bn_obs).bn_target) == 2
    with pytest.raises(ValueError):
        ThreatModel(bn="psychic")


def test_defense_kinds_flattens_stacks():
    cfg = Stack(GradPrune(0.5), Stack(SignCompression())).config
    assert [c.kind for c in defense_kinds(cfg)] == ["gradprune", "sign"]
    assert [c.kind for c in defense_kinds(cfg.model_dump())] == ["gradprune", "sign"]  # a dict is parsed
    assert defense_kinds(None) == []


def test_public_data_is_a_threat_field_known_or_unknown():
    assert ThreatModel().public_data == "unknown" and ThreatModel(public_data="known").public_data == "known"
    with pytest.raises(ValueError):
        ThreatModel(public_data="partly")
    assert ThreatModel(public_data="known").fingerprint()["public_data"] == "known"


def test_inter_instahide_is_found_in_a_stack(tmp_path):
    import numpy as np

    from guardfl.redteam.threat import inter_instahide

    np.savez(tmp_path / "public.npz", x=np.zeros((4, 5, 5), dtype=np.uint8))
    inter = {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5},
                                           {"kind": "instahide", "mode": "inter", "public": str(tmp_path / "public.npz")}]}
    assert inter_instahide({"kind": "instahide", "mode": "intra"}) is None and inter_instahide(None) is None
    assert inter_instahide(inter).mode == "inter"


def test_unseeded_clears_every_seed_and_nothing_else():
    from guardfl.defenses import parse_config
    from guardfl.redteam.client import transmit as augment
    from guardfl.redteam.attacks import setting

    cfg = parse_config({"kind": "stack", "seed": 1, "nonfinite": "zero", "defenses": [
        {"kind": "gradprune", "ratio": 0.5, "seed": 2}, {"kind": "stack", "seed": 3, "defenses": [{"kind": "gaussian", "sigma": 0.1}]}]})
    bare = parse_config({"kind": "stack", "nonfinite": "zero", "defenses": [
        {"kind": "gradprune", "ratio": 0.5}, {"kind": "stack", "defenses": [{"kind": "gaussian", "sigma": 0.1}]}]})
    assert unseeded(cfg) == bare and unseeded(cfg).model_dump(mode="json") == bare.model_dump(mode="json")
    assert cfg.seed == 1 and cfg.defenses[0].seed == 2 and cfg.defenses[1].seed == 3  # the caller's config is left alone
    assert unseeded(None) is None
    assert all(leaf.seed is None for leaf in unseeded(cfg).leaves()) and unseeded(cfg).defenses[1].seed is None
    assert augment.unseeded is unseeded and setting.unseeded is unseeded  # one function: the simulator's and the settings'


def test_a_configs_threat_is_a_threat_model_without_aux():
    """The config's threat section is a ``ThreatModel``: its settings, in the order certificates record
    them; the attacker's auxiliary data is added by the run and never settable from a config."""
    from guardfl.errors import ConfigError
    from guardfl.redteam.config import load_config

    threat = load_config({"attacks": [{"name": "dlg", "threat": {"labels": "known"}}]}).attacks[0].threat
    assert isinstance(threat, ThreatModel) and threat.aux is None
    assert threat.as_config() == {"labels": "known", "bn": "none", "defense": "known", "fedavg": "known",
                                  "server": "honest", "public_data": "unknown"}
    assert list(threat.as_config()) == ["labels", "bn", "defense", "fedavg", "server", "public_data"]
    x, y = torch.rand(3, 1, 8, 8), torch.tensor([0, 1, 2])
    held = threat.with_aux((x, y))
    assert held.aux is not None and len(held.aux.images) == 3 and threat.aux is None
    assert held.as_config() == threat.as_config() and held.labels == "known"
    assert held.fingerprint()["aux"] == held.aux.digest() and threat.fingerprint()["aux"] is None
    assert held.with_aux(None).aux is None
    allowed = "allowed: bn, defense, fedavg, labels, public_data, server"
    with pytest.raises(ConfigError) as err:
        load_config({"attacks": [{"name": "dlg", "threat": {"aux": "faces.npz"}}]})
    assert str(err.value) == f"config.attacks.0.threat.aux: unknown key; {allowed}"
    with pytest.raises(ConfigError) as err:
        load_config({"attacks": [{"name": "dlg", "threat": {"zz": 1, "labels": "maybe", "aux": None}}]})
    assert str(err.value) == ("config.attacks.0.threat.labels: Input should be 'known' or 'inferred' (got 'maybe'); "
                              f"allowed: 'known' or 'inferred'; config.attacks.0.threat.zz: unknown key; {allowed}; "
                              f"config.attacks.0.threat.aux: unknown key; {allowed}")
    with pytest.raises(ConfigError, match=r"^config.attacks.0.threat: Input should be a valid dictionary .* \(got 'known'\)$"):
        load_config({"attacks": [{"name": "dlg", "threat": "known"}]})
