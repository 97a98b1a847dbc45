"""The shipped configs' verdicts, as the docs quote them: run each config as shipped and write
``docs/data/verdicts.json`` (the docs' decision table and config index are generated from that file).

    python bench/bench_verdicts.py                      # every config the decision table names
    python bench/bench_verdicts.py configs/default.yaml  # just these (the others keep their entries)
    python bench/bench_verdicts.py --list                # what the file holds, and how each entry was obtained

Each config runs through ``guardfl.redteam.certify`` exactly as ``guardfl redteam --config PATH`` runs it
(its own budget, defense randomness from OS entropy as deployed, ``--workers``), and its entry records the
verdict, the proven bound, each claim's upper bound, the updates attacked, the seconds, the date, the command
and ``how: measured``. ``--samples N`` runs a quick look instead (the entry then says so: the claim rests on
the override). Entries not re-run keep what they hold, including ``how: documented`` entries copied from a
config's header or the lab notebook (dated there), which a run replaces. The file's ``decision`` rows (the
threat models of the docs' table) are edited by hand: each names a config whose entry this bench writes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERDICTS = ROOT / "docs" / "data" / "verdicts.json"


def entry_of(cert, seconds: float, command: str) -> dict:
    """The verdicts.json entry of one certificate."""
    ev = cert.evidence or {}
    claims = {name: ev[name] for name in ("leak_rate", "reid_rate") if isinstance(ev.get(name), dict)}
    bound = cert.bound or {}
    b = bound.get("status")
    if b and bound.get("rero") is not None:
        b = f"{b} ({bound['rero']:.3g})"
    first = next(iter(claims.values()), {})
    return {
        "verdict": cert.verdict,
        "bound": b,
        "leak_upper": _round(claims.get("leak_rate", {}).get("upper_bound")),
        "reid_upper": _round(claims.get("reid_rate", {}).get("upper_bound")),
        "claims": {k: {"status": v.get("status"), "max_rate": v.get("max_rate"), "observed": _round(v.get("observed_rate")),
                       "upper_bound": _round(v.get("upper_bound")), "more_updates": v.get("more_updates")}
                   for k, v in claims.items()},
        "updates": first.get("updates"),
        "seconds": round(seconds),
        "how": "measured",
        "date": dt.date.today().isoformat(),
        "command": command,
    }


def _round(x):
    return None if x is None else round(float(x), 3)


def run(path: str, samples: int | None, workers: int | None) -> dict:
    from guardfl.redteam import certify

    command = f"guardfl redteam --config {path}" + (f" --samples {samples}" if samples else "")
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        cert = certify(str(ROOT / path), out=out, workers=workers, samples=samples)
        seconds = time.perf_counter() - t0
    entry = entry_of(cert, seconds, command)
    if samples:
        entry["note"] = f"a quick look: --samples {samples} (the claim rests on the override)"
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="configs to run, relative to the repository (default: every config "
                    "the file's decision rows name)")
    ap.add_argument("--samples", type=int, default=None, help="a quick look: about this many private samples")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="print the entries and exit")
    args = ap.parse_args(argv)
    data = json.loads(VERDICTS.read_text())
    if args.list:
        for rel, e in sorted(data["configs"].items()):
            print(f"{rel:55s} {e.get('verdict', '?'):14s} {e.get('how', '')} {e.get('date', '')}")
        return 0
    todo = args.configs or sorted({row["config"] for row in data["decision"]})
    for rel in todo:
        rel = Path(rel).as_posix()
        print(f"[run ] {rel}", flush=True)
        try:
            entry = run(rel, args.samples, args.workers)
        except Exception as err:  # a config that fails is reported, the others still run
            print(f"[FAIL] {rel}: {type(err).__name__}: {err}", flush=True)
            continue
        data["configs"][rel] = entry
        data["generated"] = dt.datetime.now().isoformat(timespec="minutes")
        data["command"] = "python bench/bench_verdicts.py" + (" " + " ".join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else "")
        data["machine"] = f"{platform.machine()}, {os.cpu_count()} cores ({platform.python_version()})"
        VERDICTS.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")  # after each: an interrupted run keeps its results
        print(f"[done] {rel}: {entry['verdict']} ({entry['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
