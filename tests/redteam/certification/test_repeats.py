"""The planner runs once what two attacks would compute alike: when a plan repeats another (iDLG given the
label DLG is granted), when it does not, and that the certificate says so without losing a leak."""

import dataclasses
import json

import pytest
import torch
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification import repeats
from guardfl.redteam.attacks import ATTACKS, get
from guardfl.redteam.certification.certificate import untimed
from guardfl.redteam.client.simulate import FedSGD, simulate_client
from guardfl.redteam.config import AttackSection
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import LeNetZhu, set_model_state
from guardfl.redteam.threat import ThreatModel

KNOWN, INFERRED = {"labels": "known"}, {"labels": "inferred"}


def _plan(name, budget=None, **threat):
    return AttackSection(name=name, budget=budget or {}, threat=threat)


def _observation(n=1, defense=None):
    x, y = lfw_faces(10)
    model = set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)
    return simulate_client(model, x[:n], y[:n], defense, FedSGD())


# -- which plans may repeat which ------------------------------------------------------------------------
def test_idlg_may_repeat_dlg_granted_labels_with_the_same_budget_and_threat():
    plans = [_plan("dlg", {"iterations": 5}, **KNOWN), _plan("idlg", {"iterations": 5}, **INFERRED)]
    assert repeats.find_repeats(plans) == [repeats.Repeat(plan=1, of=0)]
    # a budget written out with DLG's defaults is the same budget
    plans = [_plan("dlg", {"iterations": 5}, **KNOWN), _plan("idlg", {"iterations": 5, "history": 100}, **INFERRED)]
    assert repeats.find_repeats(plans) == [repeats.Repeat(plan=1, of=0)]


@pytest.mark.parametrize("plans", [
    [_plan("dlg", {"iterations": 5}, **KNOWN), _plan("idlg", {"iterations": 6}, **INFERRED)],  # another budget
    [_plan("dlg", {"iterations": 5}, labels="known", defense="unknown"), _plan("idlg", {"iterations": 5}, **INFERRED)],
    [_plan("dlg", {"iterations": 5}, **KNOWN)],  # nothing to repeat
    # another objective: group consistency and a consensus candidate, even without BatchNorm
    [_plan("inverting_gradients", {"iterations": 5}, **KNOWN), _plan("gradinversion", {"iterations": 5}, **KNOWN)],
])
def test_other_budgets_threats_or_objectives_are_not_repeats(plans):
    assert repeats.find_repeats(plans) == []


def test_gradinversion_declares_no_repeat():
    assert ATTACKS["gradinversion"].capabilities.same_run_as is None
    assert ATTACKS["inverting_gradients"].capabilities.same_run_as is None
    assert ATTACKS["idlg"].capabilities.same_run_as == "dlg"


# -- on one observation ------------------------------------------------------------------------------------
def test_restored_label_equal_to_the_granted_one_is_a_repeat():
    obs = _observation()
    plans = [_plan("dlg", **KNOWN), _plan("idlg", **INFERRED)]
    (rep,) = repeats.find_repeats(plans)
    found = repeats.reuse_on(rep, plans, obs, None, (3, 3))
    assert found is not None and found.labels == "inferred" and "repeats dlg's run exactly" in found.reason
    assert repeats.reuse_on(rep, plans, obs, None, (3, 4)) is None  # other seeds: other initial guesses


def test_dlg_optimising_labels_jointly_is_not_repeated():
    plans = [_plan("dlg", **INFERRED), _plan("idlg", **INFERRED)]
    (rep,) = repeats.find_repeats(plans)  # a candidate by its plan ...
    assert repeats.reuse_on(rep, plans, _observation(), None, (0, 0)) is None  # ... but DLG fixes no labels


def test_a_restored_label_other_than_the_granted_one_runs():
    obs = _observation()
    true = int(obs.side.labels[0])
    wrong = dataclasses.replace(obs, side=dataclasses.replace(obs.side, labels=torch.tensor([(true + 1) % 10])))
    plans = [_plan("dlg", **KNOWN), _plan("idlg", **INFERRED)]
    (rep,) = repeats.find_repeats(plans)
    assert repeats.reuse_on(rep, plans, obs, None, (0, 0)) is not None
    assert repeats.reuse_on(rep, plans, wrong, None, (0, 0)) is None


def test_both_granted_labels_repeat_at_any_batch_size():
    plans = [_plan("dlg", **KNOWN), _plan("idlg", **KNOWN)]
    (rep,) = repeats.find_repeats(plans)
    found = repeats.reuse_on(rep, plans, _observation(n=3), None, (0, 0))
    assert found is not None and found.labels == "known"


def test_a_reused_run_is_the_run_it_replaces():
    """The premise, checked: iDLG's own run equals DLG's (granted the label) bit for bit where ``reuse_on`` says so."""
    obs = _observation(defense={"kind": "outpost", "seed": 0})
    plans = [_plan("dlg", {"iterations": 8}, **KNOWN), _plan("idlg", {"iterations": 8}, **INFERRED)]
    (rep,) = repeats.find_repeats(plans)
    assert repeats.reuse_on(rep, plans, obs, None, (7, 7)) is not None
    dlg = get("dlg", iterations=8, seed=7, device="cpu").reconstruct(obs, ThreatModel(labels="known"))
    idlg = get("idlg", iterations=8, seed=7, device="cpu").reconstruct(obs, ThreatModel(labels="inferred"))
    assert torch.equal(dlg.inputs, idlg.inputs) and torch.equal(dlg.labels, idlg.labels)
    assert dlg.restart_objectives == idlg.restart_objectives and idlg.info["labels"] == "inferred"


# -- in a certificate --------------------------------------------------------------------------------------
CFG = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"limit": 4},
    "client": {"batch_size": 1},
    "attacks": [{"name": "dlg", "budget": {"iterations": 30}, "threat": KNOWN},
                {"name": "idlg", "budget": {"iterations": 30}, "threat": INFERRED}],
    "certify": {"max_ssim": 0.3, "max_updates": 3},  # a strict claim: no decision before the third update
}


def _run(tmp_path, name, capsys=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(CFG))
    main(["redteam", "--config", str(path), "--out", str(tmp_path / name)])
    out = capsys.readouterr().out if capsys else ""
    return json.loads((tmp_path / name / "certificate.json").read_text()), out


def test_the_certificate_names_the_reused_attack_and_loses_no_leak(tmp_path, monkeypatch, capsys, count_attack_runs):
    calls = count_attack_runs()
    cert, out = _run(tmp_path, "once", capsys)
    assert calls == ["dlg"] * 3  # iDLG computed nothing: its restored labels were DLG's on every batch
    by = {(r["batch"], r["attack"]): r for r in cert["results"]}
    for b in range(3):
        dlg, idlg = by[(b, "dlg")], by[(b, "idlg")]
        assert idlg["reused"]["from"] == f"b{b}-0-dlg" and "repeats dlg's run exactly" in idlg["reused"]["reason"]
        assert idlg["seconds"] == 0 and idlg["threat"]["labels"] == "inferred" and idlg["info"]["labels"] == "inferred"
        assert idlg["metrics"] == dlg["metrics"] and idlg["objective"] == dlg["objective"]
    (line,) = [a for a in cert["attacks"] if a["attack"] == "idlg"]
    assert line["status"] == "ran" and line["reused"]["from"] == "dlg" and line["reused"]["batches"] == [0, 1, 2]
    assert "[once] idlg: on 3 of 3 batches" in out
    assert "computed once" in (tmp_path / "once" / "report.html").read_text()

    # the same config with every run computed: the same leaks, the same certificate but for the notes
    monkeypatch.setattr(repeats, "find_repeats", lambda plans: [])
    full, _ = _run(tmp_path, "full")
    assert all("reused" not in r for r in full["results"])
    assert cert["evidence"] == full["evidence"] and cert["verdict"] == full["verdict"]
    assert cert["evidence"]["per_attack"]["idlg"]["leaked"] == cert["evidence"]["per_attack"]["dlg"]["leaked"] > 0
    strip = ("reused", "inputs", "config_hash")
    assert untimed(cert["results"], strip) == untimed(full["results"], strip)
    assert untimed(cert["attacks"], strip) == untimed(full["attacks"], strip)


def test_reuse_does_not_depend_on_the_worker_count(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CFG, "certify": {**CFG["certify"], "max_updates": 2}}))
    one = certify(path, workers=1).to_dict()
    two = certify(path, workers=2).to_dict()
    assert [r.get("reused", {}).get("from") for r in two["results"]] == [None, "b0-0-dlg", None, "b1-0-dlg"]
    assert untimed(one["results"]) == untimed(two["results"]) and untimed(one["attacks"]) == untimed(two["attacks"])
