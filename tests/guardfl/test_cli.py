import subprocess
import sys

from guardfl.cli import main


def test_help_and_version(capsys):
    assert main([]) == 0
    assert "defenses" in capsys.readouterr().out


def test_console_script_is_installed():
    run = subprocess.run([sys.executable, "-m", "guardfl", "--version"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("guardfl ")


def test_defenses_lists_every_kind(capsys):
    assert main(["defenses"]) == 0
    out = capsys.readouterr().out
    for kind in ("gradprune", "sign", "gaussian", "laplace", "outpost", "stack", "identity"):
        assert kind in out


def test_check_good_and_bad_config(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("kind: outpost\nphi: 0.4\n")
    assert main(["check", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: gradprune\nratio: 1.2\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gradprune.ratio" in err and "(0, 1)" in err
