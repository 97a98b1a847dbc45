"""The attack lifecycle in a certification: registry-driven planning, preparation cached across batches
and resumes, auxiliary data, strength, and failing attacks failing the run."""

import json

import pytest
import yaml

from guardfl.cli import main
from guardfl.redteam.certification import judge
from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification.plan import plan_attacks, resolve_strength
from guardfl.redteam.certification.measure import recovered as measure_recovered
from guardfl.redteam.attacks import ATTACKS, AttackFailed, LearnedInversion, Setting
from guardfl.redteam.client.simulate import FedSGD, simulate_client
from guardfl.redteam.config import load_config
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import LeNetZhu, set_model_state

LTI_TINY = {"hidden": 64, "epochs": 3, "batch": 32, "lr": 1e-3}
BASE = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"limit": 10},  # the population: faces 0-9; the attacker's start at 10
    "client": {"batch_size": 1},
    "defense": {"kind": "sign"},
    "aux": {"source": "lfw-faces", "offset": 10, "limit": 60, "ood": {"source": "lfw-nonfaces", "limit": 20, "samples": 40}},
    "attacks": [{"name": "learned_inversion", "budget": LTI_TINY}, {"name": "dlg", "budget": {"iterations": 5}}],
    "certify": {"max_ssim": 0.99, "max_updates": 2},
}


def _write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def _setting(n=1):
    x, y = lfw_faces(10)
    model = set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)
    return Setting.of(simulate_client(model, x[:n], y[:n], None, FedSGD()))


def test_attacks_all_lists_every_registered_attack_with_a_status():
    cfg = load_config({"attacks": "all", "client": {"batch_size": 2}})
    plans, listing = plan_attacks(cfg, _setting(2), "quick", aux=None)
    assert {a["attack"] for a in listing} == set(ATTACKS)
    status = {a["attack"]: a for a in listing}
    assert status["learned_inversion"]["status"] == "not applicable"
    assert "auxiliary data" in status["learned_inversion"]["reason"]
    # iDLG restores ONE label (its default threat: labels inferred): not applicable to a batch of 2
    assert status["idlg"]["status"] == "not applicable" and "at most 1 sample" in status["idlg"]["reason"]
    # the malicious-server attacks: not part of the honest-server certificate that `all` makes
    for name in ("robbing_the_fed", "fishing", "trap_weights", "seer", "sign_bits"):
        assert status[name]["status"] == "not applicable" and "threat.server: malicious" in status[name]["reason"]
    # TAG reconstructs text: not applicable to an image client
    assert status["tag"]["status"] == "not applicable" and "text" in status["tag"]["reason"]
    # exclusive units are read from a first linear layer on the flattened input: LeNet's first layer is a convolution
    assert status["exclusive_neurons"]["status"] == "not applicable"
    assert "nn.Linear on the whole flattened input" in status["exclusive_neurons"]["reason"]
    assert {p.name for p in plans} == set(ATTACKS) - {"learned_inversion", "idlg", "robbing_the_fed", "fishing", "trap_weights", "threshold_bins",
                                                      "seer", "sign_bits", "tag", "embedding_readout", "exclusive_neurons",
                                                      "prior_aware"}
    # the prior-aware attack picks among candidates (auxiliary data) for one sample an update
    assert status["prior_aware"]["status"] == "not applicable" and "at most 1 sample" in status["prior_aware"]["reason"]
    for line in listing:
        if line["status"] == "not applicable":
            continue
        cls = ATTACKS[line["attack"]]
        assert line["budget"] == cls.budget_for("quick") and line["paper_budget"] == cls.budget_for("paper")
        assert line["paper_reference"]
    # iDLG's own default threat (labels inferred) at n=1
    _, listing = plan_attacks(load_config({"attacks": "all"}), _setting(1), "paper", aux=None)
    idlg = next(a for a in listing if a["attack"] == "idlg")
    assert idlg["threat"]["labels"] == "inferred" and idlg["budget"]["iterations"] == 6000


def test_a_configured_attack_that_cannot_apply_is_a_config_error(tmp_path, capsys):
    cfg = {**BASE, "aux": None}
    assert main(["redteam", "--config", str(_write(tmp_path, cfg)), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "learned_inversion: not applicable" in capsys.readouterr().err


def test_the_inverter_is_trained_once_and_a_resume_never_retrains_it(tmp_path, monkeypatch):
    calls = []
    real = LearnedInversion._prepare

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(LearnedInversion, "_prepare", counting)
    path = _write(tmp_path, BASE)
    cert = certify(path, out=tmp_path / "r", strength="quick")
    assert len(calls) == 1  # two private batches, one training
    (prep,) = cert.preparations.values()
    assert prep["cached"] is False and prep["aux_images"] == 60 + 20 + 40
    trained = prep
    assert cert.strength == "quick"
    saved = json.loads((tmp_path / "r" / "certificate.json").read_text())
    assert {a["attack"]: a["status"] for a in saved["attacks"]}["gradinversion"] == "not requested"
    assert saved["priors"]["0"][0]["ssim"] is not None
    # a killed run: the second batch's LTI job is missing; the resume re-attacks it with the cached inverter
    (tmp_path / "r" / "state" / "b1-0-learned_inversion.json").unlink()
    cert = certify(path, out=tmp_path / "r", resume=True, strength="quick")
    assert len(calls) == 1  # the inverter came from the state folder
    (prep,) = cert.preparations.values()
    assert prep == trained  # the certificate says how it was prepared: as the uninterrupted run's does
    page = (tmp_path / "r" / "report.html").read_text()
    assert "prior guess" in page and "learned_inversion" in page and "quick" in page


def test_aux_data_overlapping_the_private_faces_is_refused(tmp_path, capsys):
    cfg = {**BASE, "data": {"limit": 2}, "aux": {"source": "lfw-faces", "offset": 1}}  # draws faces 0 and 1
    assert main(["redteam", "--config", str(_write(tmp_path, cfg)), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "aux: 1 auxiliary image(s) are private images" in err and "disjoint" in err and len(err.strip().splitlines()) == 1


def test_a_failing_attack_fails_the_run(tmp_path, monkeypatch, capsys):
    def broken(self, *a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(ATTACKS["dlg"], "_reconstruct", broken)
    with pytest.raises(AttackFailed, match="attack dlg failed on client batch 0: RuntimeError: out of memory"):
        certify({**BASE, "attacks": [{"name": "dlg", "budget": {"iterations": 5}}]})
    path = _write(tmp_path, {**BASE, "attacks": [{"name": "dlg", "budget": {"iterations": 5}}]})
    assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "attack dlg failed" in capsys.readouterr().err
    assert not (tmp_path / "o" / "certificate.json").exists()  # no verdict without every attack


def test_strength_sets_the_budgets_and_configured_budgets_override_it(tmp_path):
    cfg = load_config({**BASE, "attacks": [{"name": "dlg", "budget": {"restarts": 2}}]})
    plans, listing = plan_attacks(cfg, _setting(1), "paper", aux=None)
    assert plans[0].budget == {"iterations": 6000, "restarts": 2}
    with pytest.raises(ValueError, match="strength"):
        resolve_strength("huge", __import__("torch").device("cpu"))
    assert resolve_strength("auto", __import__("torch").device("cpu")) == "quick"
    assert cfg.digest("quick") != cfg.digest("paper")


def test_prior_margin_lets_a_reconstruction_match_the_prior_but_not_beat_it():
    cfg = load_config({"certify": {"max_ssim": 0.4, "prior_margin": 0.05}})
    row = lambda ssim: {"batch": 0, "attack": "a", "metrics": {"per_image": [{"index": 0, "ssim": ssim}], "summary": {}}}  # noqa: E731
    priors = {0: [{"ssim": 0.5, "psnr": 10.0}]}
    leaked = lambda ssim, prior: judge.sample_leaks(cfg, [row(ssim)], prior)[(0, 0)]  # noqa: E731
    assert not leaked(0.54, priors)                                   # within the margin of the prior
    (hit,) = leaked(0.56, priors)
    assert hit["attack"] == "a" and hit["limit"] == pytest.approx(0.55)
    assert leaked(0.54, None)                                         # no aux: absolute threshold
    (worst,) = judge.worst_images(cfg, [row(0.56)], priors)
    assert worst["exceeds"] and worst["where"]["threshold_here"] == pytest.approx(0.55)


def test_a_read_repeated_to_the_batch_counts_against_one_image():
    """``fill_batch`` copies of one face-like read are matched to several faces; the read counts once,
    against the image it leaks most, and a distinct read still counts on its own."""
    cfg = load_config({"certify": {"max_ssim": 0.4, "prior_margin": 0.05}})
    per_image = [{"index": 0, "read": 0, "ssim": 0.45}, {"index": 1, "read": 0, "ssim": 0.72},
                 {"index": 2, "read": 0, "ssim": 0.5}, {"index": 3, "read": 3, "ssim": 0.6},
                 {"index": 4, "read": 0, "ssim": 0.1}]
    result = {"batch": 0, "attack": "a", "metrics": {"per_image": per_image, "summary": {}}}
    leaks = judge.sample_leaks(cfg, [result], None)
    assert sorted(i for (_, i), hits in leaks.items() if hits) == [1, 3]
    found = judge.leak_evidence(cfg, [result], None, {})
    assert found["leak_rate"]["leaked"] == 2 and found["per_attack"]["a"]["leaked"] == 2
    # another attack's read of the same faces counts on its own
    other = {**result, "attack": "b", "metrics": {"per_image": [{**p, "read": 7} for p in per_image], "summary": {}}}
    assert sorted(i for (_, i), hits in judge.sample_leaks(cfg, [result, other], None).items() if hits) == [1, 3]
    # rows without a read (text, older records) are each their own
    plain = {**result, "metrics": {"per_image": [{k: v for k, v in p.items() if k != "read"} for p in per_image],
                                   "summary": {}}}
    assert sum(1 for hits in judge.sample_leaks(cfg, [plain], None).values() if hits) == 4
    cfg_rec = load_config({"certify": {"max_ssim": 0.4}})
    assert measure_recovered({"per_image": per_image}, cfg_rec)["above_max_ssim"] == 2
