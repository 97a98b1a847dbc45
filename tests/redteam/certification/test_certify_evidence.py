"""The certificate's claims end to end: updates drawn at random from a stated population, the leak rate
with its anytime bounds, the verdict rule, a budget too small to decide, the --samples override, resuming
an INCONCLUSIVE run with more updates, and what the report shows."""

import json

import pytest
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from guardfl.redteam.config import load_config
from guardfl.redteam.certification import sequential

CHEAP = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"source": "lfw-faces", "limit": 20},
    "client": {"batch_size": 1},
    "defense": {"kind": "gradprune", "ratio": 0.99},
    "attacks": [{"name": "dlg", "budget": {"iterations": 5}}],
    "certify": {"max_ssim": 0.5, "max_updates": 3},
}


def _write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_too_few_updates_are_inconclusive_exit_3_and_say_how_many_would_decide(tmp_path, capsys):
    code = main(["redteam", "--config", str(_write(tmp_path, CHEAP)), "--out", str(tmp_path / "o"), "--quiet"])
    out = capsys.readouterr().out
    cert = json.loads((tmp_path / "o" / "certificate.json").read_text())
    rate = cert["evidence"]["leak_rate"]
    assert code == 3 and cert["verdict"] == "INCONCLUSIVE" and cert["certified"] is False
    assert rate["leaked"] == 0 and rate["updates"] == 3 and rate["unit"] == "update"
    assert rate["upper_bound"] == pytest.approx(sequential.upper_bound([0.0] * 3, 0.05))
    assert rate["updates_needed_without_leaks"] == 78 and rate["more_updates"]["more"] == 75
    assert "at least 78 updates are needed" in " ".join(cert["warnings"])
    assert "INCONCLUSIVE" in out and "0 of 3" in out and "75 more update(s)" in out


def test_resume_gives_an_inconclusive_run_the_updates_that_would_decide(tmp_path, count_attack_runs):
    """--resume of a run that ended INCONCLUSIVE at its budget attacks only the new updates, and with a
    clean client that is enough to certify; --more sets how many."""
    cfg = {**CHEAP, "certify": {"max_ssim": 0.5, "max_leak_rate": 0.3, "max_updates": 4}}
    path = _write(tmp_path, cfg)
    need = sequential.zero_leak_updates(0.3, 0.05)
    first = certify(path, out=tmp_path / "o")
    assert first.verdict == "INCONCLUSIVE" and first.evidence["leak_rate"]["more_updates"]["more"] == need - 4
    calls = count_attack_runs()
    again = certify(path, out=tmp_path / "o", resume=True)
    assert again.verdict == "CERTIFIED" and again.evidence["stop"]["updates"] == need and len(calls) == need - 4
    assert again.evidence["leak_rate"]["per_update"][:4] == first.evidence["leak_rate"]["per_update"]
    third = certify(path, out=tmp_path / "m", resume=True, more=None)
    assert third.evidence["stop"]["updates"] == 4  # a fresh folder: the config's budget
    with pytest.raises(Exception, match="more: only with --resume of a run that ended INCONCLUSIVE"):
        certify(path, out=tmp_path / "n", resume=True, more=3)


def test_samples_are_drawn_at_random_reproducibly_and_differ_across_seeds():
    a, b, c = (certify({**CHEAP, "seed": seed}) for seed in (0, 0, 1))
    assert a.population["indices"] == b.population["indices"] != c.population["indices"]
    assert a.population["indices"] != [0, 1, 2] and len(a.population["per_update"]) == 3
    assert a.population["size"] == 20 and a.population["source"] == "lfw-faces"
    # the images attacked are the drawn ones
    from guardfl.redteam.modality.image.data import lfw_faces

    faces = lfw_faces()[0]
    for b_, index in enumerate(a.population["indices"]):
        assert (a.originals[b_][0] == faces[index]).all()


def test_leaks_count_per_sample_per_attack_and_per_class(tmp_path):
    """Undefended, DLG recovers the faces: every sample leaks, the bound says so, and the classes are listed."""
    cfg = {**CHEAP, "defense": None, "attacks": [{"name": "dlg", "budget": {"iterations": 60}}],
           "certify": {"max_ssim": 0.3, "max_updates": 3}}
    cert = certify(cfg, out=tmp_path / "o")
    rate = cert.evidence["leak_rate"]
    leaked = rate["leaked"]
    assert leaked >= 1 and cert.verdict in ("NOT CERTIFIED", "INCONCLUSIVE")
    assert rate["upper_bound"] == pytest.approx(sequential.upper_bound(rate["per_update"], 0.05))
    assert cert.evidence["per_attack"]["dlg"]["leaked"] == leaked
    classes = cert.evidence["per_class"]
    assert sum(c["samples"] for c in classes) == 3 and sum(c["leaked"] for c in classes) == leaked
    assert [c["observed_rate"] for c in classes] == sorted((c["observed_rate"] for c in classes), reverse=True)
    page = (tmp_path / "o" / "report.html").read_text()
    assert "Claims" in page and f"{leaked} of 3" in page and f"{rate['upper_bound']:.3g}" in page
    assert "Per class" in page and "Leaked samples" in page
    assert "Every attacked sample" in page and "samples 1-3 (batches 0-2); rows: original / dlg" in page
    from guardfl.redteam.reports.image import overview

    ((caption, png),) = overview(cert)
    assert png.startswith(b"\x89PNG") and "rows: original / dlg" in caption


def test_enough_updates_without_a_leak_certify_and_the_default_budget_is_twice_enough():
    cfg = load_config({**CHEAP, "certify": {"max_ssim": 0.5, "max_leak_rate": 0.5, "confidence": 0.9}})
    need = sequential.zero_leak_updates(0.5, 0.1)
    assert cfg.certify.max_updates == 2 * need
    cert = certify(cfg)
    assert cert.verdict == "CERTIFIED" and cert.evidence["leak_rate"]["upper_bound"] < 0.5
    assert cert.evidence["stop"] == {**cert.evidence["stop"], "reason": "decided", "updates": need}


def test_the_samples_override_sets_the_budget_and_says_so(tmp_path, capsys):
    path = _write(tmp_path, CHEAP)
    main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--samples", "2", "--quiet"])
    cert = json.loads((tmp_path / "o" / "certificate.json").read_text())
    assert cert["evidence"]["leak_rate"]["samples"] == 2 and cert["config"]["certify"]["max_updates"] == 2
    assert any("--samples 2" in w and "smaller budget" in w for w in cert["warnings"])
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        main(["redteam", "--config", str(path), "--samples", "0"])
    assert exited.value.code == 2 and "--samples: expected an integer >= 1" in capsys.readouterr().err


def test_a_population_smaller_than_one_update_is_one_line(tmp_path, capsys):
    cfg = {**CHEAP, "client": {"batch_size": 3}, "data": {"source": "lfw-faces", "limit": 2}}
    assert main(["redteam", "--config", str(_write(tmp_path, cfg)), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has 2 images" in err and "needs 3 distinct" in err


def test_a_small_population_supports_many_updates(tmp_path):
    """Updates are independent draws: a population of 2 faces can be attacked 5 times (fresh defense noise
    each time, as in a deployment that sends a face every round)."""
    cert = certify({**CHEAP, "data": {"source": "lfw-faces", "limit": 2}, "certify": {"max_ssim": 0.5, "max_updates": 5}})
    assert cert.population["updates"] == 5 and cert.population["distinct"] <= 2


def test_more_is_for_a_resume_and_in_range(tmp_path, capsys):
    path = _write(tmp_path, CHEAP)
    assert main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--more", "5", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == "error: --more: only with --resume (more updates for a run that ended INCONCLUSIVE)"
    with pytest.raises(SystemExit) as exited:
        main(["redteam", "--config", str(path), "--resume", "--more", "0"])
    assert exited.value.code == 2 and "--more: expected an integer >= 1" in capsys.readouterr().err


def test_resume_with_more_adds_exactly_that_many(tmp_path):
    path = _write(tmp_path, CHEAP)
    assert certify(path, out=tmp_path / "o").evidence["stop"]["updates"] == 3
    again = certify(path, out=tmp_path / "o", resume=True, more=2)
    assert again.evidence["stop"]["updates"] == 5 and again.verdict == "INCONCLUSIVE"
