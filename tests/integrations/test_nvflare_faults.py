"""NVIDIA FLARE adapters under faults (issue 66): whatever goes wrong, nothing unprotected leaves the site and
the log says why in one line. The filter and GuardedTrainer on real NVFlare objects; the state file on a
real filesystem, with a second real process for the two-writers case."""

import copy
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("nvflare")

from nvflare.apis.dxo import DXO, DataKind, from_shareable  # noqa: E402
from nvflare.apis.fl_constant import ReturnCode  # noqa: E402
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402

from guardfl.defenses import GradPrune, SignCompression  # noqa: E402
from guardfl.errors import MaliciousModelError, StateFileError  # noqa: E402
from guardfl.integrations import nvflare as gn  # noqa: E402
from tests import malicious as M  # noqa: E402
from tests.integrations.test_nvflare import DATA, PRUNE, arrays, fl_model, net, run_task, trained  # noqa: E402

LOG = "guardfl.integrations.nvflare"


class BrokenSign(SignCompression):
    """A defense with a bug: it raises inside its step (after the gradients were computed)."""

    def _apply_(self, grads, ctx):
        raise RuntimeError("bug inside the defense")


class BrokenPrune(GradPrune):
    def _apply_(self, grads, ctx):
        raise RuntimeError("bug inside the update defense")


def sgd(p):
    return torch.optim.SGD(p, lr=0.1)


def errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- the update filter ---------------------------------------------------------------------------------------
def test_an_exception_inside_the_filters_defense_sends_nothing(caplog):
    flt = gn.GuardUpdateFilter(PRUNE)
    flt.update_defense.defense = BrokenPrune(ratio=0.5)
    received, new = arrays(net()), arrays(trained(net()))
    with caplog.at_level(logging.ERROR):
        reply = run_task(flt, received, DXO(DataKind.WEIGHTS, new).to_shareable())
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    with pytest.raises(ValueError):
        from_shareable(reply)  # no weights in the reply
    (line,) = errors(caplog)
    assert "bug inside the update defense" in line and "the result was not sent" in line and "\n" not in line


def test_a_non_float_array_in_a_weight_diff_is_refused(caplog):
    diff = {"w": np.ones((4, 4), np.float32), "count": np.array([3], np.int64)}  # a changed integer array
    with caplog.at_level(logging.ERROR):
        reply = run_task(gn.GuardUpdateFilter(PRUNE), None, DXO(DataKind.WEIGHT_DIFF, diff).to_shareable())
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR and len(errors(caplog)) == 1


# -- GuardedTrainer ----------------------------------------------------------------------------------------------
def _bad_models():
    good = fl_model(net())
    missing = copy.deepcopy(good)
    del missing.params["1.weight"]
    integer = copy.deepcopy(good)
    integer.params["1.weight"] = integer.params["1.weight"].astype(np.int64)
    diff = copy.deepcopy(good)
    diff.params_type = ParamsType.DIFF
    return {"not an FLModel": ({"1.weight": 0}, "expected the FLModel"),
            "no params": (FLModel(params_type=ParamsType.FULL, params={}), "non-empty dict"),
            "a DIFF model": (diff, "FULL weights"),
            "a missing tensor": (missing, "missing ['1.weight']"),
            "a non-float tensor": (integer, "1.weight is torch.int64"),
            "a malicious model (inspection)": (fl_model(M.class_fishing(net(), target=2)), "class fishing")}


@pytest.mark.parametrize("case", sorted(_bad_models()))
def test_the_trainer_fails_closed_with_one_log_line(case, caplog, tmp_path):
    received, reason = _bad_models()[case]
    model = net(1)
    before = copy.deepcopy(model.state_dict())
    path = tmp_path / "state.json"
    trainer = gn.GuardedTrainer(model, sgd, PRUNE, inspect=True, state_path=path)
    with caplog.at_level(logging.ERROR, logger=LOG), pytest.raises((ValueError, MaliciousModelError)):
        trainer.train(received, DataLoader(DATA, batch_size=8))
    (line,) = errors(caplog)
    assert line.startswith("GuardedTrainer: ") and reason in line and line.endswith("nothing was sent"), line
    assert trainer.state.rounds == 0 and not path.exists()  # nothing counted, nothing written
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing trained


def test_an_exception_inside_the_trainers_defense_returns_nothing_and_keeps_the_count(caplog, tmp_path):
    path = tmp_path / "state.json"
    trainer = gn.GuardedTrainer(net(), sgd, GradPrune(ratio=0.5), state_path=path)
    trainer.train(fl_model(net()), DataLoader(DATA, batch_size=8))
    saved = path.read_text()
    broken = gn.GuardedTrainer(net(), sgd, BrokenSign(), state_path=tmp_path / "other.json")
    with caplog.at_level(logging.ERROR, logger=LOG), pytest.raises(RuntimeError, match="bug inside the defense"):
        broken.train(fl_model(net()), DataLoader(DATA, batch_size=8))
    (line,) = errors(caplog)
    assert "RuntimeError: bug inside the defense; nothing was sent" in line
    assert broken.state.rounds == 0 and not (tmp_path / "other.json").exists() and path.read_text() == saved


# -- the state file ----------------------------------------------------------------------------------------------
def _round(trainer, rnd=0):
    return trainer.train(fl_model(net(), rnd=rnd), DataLoader(DATA, batch_size=8))


NOISE = {"kind": "gaussian", "sigma": 0.01}


def test_a_first_launch_writes_the_state_and_its_marker(tmp_path):
    path = tmp_path / "site" / "state.json"
    trainer = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path)
    _round(trainer)
    data = json.loads(path.read_text())
    assert data["format"] == "guardfl-client-state" and data["state"]["rounds"] == 1
    assert (tmp_path / "site" / "state.json.created").is_file()
    assert gn.GuardedTrainer(net(), sgd, NOISE, state_path=path).state.rounds == 1


@pytest.mark.parametrize("content, why", [
    ("{not json", "not a readable guardfl state"),
    ("", "empty"),
    ('{"format": "guardfl-client-state", "format_version": 2, "state": {"version": 1, "rou', "not a readable"),  # cut short
    ('{"version": 1, "steps": 3, "privacy": null}', "missing rounds"),
    ('{"version": 1, "rounds": -2, "steps": 3, "privacy": null}', "integer >= 0"),
    ('{"version": 1, "rounds": true, "steps": 3, "privacy": null}', "integer >= 0"),
    ('{"version": 0, "rounds": 2, "steps": 3, "privacy": null}', "version 0 is not supported"),
    ('{"format": "guardfl-client-state", "format_version": 9, "state": {}}', "version 9"),
    (b"\xff\xfe\x00garbage", "cannot be read"),
])
def test_a_corrupt_truncated_or_foreign_state_file_is_refused_naming_it(tmp_path, content, why):
    path = tmp_path / "state.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(StateFileError, match=why) as err:
        gn.GuardedTrainer(net(), sgd, NOISE, state_path=path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_the_state_truncated_mid_write_by_a_kill_is_never_half_a_file(tmp_path):
    """A process writing the state in a loop, killed (SIGKILL) at arbitrary moments: every time, the file
    is a whole state, the old one or a new one (write-then-rename)."""
    path = tmp_path / "state.json"
    writer = ("import sys, json\nfrom guardfl.integrations import statefile\n"
              "for i in range(10**9):\n"
              "    statefile.save(sys.argv[1], json.dumps({'rounds': i, 'pad': 'x' * 200000}))\n"
              "    if i == 0:\n        print('writing', flush=True)\n")
    for delay in (0.01, 0.05, 0.2):
        proc = subprocess.Popen([sys.executable, "-c", writer, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(delay)
        proc.kill()
        proc.wait()
        data = json.loads(path.read_text())  # parses: never a partial write
        assert isinstance(data["rounds"], int) and len(data["pad"]) == 200000


def test_a_state_file_deleted_mid_run_is_refused_not_reset(tmp_path, caplog):
    path = tmp_path / "state.json"
    trainer = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path, max_rounds=3)
    _round(trainer)
    path.unlink()
    with caplog.at_level(logging.ERROR, logger=LOG), pytest.raises(StateFileError, match="missing, but state.json.created"):
        _round(trainer, 1)
    assert len(errors(caplog)) == 1 and trainer.state.rounds == 1
    with pytest.raises(StateFileError, match="the state was lost"):  # a relaunch sees it too
        gn.GuardedTrainer(net(), sgd, NOISE, state_path=path, max_rounds=3)
    (tmp_path / "state.json.created").unlink()  # deleted too: the process that wrote it still knows
    with pytest.raises(StateFileError, match="deleted while the job ran"):
        _round(trainer, 1)


def test_a_state_file_put_back_older_is_refused(tmp_path):
    path = tmp_path / "state.json"
    trainer = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path)
    _round(trainer)
    old = path.read_text()
    _round(trainer, 1)
    path.write_text(old)
    with pytest.raises(StateFileError, match="holds 1 rounds where this process has counted 2"):
        _round(trainer, 2)


def test_a_state_file_of_another_defense_is_refused(tmp_path):
    path = tmp_path / "state.json"
    _round(gn.GuardedTrainer(net(), sgd, NOISE, state_path=path))
    with pytest.raises(StateFileError, match="written by a trainer with defense"):
        gn.GuardedTrainer(net(), sgd, PRUNE, state_path=path)


def test_the_older_plain_clientstate_file_is_read_with_its_counts(tmp_path):
    """What guardfl wrote before the state format (plain ``ClientState`` JSON): read as it is (the counts
    kept, none reset), rewritten in the format at the next round."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "rounds": 4, "steps": 16, "privacy": None}))
    trainer = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path, max_rounds=5)
    assert trainer.state.rounds == 4
    _round(trainer, 4)
    assert json.loads(path.read_text())["state"]["rounds"] == 5
    from guardfl.errors import RoundBudgetError
    with pytest.raises(RoundBudgetError):
        _round(gn.GuardedTrainer(net(), sgd, NOISE, state_path=path, max_rounds=5), 5)


def test_two_processes_on_one_state_file_the_second_is_refused(tmp_path):
    path = tmp_path / "state.json"
    holder = ("import sys, time\nfrom guardfl.integrations import statefile\n"
              "with statefile.locked(sys.argv[1], 'state_path'):\n    print('locked', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(StateFileError, match=f"in use by another process \\(pid {proc.pid}"):
            gn.GuardedTrainer(net(), sgd, NOISE, state_path=path)
    finally:
        proc.kill()
        proc.wait()
    trainer = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path)  # the lock dies with its process
    _round(trainer)
    assert trainer.state.rounds == 1


def test_two_trainers_in_turn_on_one_file_count_each_others_rounds(tmp_path):
    path = tmp_path / "state.json"
    a = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path, max_rounds=3)
    b = gn.GuardedTrainer(net(), sgd, NOISE, state_path=path, max_rounds=3)
    _round(a)
    _round(b, 1)
    _round(a, 2)
    from guardfl.errors import RoundBudgetError
    with pytest.raises(RoundBudgetError, match="budget of 3"):
        _round(b, 3)


def test_a_budget_file_deleted_mid_run_refuses_the_filter(tmp_path, caplog):
    path = tmp_path / "budget.json"
    flt = gn.GuardUpdateFilter({"kind": "gaussian", "sigma": 0.1}, max_rounds=3, budget_path=str(path))
    diff = {"w": np.zeros((4, 4), np.float32)}
    assert run_task(flt, None, DXO(DataKind.WEIGHT_DIFF, dict(diff)).to_shareable(), task_id="a").get_return_code() == ReturnCode.OK
    os.remove(path)
    restarted = gn.GuardUpdateFilter({"kind": "gaussian", "sigma": 0.1}, max_rounds=3, budget_path=str(path))
    with caplog.at_level(logging.ERROR):
        reply = run_task(restarted, None, DXO(DataKind.WEIGHT_DIFF, dict(diff)).to_shareable(), task_id="b")
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    (line,) = errors(caplog)
    assert "missing, but budget.json.created" in line
