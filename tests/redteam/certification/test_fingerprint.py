"""The resume key: the config's hash plus the content of every file the run reads, code found without
being imported."""

import sys

import numpy as np
import pytest
import torch

from guardfl.redteam.config import load_config
from guardfl.redteam.certification.fingerprint import (changed_inputs, content_digest, fingerprint, module_origin, resume_key,
                                         run_inputs)


def _npz(path, seed=0, n=4):
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.integers(0, 256, (n, 25, 25), dtype=np.uint8), y=np.arange(n) % 2)
    return path


def test_changing_a_data_file_changes_the_key_and_rewriting_the_same_bytes_does_not(tmp_path):
    data = _npz(tmp_path / "d.npz")
    cfg = load_config({"data": {"source": "npz", "path": str(data)}})
    before = fingerprint(cfg)
    assert set(before) == {"data.path"} and len(before["data.path"]) == 64
    _npz(data)  # the same bytes, a new file (mtime moved)
    assert fingerprint(cfg) == before
    _npz(data, seed=1)
    after = fingerprint(cfg)
    assert changed_inputs(before, after) == ["data.path"]
    assert resume_key("h", before) != resume_key("h", after)
    assert resume_key("h", before) != resume_key("other", before)


def test_every_file_a_config_reads_is_in_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mymodels.py").write_text("def net():\n    raise SystemExit('never imported by the fingerprint')\n")
    ckpt = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(1)}, ckpt)
    folder = tmp_path / "faces" / "a"
    folder.mkdir(parents=True)
    (folder / "1.png").write_bytes(b"png1")
    cfg = load_config({
        "model": {"name": "mymodels:net", "state": str(ckpt), "input_shape": [1, 25, 25]},
        "data": {"source": "imagefolder", "path": str(tmp_path / "faces")},
        "aux": {"source": "npz", "path": str(_npz(tmp_path / "aux.npz")), "ood": {"source": "lfw-nonfaces"}},
        "certify": {"lpips_weights": str(tmp_path / "alex.pth")},
    })
    found = fingerprint(cfg)
    assert set(found) == {"data.path", "model.state", "model.name module", "aux.path", "aux.ood.source",
                          "certify.lpips_weights"}
    assert found["certify.lpips_weights"] == "missing"
    assert run_inputs(cfg)["model.name module"][0] == str(tmp_path / "mymodels.py")
    assert "mymodels" not in sys.modules
    before = dict(found)
    (folder / "1.png").rename(folder / "2.png")  # a renamed image is another dataset (labels, order)
    (tmp_path / "mymodels.py").write_text("def net():\n    return None\n")
    assert changed_inputs(before, fingerprint(cfg)) == ["data.path", "model.name module"]


def test_target_code_is_hashed_by_content_and_never_imported(tmp_path):
    app = tmp_path / "app"
    (app / "pkg").mkdir(parents=True)
    (app / "pkg" / "__init__.py").write_text("raise RuntimeError('a parent package ran')\n")
    (app / "pkg" / "client.py").write_text("def train(model, loader):\n    return model\n")
    (app / "pkg" / "task.py").write_text("X = 1\n")
    (app / "pyproject.toml").write_text("[tool.flwr.app.config]\nlr = 0.1\n")
    (app / "__pycache__").mkdir()
    (app / "__pycache__" / "junk.pyc").write_bytes(b"x")
    cfg = load_config({"client": {"protocol": "fedavg"},
                       "target": {"train_fn": "pkg.client:train", "app_dir": str(app)}})
    assert module_origin("pkg.client", app) == str(app / "pkg" / "client.py")
    assert "pkg" not in sys.modules
    before = fingerprint(cfg)
    assert {"target.train_fn module", "target.app_dir"} <= set(before)
    (app / "__pycache__" / "junk.pyc").write_bytes(b"y")  # caches are not code
    assert fingerprint(cfg) == before
    (app / "pkg" / "task.py").write_text("X = 2\n")  # a helper the entry point imports
    assert changed_inputs(before, fingerprint(cfg)) == ["target.app_dir"]


@pytest.mark.parametrize("module, expected", [("sys", "built-in"), ("builtins", "built-in"), ("no_such_module_xyz", None),
                                              ("os.path.nope", None), ("../etc", None), ("", None)])
def test_module_origin_of_odd_names(module, expected):
    assert module_origin(module) == expected


def test_content_digest_of_files_and_folders(tmp_path):
    assert content_digest(tmp_path / "nope") == "missing"
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"abc")
    assert content_digest(f) != content_digest(d)  # a file and a folder holding it differ
    assert content_digest(d, (".py",)) != content_digest(d)
