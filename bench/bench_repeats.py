"""Job-seconds and leaks per attack of a certification, and what running repeated work once saved (issue 38).

    python bench/bench_repeats.py run [--config configs/default.yaml] --out OUT [--workers 1] [--defense-seed 0]
    python bench/bench_repeats.py compare BEFORE_OUT AFTER_OUT

``run``: the config with the defense's seed pinned (a copy; Outpost's noise is OS entropy otherwise, and two
runs would attack different updates, so their leaks could not be compared), certified into OUT.
``compare``: per attack, the job-seconds (the sum of its records' ``seconds``: a batched job's time is
split over its records; a reused record has 0; with one worker a preparation runs inside its attack's
first job) and preparation seconds, the samples it leaked, and the
records reused; then whether any (attack, sample) leak of BEFORE is missing in AFTER, and whether the
two certificates agree apart from timings and the ``reused`` notes. The job-seconds come from the
certificates' own records, so a busy machine inflates both columns alike rather than the wall time.
Writes ``bench/results/repeats.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "repeats.json"


def run(config: Path, out: Path, workers: int, defense_seed: int) -> None:
    from guardfl.redteam.certification.run import certify

    cfg = yaml.safe_load(config.read_text())
    if cfg.get("defense"):
        cfg["defense"]["seed"] = defense_seed
    with tempfile.TemporaryDirectory() as tmp:
        pinned = Path(tmp) / config.name
        pinned.write_text(yaml.safe_dump(cfg))
        cert = certify(pinned, out=out, workers=workers)
    print(f"{cert.verdict} in {cert.wall_time_s:.0f} s ({workers} worker(s)): {out}")


def summary(cert: dict) -> dict:
    """Per attack: job-seconds, reused records, leaked samples; the preparations' seconds."""
    rows: dict[str, dict] = {}
    for r in cert["results"]:
        row = rows.setdefault(r["attack"], {"job_seconds": 0.0, "records": 0, "reused": 0, "leaked": []})
        row["job_seconds"] += r.get("seconds") or 0.0
        row["records"] += 1
        row["reused"] += "reused" in r
    for hit in cert["evidence"]["leaked_samples"]:
        for attack in sorted({h["attack"] for h in hit["by"]}):
            rows[attack]["leaked"].append((hit["batch"], hit["image"]))
    for key, prep in (cert.get("preparations") or {}).items():
        name = key.split("-", 1)[1]
        rows.setdefault(name, {"job_seconds": 0.0, "records": 0, "reused": 0, "leaked": []})
        rows[name]["preparation_seconds"] = prep.get("seconds") or 0.0
    return rows


def _total(cert: dict, rows: dict) -> float:
    """The run's job-seconds: its records', plus its preparations' when worker processes ran them as tasks
    of their own (with one worker a preparation runs inside its attack's first job, counted there)."""
    jobs = sum(r["job_seconds"] for r in rows.values())
    if (cert.get("environment") or {}).get("workers", 1) > 1:
        jobs += sum(r.get("preparation_seconds", 0.0) for r in rows.values())
    return jobs


def _untimed(obj, drop=("reused",)):
    if isinstance(obj, dict):
        return {k: _untimed(v, drop) for k, v in obj.items()
                if k not in drop and k != "wall_time_s" and not k.endswith("seconds")}
    if isinstance(obj, list):
        return [_untimed(v, drop) for v in obj]
    return obj


def compare(before_dir: Path, after_dir: Path) -> dict:
    before, after = (json.loads((d / "certificate.json").read_text()) for d in (before_dir, after_dir))
    a, b = summary(before), summary(after)
    print(f"{'attack':22s} {'job-s before':>12s} {'job-s after':>12s} {'prep-s before':>13s} {'prep-s after':>12s} "
          f"{'leaked before':>13s} {'leaked after':>12s} {'reused':>7s}")
    lost = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name, {}), b.get(name, {})
        print(f"{name:22s} {x.get('job_seconds', 0):12.1f} {y.get('job_seconds', 0):12.1f} "
              f"{x.get('preparation_seconds', 0):13.1f} {y.get('preparation_seconds', 0):12.1f} "
              f"{len(x.get('leaked', [])):13d} {len(y.get('leaked', [])):12d} {y.get('reused', 0):4d}/{y.get('records', 0)}")
        lost += [(name, s) for s in set(map(tuple, x.get("leaked", []))) - set(map(tuple, y.get("leaked", [])))]
    total = [_total(cert, s) for cert, s in ((before, a), (after, b))]
    same = _untimed(before["results"]) == _untimed(after["results"]) and before["evidence"] == after["evidence"]
    print(f"total job-seconds: {total[0]:.1f} -> {total[1]:.1f}; verdict {before['verdict']} -> "
          f"{after['verdict']}; leaks lost: {lost or 'none'}; results equal apart from timings and 'reused': {same}")
    out = {"before": {"dir": str(before_dir), "verdict": before["verdict"], "attacks": a, "total_job_seconds": total[0]},
           "after": {"dir": str(after_dir), "verdict": after["verdict"], "attacks": b, "total_job_seconds": total[1]},
           "leaks_lost": lost, "results_equal_untimed": same}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, default=str))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--defense-seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.config, args.out, args.workers, args.defense_seed)
    else:
        compare(args.before, args.after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
