"""The certificate's population claim end to end: random samples from a stated population, the leak rate
with its bound, the verdict rule, too few samples, the --samples override, and what the report shows."""

import json

import pytest
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from guardfl.redteam.config import load_config
from guardfl.redteam.certification.evidence import upper_bound

CHEAP = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"source": "lfw-faces", "limit": 20},
    "client": {"batch_size": 1},
    "defense": {"kind": "gradprune", "ratio": 0.99},
    "attacks": [{"name": "dlg", "budget": {"iterations": 5}}],
    "certify": {"max_ssim": 0.5, "batches": 3},
}


def _write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_too_few_samples_are_insufficient_evidence_whatever_the_measurements(tmp_path, capsys):
    code = main(["redteam", "--config", str(_write(tmp_path, CHEAP)), "--out", str(tmp_path / "o"), "--quiet"])
    out = capsys.readouterr().out
    cert = json.loads((tmp_path / "o" / "certificate.json").read_text())
    rate = cert["evidence"]["leak_rate"]
    assert code == 1 and cert["verdict"] == "INSUFFICIENT EVIDENCE" and cert["certified"] is False
    assert rate["leaked"] == 0 and rate["samples"] == 3 and rate["upper_bound"] == pytest.approx(upper_bound(0, 3, 0.95))
    assert rate["samples_needed"] == 59 and "59 samples are needed" in " ".join(cert["warnings"])
    assert "INSUFFICIENT EVIDENCE" in out and "0 of 3" in out


def test_samples_are_drawn_at_random_reproducibly_and_differ_across_seeds():
    a, b, c = (certify({**CHEAP, "seed": seed}) for seed in (0, 0, 1))
    assert a.population["indices"] == b.population["indices"] != c.population["indices"]
    assert a.population["indices"] != [0, 1, 2] and len(set(a.population["indices"])) == 3
    assert a.population["size"] == 20 and a.population["source"] == "lfw-faces"
    # the images attacked are the drawn ones
    from guardfl.redteam.modality.image.data import lfw_faces

    faces = lfw_faces()[0]
    for b_, index in enumerate(a.population["indices"]):
        assert (a.originals[b_][0] == faces[index]).all()


def test_leaks_count_per_sample_per_attack_and_per_class(tmp_path):
    """Undefended, DLG recovers the faces: every sample leaks, the bound says so, and the classes are listed."""
    cfg = {**CHEAP, "defense": None, "attacks": [{"name": "dlg", "budget": {"iterations": 60}}],
           "certify": {"max_ssim": 0.3, "batches": 3}}
    cert = certify(cfg, out=tmp_path / "o")
    rate = cert.evidence["leak_rate"]
    leaked = rate["leaked"]
    assert leaked >= 1 and cert.verdict == "NOT CERTIFIED"
    assert rate["upper_bound"] == pytest.approx(upper_bound(leaked, 3, 0.95))
    assert cert.evidence["per_attack"]["dlg"]["leaked"] == leaked
    classes = cert.evidence["per_class"]
    assert sum(c["samples"] for c in classes) == 3 and sum(c["leaked"] for c in classes) == leaked
    assert [c["observed_rate"] for c in classes] == sorted((c["observed_rate"] for c in classes), reverse=True)
    page = (tmp_path / "o" / "report.html").read_text()
    assert "Population claim" in page and f"{leaked} of 3" in page and f"{rate['upper_bound']:.3g}" in page
    assert "Per class" in page and "Leaked samples" in page
    assert "Every attacked sample" in page and "samples 1-3 (batches 0-2); rows: original / dlg" in page
    from guardfl.redteam.reports.image import overview

    ((caption, png),) = overview(cert)
    assert png.startswith(b"\x89PNG") and "rows: original / dlg" in caption


def test_enough_samples_without_a_leak_certify_and_the_default_batches_are_enough():
    cfg = load_config({**CHEAP, "certify": {"max_ssim": 0.5, "max_leak_rate": 0.5, "confidence": 0.9}})
    assert cfg.certify.batches == 4  # 0.1 ** (1/4) = 0.56 ... the fewest n with 1 - 0.1 ** (1/n) < 0.5
    cert = certify(cfg)
    assert cert.verdict == "CERTIFIED" and cert.evidence["leak_rate"]["upper_bound"] < 0.5


def test_the_samples_override_changes_n_and_says_the_claim_is_weaker(tmp_path, capsys):
    path = _write(tmp_path, CHEAP)
    main(["redteam", "--config", str(path), "--out", str(tmp_path / "o"), "--samples", "2", "--quiet"])
    cert = json.loads((tmp_path / "o" / "certificate.json").read_text())
    assert cert["evidence"]["leak_rate"]["samples"] == 2 and cert["config"]["certify"]["batches"] == 2
    assert any("--samples 2" in w and "weaker claim" in w for w in cert["warnings"])
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        main(["redteam", "--config", str(path), "--samples", "0"])
    assert exited.value.code == 2 and "--samples: expected an integer >= 1" in capsys.readouterr().err


def test_a_population_smaller_than_the_samples_is_one_line(tmp_path, capsys):
    cfg = {**CHEAP, "data": {"source": "lfw-faces", "limit": 2}}
    assert main(["redteam", "--config", str(_write(tmp_path, cfg)), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has 2 images" in err and "needs 3 distinct" in err


@pytest.mark.parametrize("field, value, allowed", [("max_leak_rate", 0, "a rate in (0, 1)"), ("max_leak_rate", 1, "a rate in (0, 1)"),
                                                   ("confidence", 0.4, "[0.5, 1)"), ("confidence", 1.0, "[0.5, 1)")])
def test_the_claim_settings_are_range_checked(tmp_path, capsys, field, value, allowed):
    cfg = {**CHEAP, "certify": {"max_ssim": 0.5, field: value}}
    assert main(["redteam", "--config", str(_write(tmp_path, cfg)), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"certify.{field}" in err and allowed in err
