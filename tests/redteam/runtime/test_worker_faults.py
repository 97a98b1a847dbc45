"""Fault injection on the real command (issue 33, item 2): a red-team worker SIGKILLed at any point of a
``--workers 2`` run ends the run with exit 2 and one line naming the worker's death, within a bounded
time (a worker killed while the run was handed to it once hung the main process forever), leaves no
process behind, and ``--resume`` then gives the clean run's verdict. Ctrl-C (SIGINT to the whole
process group, as a terminal sends it) is one line and exit 130, with no traceback from a worker that
was still starting; SIGTERM to the main process (a CI timeout) is one line and exit 143, and the workers
end with it, as they do when the main process is SIGKILLed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification.certificate import untimed

# four short DLG jobs (one per private batch), then one longer Inverting Gradients job (it batches samples)
CONFIG = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"limit": 10},
    "client": {"batch_size": 1},
    "attacks": [{"name": "dlg", "budget": {"iterations": 60}},
                {"name": "inverting_gradients", "budget": {"iterations": 400, "restarts": 1}}],
    "certify": {"max_ssim": 0.5, "max_updates": 4},
    "strength": "quick",
}
DLG_RECORDS = 4
BOUND = 120  # seconds: a hang fails the test instead of the suite


def _children(pid: int) -> list[int]:
    """The spawned workers of ``pid`` (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def _cpu(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])  # utime + stime


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _records(out: Path) -> int:
    return len(list((out / "state").glob("b*-*.json"))) if (out / "state").is_dir() else 0


def _start(tmp_path: Path, out: Path, *extra: str) -> subprocess.Popen:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    return subprocess.Popen([sys.executable, "-m", "guardfl", "redteam", "--config", str(config), "--out", str(out),
                             "--workers", "2", "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _until(run: subprocess.Popen, condition, what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        if run.poll() is not None:
            pytest.fail(f"the run ended (exit {run.returncode}) before {what}: {run.stderr.read()}")
        if time.monotonic() > deadline:
            run.kill()
            pytest.fail(f"no {what} within {BOUND} s")
        time.sleep(0.01)


def _finish(run: subprocess.Popen) -> tuple[int, list[str]]:
    try:
        _, err = run.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        pytest.fail(f"the run hung: still running {BOUND} s after the fault")
    return run.returncode, err.splitlines()


def _busiest(pids: list[int]) -> int:
    before = {p: _cpu(p) for p in pids}
    time.sleep(0.3)
    return max(pids, key=lambda p: _cpu(p) - before[p])


def _kill_worker(run: subprocess.Popen, out: Path, when: str) -> int:
    """SIGKILL one worker of ``run`` at ``when``; its pid."""
    workers = []
    _until(run, lambda: workers.extend(_children(run.pid)) or workers, "a spawned worker")
    if when == "spawned":  # still in multiprocessing's bootstrap, or reading the run's pickle
        victim = workers[0]
    elif when == "first-job":  # the first result is in: one worker runs a job, the other takes the next
        _until(run, lambda: _records(out) >= 1, "a finished job")
        victim = _children(run.pid)[-1]
    else:  # "last-job": the DLG jobs are done, one worker runs the last job, the other is idle
        _until(run, lambda: _records(out) >= DLG_RECORDS, "the DLG jobs")
        victim = _busiest(_children(run.pid))
    os.kill(victim, signal.SIGKILL)
    return victim


@pytest.fixture(scope="module")
def clean_verdict():
    cert = certify(CONFIG, workers=1)
    return json.dumps(untimed(cert.to_dict(), ignore=("environment",)), sort_keys=True, default=str)


@pytest.mark.parametrize("when", ["spawned", "first-job", "last-job"])
def test_a_killed_worker_fails_the_run_in_one_line(tmp_path, request, when):
    out = tmp_path / "out"
    run = _start(tmp_path, out)
    victim = _kill_worker(run, out, when)
    code, lines = _finish(run)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: red-team worker ") and f"(pid {victim}) died" in lines[0], lines
    assert "SIGKILL" in lines[0] and "--resume" in lines[0], lines
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert not (out / "certificate.json").exists()
    assert not [p for p in _children(run.pid) if _alive(p)]  # its sibling was ended too
    assert not _alive(victim)
    if when == "last-job":  # the most state kept: --resume gives the clean run's certificate
        assert _records(out) == DLG_RECORDS
        resumed = _start(tmp_path, out, "--resume", "--workers", "1")  # one process: no spawn to pay for again
        code, lines = _finish(resumed)
        assert code == 1 and lines == [], lines  # NOT CERTIFIED: DLG leaks with no defense
        cert = json.loads((out / "certificate.json").read_text())
        assert json.dumps(untimed(cert, ignore=("environment",)), sort_keys=True,
                          default=str) == request.getfixturevalue("clean_verdict")


@pytest.mark.parametrize("when, how", [("spawned", "ctrl-c"), ("first-job", "ctrl-c"), ("first-job", "sigterm")])
def test_ctrl_c_and_sigterm_are_one_line(tmp_path, when, how):
    out = tmp_path / "out"
    run = _start(tmp_path, out)
    workers: set[int] = set()  # distinct pids: a poll sees the same worker again
    _until(run, lambda: workers.update(_children(run.pid)) or len(workers) >= 2 or _records(out) > 0, "the workers")
    if when == "first-job":
        _until(run, lambda: _records(out) >= 1, "a finished job")
    if how == "ctrl-c":
        os.killpg(run.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches every process of the group
    else:
        os.kill(run.pid, signal.SIGTERM)  # a CI job's timeout: the main process only
    code, lines = _finish(run)
    word = "interrupted" if how == "ctrl-c" else "terminated"
    assert code == (130 if how == "ctrl-c" else 143), lines
    assert lines == [f"{word}: no verdict (continue with --resume)"], lines
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert not [p for p in workers if _alive(p)]


def test_workers_end_with_a_killed_main_process(tmp_path):
    """SIGKILL of the main process (nothing can clean up): its workers see their pipe close and exit
    within seconds, not after their job; run.json stays 'in progress' and no verdict is left."""
    out = tmp_path / "out"
    run = _start(tmp_path, out)
    _until(run, lambda: _records(out) >= 1, "a finished job")
    workers = _children(run.pid)
    run.kill()
    assert _finish(run)[0] == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while [p for p in workers if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if _alive(p)]
    assert json.loads((out / "run.json").read_text())["status"] == "in progress"
    assert not (out / "certificate.json").exists()
