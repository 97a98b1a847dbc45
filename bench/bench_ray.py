"""One certificate on Ray (issue 36): throughput against workers, the driver's overhead per job, the
object-store traffic per job; and the projected wall time of the paper configs on 1, 4 and 8 GPUs.

    python bench/bench_ray.py [--batches 8] [--iterations 150] [--workers 1,2] [--cluster 2]
                              [--json bench/results/ray.json]
    python bench/bench_ray.py --project [bench/results/paper_configs.json] [--gpus 1,4,8]

**Measure** (this machine, one run, every ratio against the sequential row of the same run): a small
CPU config (LeNet wide-init, one private image per update, ``--batches`` updates, DLG with
``--iterations`` iterations: one job per update, as a certificate at 59 samples has 59 per attack) runs
in this process (the baseline), in ``--workers`` local processes, on a local Ray instance of that many
CPUs, and on a simulated cluster (``ray.cluster_utils.Cluster``: a head that runs no task and
``--cluster`` nodes of one CPU). Each row reports wall time (``certify``'s, so data, client and report
included; Ray's start apart), jobs per second, and for Ray rows the driver's seconds per job outside its
waits (submitting, fetching, unpickling; and apart: writing the state folder, which any backend does) and
the object store's bytes per job (put by the driver: the run context once, prepared states once per
plan; fetched: the results). The certificates of every row must equal the baseline's (timings and
``environment`` aside). Timings on a shared machine are noisy: the JSON records the load average.

**Project** (``--project``): a certificate's jobs are list-scheduled on N GPUs, one job per GPU
(``gpus_per_job: 1``), preparations first, a prepared attack's jobs after its preparation, longest job
first otherwise; wall(N) = serial part (data, client simulation, report) + the schedule's makespan. From
a ``bench_paper_configs.py --json`` file the per-attack seconds are split over that attack's jobs
(``certify.plan_jobs``: one per update, or one per chunk of 16 updates for attacks that batch samples).
Without a file it prints the projection from the README's H100 totals (2026-11-23), where only the job
structure is known: see ``README_H100``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"


def config(batches: int, iterations: int) -> dict[str, Any]:
    return {"model": {"name": "lenet", "state": "wide-init"}, "client": {"batch_size": 1},
            "attacks": [{"name": "dlg", "budget": {"iterations": iterations}}],
            "certify": {"max_ssim": 0.5, "max_updates": batches}, "strength": "quick"}


def _untimed(cert) -> str:
    from guardfl.redteam.certification.certificate import untimed

    return json.dumps(untimed(cert.to_dict(), ignore=("environment",)), sort_keys=True, default=str)


def _row(name: str, cert, jobs: int, seconds: float, stats=None) -> dict[str, Any]:
    row = {"row": name, "seconds": seconds, "jobs": jobs, "jobs_per_s": jobs / seconds}
    if stats is not None:
        s = stats.as_dict()
        row.update(ray_start_s=s["start_seconds"], ray_stop_s=s["stop_seconds"], tasks=s["tasks"],
                   driver_ms_per_job=1e3 * s["driver_seconds"] / s["tasks"],
                   state_write_ms_per_job=1e3 * s["callback_seconds"] / s["tasks"],
                   put_bytes=s["put_bytes"], puts=s["puts"], put_bytes_per_job=s["put_bytes"] / s["tasks"],
                   fetched_bytes_per_job=s["fetched_bytes"] / s["tasks"])
    return row


def measure(args) -> dict[str, Any]:
    import pickle

    import ray

    from guardfl.redteam.certification.run import certify
    from guardfl.redteam.runtime.ray_backend import RayJobs

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    cfg = config(args.batches, args.iterations)
    rows, certs = [], {}

    def timed(name: str, call, stats_of=None) -> None:
        t0 = time.perf_counter()
        cert = call()
        seconds = time.perf_counter() - t0
        stats = stats_of() if stats_of else None
        if stats is not None:
            seconds -= stats.start_seconds + stats.stop_seconds  # Ray's start and stop apart (a cluster is up already)
        certs[name] = cert
        rows.append(_row(name, cert, args.batches, seconds, stats))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    def out() -> str:  # every row writes its state folder and report, as a command does
        return tempfile.mkdtemp(prefix="bench-ray-")

    timed("sequential (baseline)", lambda: certify(cfg, out=out(), workers=1))
    for w in args.workers:
        if w > 1:
            timed(f"processes x{w}", lambda: certify(cfg, out=out(), workers=w))
    for w in args.workers:
        backend = RayJobs("local")
        timed(f"ray local, {w} CPU", lambda: certify(cfg, out=out(), workers=w, backend=backend), lambda: backend.stats)
    if args.cluster:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(args.cluster):
            cluster.add_node(num_cpus=1)
        try:
            backend = RayJobs(cluster.address)
            timed(f"ray cluster, {args.cluster} nodes x 1 CPU", lambda: certify(cfg, out=out(), workers=1, backend=backend),
                  lambda: backend.stats)
        finally:
            ray.shutdown()
            cluster.shutdown()
    base = rows[0]["seconds"]
    for row in rows:
        row["speedup"] = base / row["seconds"]
        row["same_certificate"] = _untimed(certs[row["row"]]) == _untimed(certs[rows[0]["row"]])
    # what per-task pickling of the run would have cost: the context every task would carry
    from guardfl.redteam.certification.plan import CHUNK

    context_bytes = next((r["put_bytes"] for r in rows if "put_bytes" in r and r.get("puts") == 1), None)
    return {"config": cfg, "load_average": os.getloadavg(), "cores": os.cpu_count(), "rows": rows,
            "context_bytes": context_bytes, "note": "busy shared machine: timings are noisy",
            "chunk": CHUNK, "pickle_protocol": pickle.DEFAULT_PROTOCOL}


# -- projection --------------------------------------------------------------------------------------
#: the README's H100 totals (2026-11-23, bench_paper_configs.py) and each config's jobs as planned by
#: certify.plan_jobs (batches: 4 in every shipped paper config; CHUNK = 16 updates per job for attacks that
#: batch samples). "split": how the total divides over the jobs, when known; None: only bounds follow.
README_H100: dict[str, dict[str, Any]] = {
    "huang2021-gradprune-0.99-b1": {"seconds": 213, "how": "measured", "jobs": ["IG b0-3"]},
    "huang2021-instahide-k4-b16": {"seconds": 522, "how": "measured", "jobs": ["IG b0-3"]},
    "outpost2024-scenario1": {"seconds": 122, "how": "measured",
                              "jobs": ["LI prep", "LI b0-3", "IG b0-3", "DLG b0", "DLG b1", "DLG b2", "DLG b3"]},
    "huang2021-gradprune-0.9-b16": {"seconds": 700, "how": "2% probe", "jobs": ["IG b0-3"]},
    "huang2021-instahide-k4-prune0.9-b32": {"seconds": 910, "how": "probe", "jobs": ["IG b0-3"]},
    "huang2021-gradprune-0.9-b32": {"seconds": 1030, "how": "probe", "jobs": ["IG b0-3"]},
    "outpost2024-scenario2": {"seconds": 715, "how": "probe, upper bound",
                              "jobs": ["LI prep", "LI b0-3", "IG b0-3", "DLG b0", "DLG b1", "DLG b2", "DLG b3"]},
    "outpost2024-scenario3": {"seconds": 1390, "how": "probe, upper bound",
                              "jobs": ["LI prep", "LI b0-3", "IG b0-3", "DLG b0", "DLG b1", "DLG b2", "DLG b3"]},
}


def makespan(jobs: list[tuple[str, float, str | None]], gpus: int) -> float:
    """List scheduling on ``gpus`` devices, one job each: ``jobs`` = (name, seconds, the name of the job
    it waits for or None); ready jobs start longest first, as soon as a device is free."""
    free = [0.0] * gpus
    done: dict[str, float] = {}
    left = list(jobs)
    while left:
        ready = [j for j in left if j[2] is None or j[2] in done]
        name, seconds, after = max(ready, key=lambda j: (j[1], j[0]))
        left.remove((name, seconds, after))
        k = min(range(gpus), key=lambda g: free[g])
        start = max(free[k], done.get(after, 0.0) if after else 0.0)
        free[k] = done[name] = start + seconds
    return max(free) if free else 0.0


def jobs_of(row: dict[str, Any], batches: int = 4, chunk: int = 16) -> tuple[list[tuple[str, float, str | None]], float]:
    """A ``bench_paper_configs`` JSON row's jobs with their seconds, and the serial part (the row's time
    less every job's). An attack's seconds (the sum of its records' ``seconds``) are split evenly over its
    jobs; that bench runs with one worker, where a prepared attack's first job also trains (its
    ``preparations`` seconds are taken out of the attack's and made the preparation job). A probe row
    (``scale`` < 1) is projected to paper strength as that bench does: the attack seconds / scale."""
    from guardfl.redteam import attacks as registry

    scale = float(row.get("scale") or 1.0)
    jobs: list[tuple[str, float, str | None]] = []
    measured = 0.0
    for name, a in row["attacks"].items():
        cls = registry.ATTACKS[name]
        size = chunk if cls.capabilities.batches_samples else 1
        n = -(-batches // size)
        total = float(a["seconds"])
        measured += total
        after = None
        if cls.capabilities.prepares:
            prep = next((float(v) for k, v in (row.get("preparations") or {}).items() if k.endswith(name) and v), 0.0)
            total = max(0.0, total - prep)
            after = f"{name} prep"
            jobs.append((after, prep / scale, None))
        jobs += [(f"{name} {i}", total / n / scale, after) for i in range(n)]
    serial = max(0.0, float(row["seconds"]) - measured)
    return jobs, serial


def project(path: Path | None, gpus: list[int]) -> list[dict[str, Any]]:
    out = []
    if path is not None:
        data = json.loads(path.read_text())
        for row in data["rows"] if isinstance(data, dict) else data:
            if "attacks" not in row:  # a failed config: no times
                continue
            jobs, serial = jobs_of(row)
            out.append({"config": row["config"], "jobs": len(jobs),
                         **{f"{g} GPU": serial + makespan(jobs, g) for g in gpus}})
        return out
    for name, r in README_H100.items():
        t, n = r["seconds"], len(r["jobs"])
        if n == 1:  # one job: more devices cannot help
            cells = {f"{g} GPU": f"{t:,} s" for g in gpus}
        else:  # chains LI prep -> LI job, IG, DLG x4: wall(N) is between an even split over min(N, chains) and T1
            chains = n - sum(" prep" in j for j in r["jobs"])
            cells = {f"{g} GPU": (f"{t:,} s" if g == 1 else f"{t // min(g, chains):,}-{t:,} s") for g in gpus}
        out.append({"config": name, "H100 total": f"{t:,} s ({r['how']})", "jobs": n, **cells})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--cluster", type=int, default=2, help="nodes of the simulated cluster (0: none)")
    p.add_argument("--json", type=Path, default=OUT / "ray.json")
    p.add_argument("--project", nargs="?", const="README", default=None,
                   help="project instead of measuring: a bench_paper_configs JSON, or the README's H100 totals")
    p.add_argument("--gpus", default="1,4,8")
    args = p.parse_args(argv)
    if args.project is not None:
        rows = project(None if args.project == "README" else Path(args.project), [int(g) for g in args.gpus.split(",")])
        keys = list(rows[0]) if rows else []
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(f"{v:,.0f} s" if isinstance(v, float) else str(v) for v in r.values()) + " |")
        return 0
    args.workers = [int(w) for w in args.workers.split(",")]
    result = measure(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"| row | wall s | jobs/s | vs sequential | Ray start s | driver ms/job | state write ms/job | "
          "put B/job | fetched B/job | same certificate |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        def g(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"| {r['row']} | {r['seconds']:.1f} | {r['jobs_per_s']:.2f} | {r['speedup']:.2f}x | {g('ray_start_s', '.1f')} | "
              f"{g('driver_ms_per_job', '.1f')} | {g('state_write_ms_per_job', '.1f')} | {g('put_bytes_per_job', ',.0f')} | "
              f"{g('fetched_bytes_per_job', ',.0f')} | {r['same_certificate']} |")
    print(f"load average {result['load_average']}; the run context is {result['context_bytes']} bytes, put once")
    return 0 if all(r["same_certificate"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
