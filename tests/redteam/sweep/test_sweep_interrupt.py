"""A Ray-backed ``guardfl sweep`` stopped by Ctrl-C (the whole process group, as a terminal sends it)
while Ray is starting, or by SIGTERM (a CI timeout, the main process only) while points run: one line,
exit 130 / 143, and no Ray process left running (issue 33: an interrupted sweep once exited 1 with a Ray
backtrace and left 9 Ray processes behind; a Ctrl-C during ray.init segfaulted and left Ray's agents)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.redteam.sweep.test_sweep import config

pytest.importorskip("ray")
BOUND = 120


def _group(pgid: int) -> list[str]:
    """The live processes of process group ``pgid`` (name and pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(f"{name} ({entry.name})")
    return found


def _raylet_started(pid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"raylet" in cmdline:
                return True
    return False


@pytest.mark.parametrize("when, how", [("ray starting", "ctrl-c"), ("a point done", "sigterm")])
def test_an_interrupted_ray_sweep_stops_ray_whole(tmp_path, when, how):
    cfg = config()
    cfg["base"] = {**cfg["base"], "attacks": [{"name": "idlg", "budget": {"iterations": 400}}]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = subprocess.Popen([sys.executable, "-m", "guardfl", "sweep", "--config", str(path), "--out", str(tmp_path / "o"),
                            "--backend", "ray", "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + BOUND
    started = (lambda: _raylet_started(run.pid)) if when == "ray starting" else (lambda: any("done]" in x for x in lines))
    while not started():
        assert run.poll() is None, lines
        assert time.monotonic() < deadline, f"not {when} within {BOUND} s"
        time.sleep(0.02)
    if how == "ctrl-c":
        os.killpg(run.pid, signal.SIGINT)
    else:
        os.kill(run.pid, signal.SIGTERM)
    try:
        code = run.wait(timeout=BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        pytest.fail(f"the sweep hung: still running {BOUND} s after the signal")
    reader.join(timeout=10)
    ours = [x.rstrip("\n") for x in lines if not x.startswith(("sweep ", "  ["))]  # the progress lines apart
    word = "interrupted" if how == "ctrl-c" else "terminated"
    assert (code, ours) == (130 if how == "ctrl-c" else 143, [f"{word}: no sweep result (continue with --resume)"])
    time.sleep(1)
    assert _group(run.pid) == []  # Ray's processes (gcs, raylet, agents, workers) stay in the sweep's group
