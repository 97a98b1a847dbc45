"""Reproducibility as a number (issue 64): run shipped configs K times, unseeded as deployed, and tally
their verdicts.

    python bench/bench_reproducibility.py [CONFIG ...] [--runs 20] [--vary-seed] [--workers N]
                                          [--json bench/results/reproducibility.json]

Each run is one ``guardfl redteam --config X`` command line (what a reviewer re-runs), in a fresh output
folder. The client's defense draws its randomness from OS entropy in every run, as deployed; the config's
``seed`` (which private samples are drawn, the attacks' restarts) is the shipped one unless ``--vary-seed``
gives run ``r`` the seed ``r`` (a stricter test: other samples too). The table gives, per config, the tally
of verdicts over the runs, the median wall time and its spread, and whether the rule of issue 64 holds:
the same decided verdict in at least 19 of 20 runs (or INCONCLUSIVE), never CERTIFIED in one run and
NOT CERTIFIED in another.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ["configs/default.yaml", "configs/no-defense.yaml"]


def run_once(config: Path, seed: int | None, workers: int | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = config
        if seed is not None:
            cfg = yaml.safe_load(config.read_text())
            cfg["seed"] = seed
            path = Path(tmp) / config.name
            path.write_text(yaml.safe_dump(cfg))
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "guardfl", "redteam", "--config", str(path), "--out", str(out), "--quiet"]
        if workers:
            cmd += ["--workers", str(workers)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            return {"verdict": "TIMEOUT", "exit": None, "seconds": time.perf_counter() - t0}
        seconds = time.perf_counter() - t0
        cert = out / "certificate.json"
        if not cert.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] if proc else []
            return {"verdict": "FAILED", "exit": code, "seconds": seconds, "error": tail}
        c = json.loads(cert.read_text())
        rate = (c.get("evidence") or {}).get("leak_rate") or {}
        return {"verdict": c.get("verdict"), "exit": code, "seconds": seconds,
                "leaked": rate.get("leaked"), "samples": rate.get("samples"), "updates": rate.get("updates")}


def holds(tally: collections.Counter, runs: int) -> bool:
    decided = {v: n for v, n in tally.items() if v in ("CERTIFIED", "NOT CERTIFIED")}
    if len(decided) > 1:
        return False
    if not decided:
        return set(tally) <= {"INCONCLUSIVE", "INSUFFICIENT EVIDENCE"}
    verdict, n = next(iter(decided.items()))
    return n >= 0.95 * runs or set(tally) <= {verdict, "INCONCLUSIVE"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--vary-seed", action="store_true")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "reproducibility.json"))
    args = ap.parse_args(argv)
    rows = []
    for config in args.configs:
        runs = []
        for r in range(args.runs):
            one = run_once(ROOT / config, r if args.vary_seed else None, args.workers, args.timeout)
            runs.append(one)
            print(f"{config} run {r + 1}/{args.runs}: {one['verdict']} ({one['seconds']:.0f} s"
                  f"{', leaked %s of %s' % (one.get('leaked'), one.get('samples')) if one.get('samples') else ''})",
                  flush=True)
        tally = collections.Counter(one["verdict"] for one in runs)
        times = [one["seconds"] for one in runs]
        rows.append({"config": config, "runs": runs, "tally": dict(tally), "holds": holds(tally, args.runs),
                     "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)})
    print("\n| config | runs | verdicts | rule holds | median s (min-max) |\n|---|---|---|---|---|")
    for row in rows:
        tally = ", ".join(f"{v} {n}" for v, n in sorted(row["tally"].items()))
        print(f"| {row['config']} | {len(row['runs'])} | {tally} | {'yes' if row['holds'] else 'NO'} | "
              f"{row['median_s']:.0f} ({row['min_s']:.0f}-{row['max_s']:.0f}) |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"vary_seed": args.vary_seed, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
