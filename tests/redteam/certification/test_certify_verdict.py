"""A CI gate trusts what is in --out: a run that fails or is killed leaves no certificate.json, not even
an earlier CERTIFIED one, and run.json says how the last run ended."""

import json

import pytest
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from tests.claims import LOOSE_CLAIM

TINY = {
    "model": {"name": "lenet", "state": "wide-init"},
    "client": {"batch_size": 1},
    "attacks": [{"name": "dlg", "budget": {"iterations": 5}}],
    "certify": {"max_ssim": 0.5, "max_updates": 2, **LOOSE_CLAIM},
    "defense": {"kind": "gradprune", "ratio": 0.99},
}


def _write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def _certified(tmp_path):
    out = tmp_path / "out"
    assert main(["redteam", "--config", str(_write(tmp_path, TINY)), "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "certificate.json").read_text())["verdict"] == "CERTIFIED"
    assert {"report.html", "grid-batch0.png", "grid-batch1.png"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    return out


def _no_verdict(out, status):
    names = {p.name for p in out.iterdir()}
    assert not names & {"certificate.json", "report.html", "grid-batch0.png", "grid-batch1.png"}, names
    assert not [n for n in names if "certificate" in n]  # nothing renamed that still says CERTIFIED
    return json.loads((out / "run.json").read_text())


def _factory(tmp_path, monkeypatch, name, body):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / f"{name}.py").write_text(f"import sys\n\ndef net():\n    {body}\n")
    return f"{name}:net"


def test_a_run_failing_in_user_code_leaves_no_earlier_certificate(tmp_path, monkeypatch, capsys):
    out = _certified(tmp_path)
    ref = _factory(tmp_path, monkeypatch, "factory_that_raises", "raise RuntimeError('the factory broke')")
    cfg = {**TINY, "model": {"name": ref, "input_shape": [1, 25, 25]}}
    assert main(["redteam", "--config", str(_write(tmp_path, cfg)), "--out", str(out), "--quiet"]) == 2
    assert "the factory broke" in capsys.readouterr().err
    run = _no_verdict(out, "failed")
    assert run["status"] == "failed" and "the factory broke" in run["error"]


def test_a_killed_run_leaves_no_earlier_certificate(tmp_path, monkeypatch, kill_attack_at):
    out = _certified(tmp_path)
    attacks = kill_attack_at(2)
    with pytest.raises(KeyboardInterrupt):
        certify(_write(tmp_path, TINY), out=out, attacks=attacks)
    assert _no_verdict(out, "interrupted")["status"] == "interrupted"


def test_a_system_exit_from_user_code_leaves_no_certificate(tmp_path, monkeypatch):
    out = _certified(tmp_path)
    ref = _factory(tmp_path, monkeypatch, "factory_that_exits", "sys.exit(0)")
    cfg = {**TINY, "model": {"name": ref, "input_shape": [1, 25, 25]}}
    with pytest.raises((SystemExit, Exception)):
        certify(cfg, out=out)
    assert _no_verdict(out, "failed")["status"] == "failed"


def test_a_config_error_leaves_no_earlier_certificate(tmp_path):
    out = _certified(tmp_path)
    bad = {**TINY, "data": {"source": "npz", "path": str(tmp_path / "missing.npz")}}
    assert main(["redteam", "--config", str(_write(tmp_path, bad)), "--out", str(out), "--quiet"]) == 2
    assert "missing.npz" in _no_verdict(out, "failed")["error"]
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    assert main(["redteam", "--config", str(tmp_path / "broken.yaml"), "--out", str(out), "--quiet"]) == 2
    assert _no_verdict(out, "failed")["status"] == "failed"


def test_a_finished_run_replaces_every_picture_of_the_earlier_one(tmp_path):
    out = _certified(tmp_path)
    one = {**TINY, "certify": {**TINY["certify"], "max_updates": 1}}
    assert main(["redteam", "--config", str(_write(tmp_path, one)), "--out", str(out), "--quiet"]) == 3  # one update decides nothing
    names = {p.name for p in out.iterdir()}
    assert "grid-batch0.png" in names and "grid-batch1.png" not in names  # no picture of a batch it did not attack
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and run["certificate"] == "certificate.json"
    assert "certificate.json" in run["retracted"]
