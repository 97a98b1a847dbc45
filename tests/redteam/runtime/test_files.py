"""The red team's files: the verdict retracted before a run, the run marker, and a state folder that
lists what guardfl wrote, removes only that, and reads back only tensors and plain data."""

import json
import os
import pickle

import numpy as np
import pytest
import torch

from guardfl.errors import ConfigError
from guardfl.redteam.runtime.files import StateFolder, mark_run, plain, retract_verdict


class Planted:
    """A pickle that runs code when unpickled."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (os.mkdir, (str(self.flag),))


def test_retract_verdict_removes_the_verdict_and_its_pictures_only(tmp_path):
    for name in ("certificate.json", "report.html", "grid-batch0.png", "grid-batch12.png", ".certificate.json.tmpab",
                 "notes.txt", "grid-batch0.png.bak", "certificate.previous.json"):
        (tmp_path / name).write_text("x")
    removed = retract_verdict(tmp_path)
    assert removed == ["certificate.json", "report.html", "grid-batch0.png", "grid-batch12.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["certificate.previous.json", "grid-batch0.png.bak", "notes.txt"]
    assert retract_verdict(tmp_path / "absent") == []


def test_mark_run(tmp_path):
    mark_run(tmp_path, "in progress", resume=False)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "in progress" and record["resume"] is False and record["pid"] == os.getpid()


def test_plain_keeps_tensors_and_plain_data_and_refuses_objects():
    obj = {"a": (1, 2.5, "s", None, True), "t": torch.ones(2), "n": [np.float32(0.5), np.int64(3)], "arr": np.zeros(2)}
    out = plain(obj)
    assert out["a"] == (1, 2.5, "s", None, True) and out["n"] == [0.5, 3] and type(out["n"][1]) is int
    assert isinstance(out["arr"], torch.Tensor)
    with pytest.raises(TypeError, match=r"x\.k\[1\]: object is not plain data"):
        plain({"k": [1, object()]}, "x")


def test_a_fresh_state_removes_only_the_files_guardfl_listed(tmp_path):
    root = tmp_path / "state"
    state = StateFolder.fresh(root, {"key": "k1"})
    state.save_json("b0-0-dlg.json", {"ok": 1})
    state.save_tensors("prepared/lti-abc.pt", {"net": {"w": torch.ones(2)}, "dims": (1, 2)})
    (root / ".b0-1-dlg.json.tmp123").write_text("partial")  # a killed write of a listed file...
    state.path("b0-1-dlg.json")
    (root / "mine.txt").write_text("the user's")             # ...and a file guardfl never wrote
    (root / "prepared" / "keep.bin").write_text("the user's")
    assert StateFolder.read_manifest(root)["files"] == ["b0-0-dlg.json", "prepared/lti-abc.pt", "b0-1-dlg.json"]
    StateFolder.fresh(root, {"key": "k2"})
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "manifest.json", "mine.txt", "prepared", "prepared/keep.bin"]
    assert StateFolder.read_manifest(root) == {"format": StateFolder.FORMAT, "meta": {"key": "k2"}, "files": []}


def test_a_folder_guardfl_did_not_write_is_refused_and_left_alone(tmp_path):
    root = tmp_path / "state"
    root.mkdir()
    (root / "thesis.tex").write_text("x")
    with pytest.raises(ConfigError, match="holds files guardfl did not write"):
        StateFolder.fresh(root, {})
    assert (root / "thesis.tex").read_text() == "x"
    (root / "manifest.json").write_text(json.dumps({"format": "other", "files": ["thesis.tex"]}))
    with pytest.raises(ConfigError, match="did not write"):  # a manifest not in guardfl's format is not ours
        StateFolder.fresh(root, {})
    (root / "manifest.json").write_text(json.dumps({"format": StateFolder.FORMAT, "files": ["../outside"]}))
    assert StateFolder.read_manifest(root) is None  # names outside the folder are refused
    empty = tmp_path / "empty"
    empty.mkdir()
    StateFolder.fresh(empty, {})  # an empty folder is fine


def test_only_listed_files_are_read_and_only_as_tensors(tmp_path):
    flag = tmp_path / "code-ran"
    root = tmp_path / "state"
    state = StateFolder.fresh(root, {})
    (root / "planted.json").write_text("{}")
    assert state.existing("planted.json") is None and state.load_json("planted.json") is None
    state.save_tensors("obs.pt", {"x": torch.ones(1)})
    assert torch.equal(state.load_tensors("obs.pt")["x"], torch.ones(1))
    torch.save({"x": Planted(flag)}, root / "obs.pt")  # the listed file replaced by a pickle that runs code
    with pytest.raises(ConfigError, match="is not a tensor file guardfl wrote"):
        state.load_tensors("obs.pt")
    (root / "obs.pt").write_bytes(pickle.dumps(Planted(flag)))
    with pytest.raises(ConfigError, match="is not a tensor file"):
        state.load_tensors("obs.pt")
    assert not flag.exists()
    with pytest.raises(TypeError):  # nothing but tensors and plain data is written either
        state.save_tensors("bad.pt", {"x": Planted(flag)})


def test_removal_never_follows_a_linked_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep")
    root = tmp_path / "state"
    root.mkdir()
    (root / "sub").symlink_to(outside, target_is_directory=True)
    (root / "manifest.json").write_text(json.dumps({"format": StateFolder.FORMAT, "meta": {}, "files": ["sub/victim"]}))
    StateFolder.fresh(root, {})
    assert (outside / "victim").read_text() == "keep"
