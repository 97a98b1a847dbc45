"""``guardfl bound`` and ``guardfl calibrate``: output, exit status, one-line errors."""

import json

import pytest

from guardfl.cli import main


def _config(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_bound_proven_not_proven_and_no_mechanism(tmp_path, capsys):
    proven = _config(tmp_path, "client: {batch_size: 4, max_rounds: 2}\ndefense: {kind: dpsgd, noise_multiplier: 30}\n"
                               "certify: {max_updates: 1, kappa: 0.01}\n")
    assert main(["bound", "--config", proven]) == 0
    assert capsys.readouterr().out.startswith("PROVEN: bound 0.01")
    assert main(["bound", "--config", proven, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["status"] == "PROVEN" and entry["kappa_source"] == "certify.kappa"
    assert main(["bound", "--config", proven, "--rounds", "100000", "--kappa", "0.2"]) == 1
    assert "NOT PROVEN" in capsys.readouterr().out
    none = _config(tmp_path, "defense: {kind: sign}\ncertify: {max_updates: 1, kappa: 0.01}\n")
    assert main(["bound", "--config", none]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: defense: no proven bound: sign:") and err.count("\n") == 1


@pytest.mark.parametrize("argv, field", [
    (["bound", "--config", "CFG", "--kappa", "1.5"], "--kappa"),
    (["bound", "--config", "CFG", "--rounds", "0"], "--rounds"),
    (["calibrate", "--rero", "0.5", "--kappa", "0.1"], "--rounds"),
    (["calibrate", "--rero", "0.5", "--kappa", "0", "--rounds", "1"], "kappa"),
    (["calibrate", "--rero", "0.01", "--kappa", "0.1", "--rounds", "1"], "rero"),
    (["calibrate", "--rero", "0.5", "--kappa", "0.1", "--rounds", "1", "--mechanism", "gaussian"], "clip"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, field):
    cfg = _config(tmp_path, "client: {batch_size: 4, max_rounds: 2}\ndefense: {kind: dpsgd, noise_multiplier: 3}\n"
                            "certify: {max_updates: 1, kappa: 0.01}\n")
    assert main([cfg if a == "CFG" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}") and err.count("\n") == 1


def test_calibrate_from_flags_and_from_a_config(tmp_path, capsys):
    assert main(["calibrate", "--rero", "0.2", "--kappa", "0.1", "--rounds", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 9.0 < out["noise_multiplier"] < 9.2 and out["mechanism"] == "dpsgd"
    cfg = _config(tmp_path, "client: {batch_size: 4, max_rounds: 2}\ndefense: {kind: gaussian, sigma: 0.01, clip: 0.5}\n"
                            "certify: {max_updates: 1, kappa: 0.01}\n")
    assert main(["calibrate", "--rero", "0.05", "--config", cfg]) == 0
    assert capsys.readouterr().out.startswith("sigma ")
    none = _config(tmp_path, "defense: {kind: sign}\ncertify: {max_updates: 1, kappa: 0.01}\nclient: {max_rounds: 1}\n")
    assert main(["calibrate", "--rero", "0.05", "--config", none]) == 2
    assert capsys.readouterr().err.startswith("error: defense: nothing to calibrate")
