"""--resume never mixes or executes: it is keyed by the content of every input, reads back only tensors
and plain data that guardfl listed, a new run removes only guardfl's files, and a resumed certificate is
the uninterrupted one (timings apart)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from guardfl.cli import main
from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification.certificate import untimed
from tests.claims import LOOSE_CLAIM

TINY = {
    "model": {"name": "lenet", "state": "wide-init"},
    "client": {"batch_size": 1},
    "attacks": [{"name": "dlg", "budget": {"iterations": 4}}],
    "certify": {"max_ssim": 0.5, "max_updates": 3},
}
LTI = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"limit": 10},  # the population: faces 0-9; the attacker's start at 10
    "client": {"batch_size": 1},
    "defense": {"kind": "sign"},
    "aux": {"source": "lfw-faces", "offset": 10, "limit": 40, "ood": {"source": "lfw-nonfaces", "limit": 10, "samples": 20}},
    "attacks": [{"name": "learned_inversion", "budget": {"hidden": 32, "epochs": 2, "batch": 32}},
                {"name": "dlg", "budget": {"iterations": 4}}],
    "certify": {"max_ssim": 0.99, "max_updates": 2},
}

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "flower"
CLIENTAPP = {  # the user's own Flower ClientApp (examples/flower), two clients
    "target": {"clientapp": "guardfl_flower_example.client_app:app", "app_dir": str(EXAMPLE), "config": {"lr": 0.02},
               "run_config": {"model": "lenet", "dataset": "faces", "samples-per-client": 1, "batch-size": 1}},
    "model": {"name": "guardfl_flower_example.task:lenet", "state": "wide-init"},
    "client": {"protocol": "fedavg", "lr": 0.02, "batch_size": 1, "samples": 1},
    "attacks": [{"name": "dlg", "budget": {"iterations": 4}, "threat": {"labels": "known"}}],
    "certify": {"max_ssim": 0.4, "max_updates": 3},
}


class Planted:
    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (os.mkdir, (str(self.flag),))


def _write(tmp_path, cfg, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


#: a run of two rounds (updates 0-3, then 4-5), killed in the second
ROUNDS = {**TINY, "certify": {**TINY["certify"], "max_updates": 6}}


@pytest.mark.parametrize("cfg, kill_at", [(TINY, 3), (ROUNDS, 5), (LTI, 3), (CLIENTAPP, 3)],
                         ids=["batch-finished-before-the-kill", "killed-in-the-second-round", "prepared-attack-finished",
                              "clientapp"])
def test_a_resumed_certificate_is_the_uninterrupted_one(tmp_path, monkeypatch, cfg, kill_at, kill_attack_at):
    if cfg is CLIENTAPP:
        pytest.importorskip("flwr")
        monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    path = _write(tmp_path, cfg)
    whole = certify(path, out=tmp_path / "whole")
    attacks = kill_attack_at(kill_at)
    with pytest.raises(KeyboardInterrupt):
        certify(path, out=tmp_path / "resumed", attacks=attacks)
    assert not (tmp_path / "resumed" / "certificate.json").exists()
    resumed = certify(path, out=tmp_path / "resumed", resume=True)
    a, b = (json.loads((tmp_path / d / "certificate.json").read_text()) for d in ("whole", "resumed"))
    assert sorted(b["client"]["batches"], key=int) == [str(i) for i in range(cfg["certify"]["max_updates"])]
    if cfg is LTI:
        assert list(b["preparations"]) == ["0-learned_inversion"] and b["preparations"]["0-learned_inversion"]["cached"] is False
    assert untimed(a) == untimed(b)
    assert a["inputs"] and a["inputs"] == b["inputs"]
    for key, tensor in whole.reconstructions.items():
        assert torch.equal(tensor, resumed.reconstructions[key]), key


def _npz(path, seed):
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.integers(0, 256, (4, 25, 25), dtype=np.uint8), y=np.arange(4) % 2)


def test_resume_refuses_a_data_file_replaced_after_the_kill(tmp_path, monkeypatch, capsys, kill_attack_at):
    data = tmp_path / "private.npz"
    _npz(data, 0)
    path = _write(tmp_path, {**TINY, "data": {"source": "npz", "path": str(data)}})
    out = tmp_path / "r"
    attacks = kill_attack_at(2)
    with pytest.raises(KeyboardInterrupt):
        certify(path, out=out, attacks=attacks)
    written = sorted(p.name for p in (out / "state").iterdir())
    _npz(data, 1)  # another dataset under the same name
    capsys.readouterr()
    assert main(["redteam", "--config", str(path), "--out", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: data.path") and "private.npz" in err and "\n" not in err
    assert sorted(p.name for p in (out / "state").iterdir()) == written  # the killed run's state is kept
    _npz(data, 0)  # the original data back: the resume goes on
    assert main(["redteam", "--config", str(path), "--out", str(out), "--resume", "--quiet"]) in (0, 1, 3)
    assert (out / "certificate.json").is_file()


@pytest.mark.parametrize("cfg, planted, rerun", [
    (TINY, "observation-b0.pt", None),
    (TINY, "b1-0-dlg.pt", None),
    (LTI, "prepared", "b1-0-learned_inversion.json"),
], ids=["observation", "reconstruction", "prepared-attack"])
def test_resume_never_unpickles_objects_from_the_state(tmp_path, capsys, cfg, planted, rerun):
    path = _write(tmp_path, cfg)
    out = tmp_path / "r"
    certify(path, out=out)
    state = out / "state"
    if planted == "prepared":
        (planted_path,) = (state / "prepared").iterdir()
    else:
        planted_path = state / planted
    flag = tmp_path / "code-ran"
    torch.save({"net": Planted(flag)}, planted_path)
    if rerun:
        (state / rerun).unlink()  # the job that needs the prepared attack is run again
    assert main(["redteam", "--config", str(path), "--out", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a tensor file guardfl wrote" in err and planted_path.name in err and "\n" not in err
    assert not flag.exists()
    assert not (out / "certificate.json").exists()


def test_resume_ignores_files_guardfl_did_not_list(tmp_path):
    # two clean updates decide the loose claim: a resume of a decided run rebuilds it (an INCONCLUSIVE one
    # would be given more updates)
    path = _write(tmp_path, {**TINY, "certify": {"max_ssim": 0.5, "max_updates": 2, **LOOSE_CLAIM}})
    out = tmp_path / "r"
    first = certify(path, out=out)
    record = json.loads((out / "state" / "b0-0-dlg.json").read_text())
    (out / "state" / "b0-0-dlg.json").unlink()
    # a planted "finished job" with harmless metrics under a name guardfl did not list
    (out / "state" / "b0-1-dlg.json").write_text(json.dumps({**record, "job": "b0-1-dlg"}))
    resumed = certify(path, out=out, resume=True)
    assert first.verdict == "CERTIFIED" and [r["job"] for r in resumed.results] == ["b0-0-dlg", "b1-0-dlg"]
    assert untimed(resumed.to_dict()) == untimed(first.to_dict())


def test_a_new_run_removes_only_what_guardfl_wrote(tmp_path, capsys):
    path = _write(tmp_path, {**TINY, "certify": {**TINY["certify"], "max_updates": 1}})
    out = tmp_path / "r"
    certify(path, out=out)
    state = out / "state"
    (state / "notes.txt").write_text("the user's")
    certify(path, out=out)
    assert (state / "notes.txt").read_text() == "the user's"
    assert {"manifest.json", "observation-b0.pt", "b0-0-dlg.json", "b0-0-dlg.pt"} <= {p.name for p in state.iterdir()}
    # a state folder guardfl did not write (no manifest) is refused, with or without --resume, and left alone
    foreign = tmp_path / "f"
    (foreign / "state").mkdir(parents=True)
    (foreign / "state" / "data.bin").write_text("x")
    for extra in ([], ["--resume"]):
        assert main(["redteam", "--config", str(path), "--out", str(foreign), "--quiet", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "guardfl did not write" in err and "\n" not in err
    assert [p.name for p in (foreign / "state").iterdir()] == ["data.bin"]
