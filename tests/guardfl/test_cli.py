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


def test_check_refuses_zero_strength_with_the_identity_hint(tmp_path, capsys):
    for text in ("kind: gradprune\nratio: 0\n", "kind: gaussian\nsigma: 0.0\n",
                 "kind: stack\ndefenses: [{kind: identity}, {kind: identity}]\n",
                 "model: {name: lenet}\ndefense: {kind: laplace, scale: 0}\n"):
        path = tmp_path / "zero.yaml"
        path.write_text(text)
        assert main(["check", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("error: ") and "Identity()" in err


def test_check_warns_about_layers_a_setting_never_changes(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny_models.py").write_text(
        "import torch\n"
        "def scaled(in_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, num_classes), torch.nn.PReLU())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "prune.yaml"
    path.write_text("kind: gradprune\nratio: 0.01\n")
    args = ["check", str(path), "--model", "tiny_models:scaled", "--input-shape", "3", "2", "2"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok: GradPrune(ratio=0.01) on tiny_models:scaled")
    assert err.strip().splitlines() == [
        "warning: tiny_models:scaled: 2.weight (1 entry) is never changed: gradprune (ratio=0.01) never prunes a "
        "one-entry tensor (ceil(ratio * (n - 1)) = 0)"
    ]
    assert main([*args, "--strict"]) == 1
    path.write_text("kind: gradprune\nratio: 0.5\n")
    assert main(["check", str(path), "--model", "lenet", "--strict"]) == 0  # no one-entry tensor in LeNet


def test_check_reads_a_red_team_config_and_its_built_in_model(tmp_path, capsys):
    path = tmp_path / "redteam.yaml"
    path.write_text("model: {name: lenet, num_classes: 10}\ndefense: {kind: soteria}\nseed: 0\n")
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "on lenet" in out and "fc.bias" in err and "soteria prunes only the weight of nn.Linear 'fc'" in err
    path.write_text("model: {name: 'os:getcwd'}\ndefense: {kind: sign}\n")
    assert main(["check", str(path)]) == 0
    assert "is code and was not built" in capsys.readouterr().out  # a config's module:callable is not run
    path.write_text("model: {name: lenet}\ndefense: {kind: soteria, layer: body.0}\n")
    assert main(["check", str(path)]) == 2
    assert "soteria.layer" in capsys.readouterr().err
    for bad, what in (("missing.yaml", "not found"), ("notutf8.yaml", "not UTF-8")):
        if bad == "notutf8.yaml":
            (tmp_path / bad).write_bytes(b"kind: \xff\n")
        assert main(["check", str(tmp_path / bad)]) == 2
        assert what in capsys.readouterr().err


def test_check_reads_yaml_strictly(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("model: {name: lenet}\ndefense: {kind: gradprune, ratio: 0.9}\ndefense: null\n")
    assert main(["check", str(path)]) == 2  # a trailing 'defense: null' must not read as "no defense"
    assert "given twice" in capsys.readouterr().err
    path.write_text("")
    assert main(["check", str(path)]) == 2
    assert "empty" in capsys.readouterr().err


def test_check_model_failures_are_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_models.py").write_text("import sys\ndef quits():\n    sys.exit(0)\ndef fails():\n    raise RuntimeError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "d.yaml"
    path.write_text("kind: sign\n")
    for ref in ("broken_models:quits", "broken_models:fails", "no_such_model"):
        assert main(["check", str(path), "--model", ref]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: model.name") and "\n" not in err


def test_check_a_red_team_config_without_a_defense_section(tmp_path, capsys):
    cfg = tmp_path / "rt.yaml"
    cfg.write_text("model: {name: lenet}\nattacks: all\n")
    assert main(["check", str(cfg)]) == 0
    captured = capsys.readouterr()
    assert "no defense section" in captured.out and "unknown kind" not in captured.out + captured.err


def test_a_missing_redteam_package_is_one_line_not_a_traceback(monkeypatch, capsys):
    """From a source folder that shadows the installed package, guardfl.redteam does not exist (redteam/
    maps into the namespace only when installed): say so and exit 2."""
    import sys

    from guardfl.cli import main

    monkeypatch.setitem(sys.modules, "guardfl.redteam.cli.redteam", None)
    assert main(["defenses"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "guardfl.redteam.cli.redteam is not importable" in err and "pip install -e ." in err
