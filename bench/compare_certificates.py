"""Certificates of the shipped configs, without timings, and a diff of two such folders (issue 38).

    python bench/compare_certificates.py --out before [--samples 2] [--workers 1] [configs/x.yaml ...]
    python bench/compare_certificates.py --compare before after [configs/x.yaml ...]

The first form runs ``guardfl redteam`` (``certification.run.certify``, a state folder and report under
``<out>/runs/<name>/`` as the command writes them) on each config (default: every ``configs/**/*.yaml`` but ``configs/defenses``) and
writes ``<out>/<name>.json``: the written ``certificate.json`` passed through ``certificate.untimed`` (no
``wall_time_s``, no ``*seconds``), keys sorted. The defense seed is pinned (``defense.seed`` set to
``--seed``, 0 by default, when the config leaves it unset), so that two runs of one config give one
certificate. A config that cannot run here is skipped with the reason printed and written to
``<out>/index.json``: a sweep config (not a certificate), ``device: cuda`` without a GPU, a dataset that is
not on disk (no downloads). A config that fails is reported as failed (never dropped silently) and the
command then exits 1. ``--samples N`` attacks about N private samples per config (``certify --samples``):
a quick look, the same override in both runs.

The index is rewritten after every config, so an interrupted run compares as far as it got. The second
form compares two output folders: every config present in either (or the configs named), and the index
(which ran, which were skipped, which failed). Exit 0 when they are identical; else a readable per-config diff (the
JSON path of each differing value, both values) and exit 1.

Limit: a config whose defense lives in user code (``target``) and is not seeded there stays random; its
certificate differs between runs and the diff shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
INDEX = "index.json"
MAX_LINES = 25  # differing values shown per config


def skip_reason(path: Path) -> str | None:
    """Why ``path`` cannot give a certificate on this machine (None: it can)."""
    import torch

    from guardfl.redteam.config import load_config
    from guardfl.redteam.modality import SOURCES
    from guardfl.yamlio import load_yaml

    raw = load_yaml(path)
    if isinstance(raw, dict) and "base" in raw:
        return "a sweep config (guardfl sweep), not a red-team certificate"
    cfg = load_config(path)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        return f"needs a GPU (device: {cfg.device}); none here"
    sections = [("data", cfg.data)]
    if cfg.aux is not None:
        sections += [("aux", cfg.aux), ("aux.ood", cfg.aux.ood)]
    for field, section in sections:
        if section is None or getattr(section, "source", None) is None:
            continue
        if SOURCES[section.source].torchvision:
            missing = _torchvision_missing(section.source, section.root)
            if missing:
                return f"{field}: {section.source} not on disk under {section.root} ({missing}); no downloads here"
        path_ = getattr(section, "path", None)
        if path_ and not Path(os.path.expanduser(path_)).exists():
            return f"{field}.path: {path_} not present"
    return None


def _torchvision_missing(source: str, root: str | None) -> str | None:
    import torchvision

    from guardfl.redteam.modality import SOURCES

    try:
        getattr(torchvision.datasets, SOURCES[source].torchvision)(root=os.path.expanduser(root or "."), train=True, download=False)
    except Exception as err:  # torchvision raises RuntimeError for a dataset that is not there
        return str(err).splitlines()[0][:120]
    return None


def pinned(path: Path, seed: int):
    """The config at ``path`` with its defense seed set to ``seed`` when the config leaves it unset."""
    from guardfl.redteam.config import load_config

    cfg = load_config(path)
    if cfg.defense is not None and cfg.defense.get("seed") is None:
        # a typed copy: dumping and loading again fills sections a target config must leave out (data)
        return cfg.model_copy(update={"defense": {**cfg.defense, "seed": seed}})
    return cfg


def run_one(path: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Certify one config; its untimed certificate under ``out``. The index entry."""
    from guardfl.redteam.runtime.files import CERTIFICATE
    from guardfl.redteam.certification.run import certify
    from guardfl.redteam.certification.certificate import untimed

    name = path.stem
    reason = skip_reason(path)
    if reason is not None:
        print(f"[skip] {name}: {reason}", flush=True)
        return {"config": name, "status": "skipped", "reason": reason}
    cwd = os.getcwd()
    os.chdir(ROOT)  # relative paths in a config read as from the repository root, where the command runs
    started = time.perf_counter()
    try:
        cert = certify(pinned(path, args.seed), out=out / "runs" / name, samples=args.samples, workers=args.workers,
                       progress=False)
        written = json.loads((out / "runs" / name / CERTIFICATE).read_text())
    except Exception as err:
        print(f"[FAIL] {name}: {type(err).__name__}: {err}", flush=True)
        if args.debug:
            traceback.print_exc()
        return {"config": name, "status": "failed", "reason": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    finally:
        os.chdir(cwd)
    (out / f"{name}.json").write_text(json.dumps(untimed(written), indent=1, sort_keys=True) + "\n")
    print(f"[ran ] {name}: {cert.verdict} ({time.perf_counter() - started:.0f}s)", flush=True)
    return {"config": name, "status": "ran", "verdict": cert.verdict}


def diff(a: Any, b: Any, where: str = "") -> list[str]:
    """The differing values of two JSON documents, one line each (``path: a != b``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for k in sorted(set(a) | set(b), key=str):
            here = f"{where}.{k}" if where else str(k)
            if k not in a:
                lines.append(f"{here}: only in B ({_short(b[k])})")
            elif k not in b:
                lines.append(f"{here}: only in A ({_short(a[k])})")
            else:
                lines += diff(a[k], b[k], here)
        return lines
    if isinstance(a, list) and isinstance(b, list):
        lines = [] if len(a) == len(b) else [f"{where}: {len(a)} items != {len(b)} items"]
        for i, (x, y) in enumerate(zip(a, b)):
            lines += diff(x, y, f"{where}[{i}]")
        return lines
    same = a == b or (a != a and b != b)  # NaN (an attack that diverged) is the same as NaN
    return [] if same else [f"{where or '(root)'}: {_short(a)} != {_short(b)}"]


def _short(value: Any, limit: int = 100) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def read_index(folder: Path) -> dict[str, Any]:
    """The index of an output folder (written after every config, so an interrupted run has one too)."""
    return json.loads((folder / INDEX).read_text())


def compare(a: Path, b: Path, only: list[str] | None = None) -> int:
    """Print a per-config diff of two output folders (``only``: just these config names); 0 when
    identical, 1 otherwise."""
    for d in (a, b):
        if not (d / INDEX).is_file():
            print(f"error: {d} has no {INDEX} (not an output of this script)", file=sys.stderr)
            return 2
    index_a = {e["config"]: e for e in read_index(a)["configs"]}
    index_b = {e["config"]: e for e in read_index(b)["configs"]}
    differing = 0
    settings_a, settings_b = read_index(a)["settings"], read_index(b)["settings"]
    if settings_a != settings_b:
        differing += 1
        print(f"  DIFF  settings: {_short(settings_a)} != {_short(settings_b)}")
    for name in sorted(set(only) if only else set(index_a) | set(index_b)):
        ea, eb = index_a.get(name), index_b.get(name)
        if ea is None or eb is None:
            lines = [f"only in {'B' if ea is None else 'A'}"]
        elif ea["status"] != eb["status"]:
            lines = [f"status: {ea['status']} != {eb['status']} ({ea.get('reason') or eb.get('reason')})"]
        elif ea["status"] != "ran":
            print(f"  same  {name} ({ea['status']}: both)")
            continue
        else:
            lines = diff(json.loads((a / f"{name}.json").read_text()), json.loads((b / f"{name}.json").read_text()))
        if not lines:
            print(f"  same  {name}")
            continue
        differing += 1
        print(f"  DIFF  {name}: {len(lines)} value(s)")
        for line in lines[:MAX_LINES]:
            print(f"          {line}")
        if len(lines) > MAX_LINES:
            print(f"          ... and {len(lines) - MAX_LINES} more")
    print(f"{differing} config(s) differ" if differing else "identical")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", type=Path,
                   help="configs to run (default: every configs/**/*.yaml but configs/defenses); with --compare, the configs to compare (default: all)")
    p.add_argument("--out", type=Path, help="folder for the untimed certificates")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="diff two output folders")
    p.add_argument("--samples", type=int, default=None, help="attack about N private samples per config (quick)")
    p.add_argument("--seed", type=int, default=0, help="the defense seed pinned where a config leaves it unset")
    p.add_argument("--workers", type=int, default=1, help="worker processes per run (the certificate does not depend on it)")
    p.add_argument("--debug", action="store_true", help="tracebacks of failing configs")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare, only=[c.stem for c in args.configs])
    if args.out is None:
        p.error("--out (or --compare A B) is required")
    if args.samples is not None and args.samples < 1:
        p.error(f"--samples: expected an integer >= 1 (got {args.samples})")
    configs = [c.resolve() for c in args.configs] or sorted(
        p for p in (ROOT / "configs").rglob("*.yaml") if p.relative_to(ROOT / "configs").parts[0] != "defenses")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"samples": args.samples, "seed": args.seed, "workers": args.workers}
    entries: list[dict[str, Any]] = []
    for c in configs:  # the index after every config: an interrupted run can still be compared as far as it got
        entries.append(run_one(c, args.out.resolve(), args))
        (args.out / INDEX).write_text(json.dumps({"settings": settings, "configs": entries}, indent=1) + "\n")
    failed = [e["config"] for e in entries if e["status"] == "failed"]
    print(f"{sum(e['status'] == 'ran' for e in entries)} ran, {sum(e['status'] == 'skipped' for e in entries)} skipped, "
          f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
