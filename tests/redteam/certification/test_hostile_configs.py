"""The hostile configs of the reliability audit (issue 13), kept as data in ``tests/redteam/hostile/``:
each must exit 2 with one line on stderr that names what is wrong (the ``# expect:`` header of the file),
quickly, and leave no certificate."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from guardfl.cli import main

HOSTILE = Path(__file__).parents[1] / "hostile"
FILES = sorted(HOSTILE.glob("*.yaml"))


def _expected(path: Path) -> str:
    if path.stat().st_size == 0:
        return "the file is empty"
    first = path.read_bytes().splitlines()[0].decode("latin-1")
    assert first.startswith("# expect: "), f"{path.name}: first line must be '# expect: <text>'"
    return first.removeprefix("# expect: ")


def test_the_set_is_there():
    assert len(FILES) >= 20


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_hostile_config_exits_2_with_one_line(path, tmp_path, capsys):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    code = main(["redteam", "--config", str(path), "--out", str(out), "--quiet"])
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0, err
    assert _expected(path) in err, err
    assert not (out / "certificate.json").exists()
    assert seconds < 30  # refused before any work (a billion-laughs document once hung for 150 s)


def test_yaml_bombs_are_refused_in_well_under_a_second():
    from guardfl.errors import ConfigError
    from guardfl.yamlio import load_yaml

    for name in ("billion-laughs.yaml", "deep-nesting.yaml"):
        t0 = time.perf_counter()
        with pytest.raises(ConfigError):
            load_yaml(HOSTILE / name)
        assert time.perf_counter() - t0 < 1.0


def _user_module(tmp_path: Path, body: str) -> str:
    (tmp_path / "hostile_user_mod.py").write_text("import sys\n" + body)
    return "hostile_user_mod"


@pytest.mark.parametrize("body, expect", [
    ("def make():\n    sys.exit(0)\n", "sys.exit(0)"),
    ("def make():\n    raise SystemExit\n", "sys.exit(None)"),
    ("def make():\n    return 'not a model'\n", "returned str, not a torch.nn.Module"),
    ("def make():\n    raise RuntimeError('boom')\n", "RuntimeError"),
    ("sys.exit(0)\ndef make():\n    pass\n", "sys.exit(0) while importing"),
    ("make = 3\n", "expected a torch.nn.Module subclass or a function"),
])
def test_user_code_never_exits_0(tmp_path, monkeypatch, capsys, body, expect):
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hostile_user_mod", None)
    mod = _user_module(tmp_path, body)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{name: '{mod}:make'}}\nattacks: [dlg]\n")
    out = tmp_path / "out"
    code = main(["redteam", "--config", str(cfg), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "model.name" in err and expect in err, err
    assert not (out / "certificate.json").exists()


def test_sys_exit_config_exits_2_from_the_console_script(tmp_path):
    """The audit's case end to end: before, 'sys:exit' as model exited 0 with no certificate."""
    run = subprocess.run([sys.executable, "-m", "guardfl", "redteam", "--config", str(HOSTILE / "model-sys-exit.yaml"),
                          "--out", str(tmp_path / "o"), "--quiet"], capture_output=True, text=True)
    assert run.returncode == 2 and "standard library" in run.stderr
    assert not (tmp_path / "o" / "certificate.json").exists()


def _refused(cfg_text: str, tmp_path: Path, capsys) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(cfg_text)
    code = main(["redteam", "--config", str(cfg), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert not (tmp_path / "out" / "certificate.json").exists()
    return err


def test_a_text_file_as_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "ckpt.pt").write_text("not a checkpoint\n")
    err = _refused(f"model: {{name: lenet, state: '{tmp_path / 'ckpt.pt'}'}}\nattacks: [dlg]\n", tmp_path, capsys)
    assert "model.state" in err and "not a PyTorch checkpoint" in err


def test_npz_with_object_arrays_is_one_line_and_unpickled_never(tmp_path, capsys):
    import numpy as np

    x = np.empty(2, dtype=object)
    x[:] = [np.zeros((3, 8, 8)), np.zeros((3, 8, 8))]
    np.savez(tmp_path / "d.npz", x=x, y=np.zeros(2, dtype=np.int64))
    err = _refused(f"data: {{source: npz, path: '{tmp_path / 'd.npz'}'}}\nattacks: [dlg]\n", tmp_path, capsys)
    assert "data.path" in err and "not an npz of numeric arrays" in err


def test_references_resolve_only_to_what_the_field_means():
    from guardfl.redteam.runtime.userref import UserCodeError, model_factory, split_ref, train_function

    assert split_ref("a.b:c.d", "f") == ("a.b", "c.d")
    for bad in (":", "a:", ":b", "a:b:c", "a b:c", "1a:b"):
        with pytest.raises(UserCodeError, match="f: expected 'module:attribute'"):
            split_ref(bad, "f")
    assert model_factory("guardfl.redteam.modality.image.models:LeNetZhu")
    with pytest.raises(UserCodeError, match="not a torch.nn.Module subclass"):
        model_factory("guardfl.redteam.config:RedTeamConfig")
    with pytest.raises(UserCodeError, match="expected a Python function"):
        train_function("guardfl.redteam.modality.image.models:LeNetZhu", "target.train_fn")
