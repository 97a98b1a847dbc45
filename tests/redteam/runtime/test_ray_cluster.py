"""One certificate on a real multi-node Ray cluster (issue 36): ``ray.cluster_utils.Cluster`` with a head
that runs no tasks and two worker nodes of one CPU each; a worker node is removed while it runs a job.
Only the jobs that were running there are redone (Ray's retries), and the certificate is the local run's."""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from guardfl.redteam.certification.run import certify
from guardfl.redteam.certification.certificate import untimed
from guardfl.redteam.runtime.ray_backend import RayJobs

ray = pytest.importorskip("ray")

CONFIG = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"limit": 12},
    "client": {"batch_size": 1},
    "aux": {"source": "lfw-faces", "offset": 12, "limit": 40},
    "attacks": [{"name": "learned_inversion", "budget": {"hidden": 32, "epochs": 2, "batch": 32}},
                {"name": "dlg", "budget": {"iterations": 60}}],
    "certify": {"max_ssim": 0.4, "max_updates": 4},
    "strength": "quick",
}
BOUND = 120


def _running_job(raylet_pid: int) -> str | None:
    """The title of a worker process of that raylet that runs one of our tasks (Ray titles it 'ray::NAME')."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == raylet_pid and title.startswith("ray::") and title.removeprefix("ray::").split()[0][:1] in "bp":
            return title  # b<batch>-<plan>-<attack> or prepare-<plan>-<attack>
    return None


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def test_a_node_removed_mid_run_loses_only_its_jobs(cluster, tmp_path):
    c, nodes = cluster
    whole = certify(CONFIG, workers=1)
    raylets = [(node, node.all_processes["raylet"][0].process.pid) for node in nodes]
    removed: list[str] = []
    finished = threading.Event()

    def remove_when_busy() -> None:
        """Remove the first worker node seen running one of our jobs (which node Ray picks is its own
        business: a test that waited for the second one failed when Ray kept every job on the first)."""
        deadline = time.monotonic() + BOUND
        while not finished.is_set() and time.monotonic() < deadline:
            for node, raylet in raylets:
                title = _running_job(raylet)
                if title is not None:
                    c.remove_node(node, allow_graceful=False)
                    removed.append(title)
                    return
            time.sleep(0.02)

    watcher = threading.Thread(target=remove_when_busy, daemon=True)
    watcher.start()
    backend = RayJobs(c.address)
    try:
        cert = certify(CONFIG, out=tmp_path, workers=1, backend=backend)
    finally:
        finished.set()
        watcher.join(timeout=10)
    assert removed, "no job was seen running on a worker node"
    assert json.dumps(untimed(cert.to_dict(), ignore=("environment",)), sort_keys=True, default=str) == \
        json.dumps(untimed(whole.to_dict(), ignore=("environment",)), sort_keys=True, default=str)
    assert cert.environment["backend"]["address"] == c.address and cert.environment["backend"]["cpus"] == 2
    assert json.loads((tmp_path / "certificate.json").read_text())["verdict"] == whole.verdict
