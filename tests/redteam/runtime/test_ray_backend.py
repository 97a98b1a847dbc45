"""One certificate on Ray (issue 36): the local run's certificate on a local Ray instance, resume across
backends both ways, a job's own error and a lost job each one line, an unreachable address one line.
One Ray instance for the module (a start costs seconds); the multi-node cluster is test_ray_cluster.py."""

import json
import os

import pytest
import torch

from guardfl.cli import main
from guardfl.errors import ConfigError
from guardfl.redteam.certification import rounds as rounds_mod
from guardfl.redteam.attacks.base import AttackFailed
from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification.certificate import untimed
from guardfl.redteam.runtime.ray_backend import RayJobs, as_backend
from guardfl.redteam.runtime.workers import Job, RunContext, WorkerError
from tests.redteam.runtime.test_workers import LTI_AND_OPTIMISATION, _FailingRunner

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    """A local instance of 2 CPUs that ``RayJobs()`` (address None) uses, shut down after the module."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray 2.5x's FutureWarning on CPU-only tasks
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def whole():
    """The sequential, uninterrupted certificate every Ray run must equal."""
    return certify(LTI_AND_OPTIMISATION, workers=1)


def _untimed(cert) -> str:
    return json.dumps(untimed(cert.to_dict(), ignore=("environment",)), sort_keys=True, default=str)


def _same(cert, whole) -> None:
    assert _untimed(cert) == _untimed(whole)
    assert cert.reconstructions.keys() == whole.reconstructions.keys()
    for key, tensor in whole.reconstructions.items():
        assert torch.equal(tensor, cert.reconstructions[key]), key


def test_ray_gives_the_local_certificate(ray_local, whole, tmp_path):
    backend = RayJobs()
    cert = certify(LTI_AND_OPTIMISATION, out=tmp_path, workers=2, backend=backend)
    _same(cert, whole)
    assert cert.environment["backend"] == {"backend": "ray", "address": "local", "cpus": 2, "max_retries": 3}
    assert json.loads((tmp_path / "certificate.json").read_text())["verdict"] == cert.verdict
    # the context went through the object store once (plus the trained inverter once), not per task
    stats = backend.stats
    assert stats.tasks == 5  # 1 preparation; 2 chunked jobs (learned inversion, IG) and 2 DLG jobs
    assert stats.puts == 2 and stats.put_bytes > 0 and stats.fetched_bytes > 0
    assert ray.is_initialized()  # an instance it did not start is left to its owner


def test_a_local_run_killed_midway_resumes_on_ray(ray_local, whole, tmp_path, kill_attack_at):
    attacks = kill_attack_at(3)
    with pytest.raises(KeyboardInterrupt):
        certify(LTI_AND_OPTIMISATION, out=tmp_path, workers=1, attacks=attacks)
    _same(certify(LTI_AND_OPTIMISATION, out=tmp_path, backend="ray", resume=True), whole)


def test_a_ray_run_interrupted_midway_resumes_locally(ray_local, whole, tmp_path, monkeypatch):
    real_save, saved = rounds_mod.save_job, []

    def save(state, job, record, rec):  # the driver is interrupted as it records its second result
        saved.append(job)
        if len(saved) == 2:
            raise KeyboardInterrupt
        real_save(state, job, record, rec)

    monkeypatch.setattr(rounds_mod, "save_job", save)
    with pytest.raises(KeyboardInterrupt):
        certify(LTI_AND_OPTIMISATION, out=tmp_path, workers=2, backend="ray")
    monkeypatch.setattr(rounds_mod, "save_job", real_save)
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "interrupted"
    _same(certify(LTI_AND_OPTIMISATION, out=tmp_path, workers=1, resume=True), whole)


@pytest.mark.parametrize("failing, error, says", [("bad", AttackFailed, "broken on purpose"),
                                                  ("die", WorkerError, "was lost .* after 1 retry")])
def test_a_failing_job_or_a_lost_one_fails_the_run(ray_local, failing, error, says):
    context = RunContext(_FailingRunner(), ["ok", failing], {0: (None, None, None)})
    jobs = [Job("ok", (0,), 0, False), Job(failing, (0,), 1, False), Job("ok2", (0,), 0, False)]
    done = []
    with pytest.raises(error, match=says) as err:
        RayJobs(max_retries=1).run(context, jobs, workers=2, threads=1, device=torch.device("cpu"), app_dir=None,
                                   prepared=lambda i: None, on_prepared=lambda *a: None,
                                   on_done=lambda job, result: done.append(job.name))
    assert failing not in done
    if failing == "bad":  # not retried; the worker's traceback travels with the error (--debug shows it)
        assert "broken on purpose" in str(err.value.__cause__)
    else:
        assert "job die" in str(err.value) and "--resume" in str(err.value) and "\n" not in str(err.value)


def test_a_job_no_node_can_hold_is_one_line_not_a_hang(ray_local):
    from guardfl.redteam.runtime.ray_connection import BackendError

    with pytest.raises(BackendError, match=r"a job needs 3 CPU\(s\) on one node .* largest node has 2 CPU\(s\)"):
        certify(LTI_AND_OPTIMISATION, threads=3, backend="ray")
    with pytest.raises(BackendError, match=r"1 GPU\(s\) .* lower --gpus-per-job"):
        RayJobs().run(RunContext(None, [], {}), [Job("j", (0,), 0, False)], workers=1, threads=1,
                      device=torch.device("cuda"), app_dir=None, prepared=lambda i: None,
                      on_prepared=lambda *a: None, on_done=lambda *a: None)


def test_unreachable_address_and_bad_arguments_are_one_line(tmp_path, capsys):
    from guardfl.redteam.runtime.ray_connection import BackendError

    with pytest.raises(BackendError, match=r"--ray-address: cannot reach the Ray cluster at 127\.0\.0\.1:1"):
        certify(LTI_AND_OPTIMISATION, backend=RayJobs("127.0.0.1:1"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(LTI_AND_OPTIMISATION))
    for args, needle in ((["--ray-address", "127.0.0.1:1"], "--ray-address: cannot reach"),
                         (["--ray-address", "nohost"], "expected host:port"),
                         (["--gpus-per-job", "0.5"], "--gpus-per-job: only with --ray-address")):
        assert main(["redteam", "--config", str(cfg), "--out", str(tmp_path / "o"), "--quiet", *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        main(["redteam", "--config", str(cfg), "--ray-address", "auto", "--gpus-per-job", "0"])
    assert "--gpus-per-job: expected a number in (0, 8]" in capsys.readouterr().err
    for bad, field in (({"gpus_per_job": -1}, "gpus_per_job"), ({"max_retries": -1}, "max_retries"),
                       ({"address": ""}, "ray_address")):
        with pytest.raises(ConfigError, match=field):
            RayJobs(**bad)
    with pytest.raises(ConfigError, match="backend: expected"):
        as_backend("threads")


@pytest.mark.parametrize("when", ["ray starting", "a job done", "never"])
def test_the_command_on_a_local_instance_it_starts(tmp_path, when):
    """``guardfl redteam --ray-address local``: a certificate, or after a Ctrl-C to the whole process group
    (while Ray starts, or once a job is done) one line and exit 130; no Ray process is left either way."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    import yaml

    from tests.redteam.sweep.test_sweep_interrupt import BOUND, _group, _raylet_started

    cfg = {**LTI_AND_OPTIMISATION, "attacks": [*LTI_AND_OPTIMISATION["attacks"][:1], {"name": "dlg", "budget": {
        "iterations": 10 if when == "never" else 2000}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "o"
    run = subprocess.Popen([sys.executable, "-m", "guardfl", "redteam", "--config", str(path), "--out", str(out), "--quiet",
                            "--ray-address", "local", "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stderr), daemon=True)
    reader.start()
    if when != "never":
        started = (lambda: _raylet_started(run.pid)) if when == "ray starting" else \
            (lambda: any((out / "state").glob("b*-*.json")))
        deadline = time.monotonic() + BOUND
        while not started():
            assert run.poll() is None, lines
            assert time.monotonic() < deadline, f"not {when} within {BOUND} s"
            time.sleep(0.02)
        os.killpg(run.pid, signal.SIGINT)
    try:
        code = run.wait(timeout=BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        pytest.fail(f"guardfl redteam hung: still running {BOUND} s after the signal")
    reader.join(timeout=10)
    if when == "never":
        assert code in (0, 1, 3), lines
        assert json.loads((out / "certificate.json").read_text())["environment"]["backend"]["address"] == "local"
    else:
        assert (code, [x.rstrip("\n") for x in lines]) == (130, ["interrupted: no verdict (continue with --resume)"])
        assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    time.sleep(1)
    assert _group(run.pid) == []
