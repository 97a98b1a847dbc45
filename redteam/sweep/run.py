"""``guardfl sweep``: which defense setting costs the least accuracy and still certifies.

``sweep`` reads as a recipe: load and validate the sweep (every point's config, before anything runs),
open the backend (Ray, local processes, or this process), evaluate points as the scheduler hands them
out (the whole grid, or a bisection per monotone axis with ``autotune``), choose the certified point with
the least accuracy drop, and write ``sweep.json``, the privacy-utility plot, ``report.html`` and the
chosen defense as YAML.

A point is one job (``evaluate_point``): the red team on the client with that defense (``certify``, its
certificate and report under ``OUT/points/<id>/``) and the utility task trained with it
(``utility.evaluate``), against the undefended model trained in the same process (the accuracy drop,
and the training-time ratio measured in the same process). Jobs are independent and seeded by the sweep
(``sweepconfig.point_seed``), so a point's result is the same on any backend and worker count (for the
same ``threads``). A finished point is saved as ``OUT/points/<id>.json`` with its key; ``resume`` reuses
the points whose key matches and continues unfinished red-team runs from their state; a file there that
is not a point record (``_saved``) is named in a warning and its point evaluated again.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.sweep import autotune
from guardfl.redteam.runtime.files import atomic_write
from guardfl.redteam.sweep.config import Point, SweepPlan, UtilitySection, load_sweep
from guardfl.redteam.sweep.results import CHOSEN, PLOT, REPORT, SWEEP_JSON, SweepResult
from guardfl.redteam.runtime.workers import available_cores



def sweep(config: str | Path | dict, *, out: str | Path = "sweep-out", backend: str = "auto",
          workers: int | None = None, ray_address: str | None = None, fallback_local: bool = False,
          resume: bool = False, strength: str | None = None, device: str | None = None, threads: int | None = None,
          progress: bool = True, say: Callable[[str], None] | None = None) -> SweepResult:
    """Run the sweep described by ``config`` and write its results under ``out`` (see the module doc).
    ``workers``: jobs side by side (default: the available cores); ``threads``: intra-op threads per job
    (default 1: results then do not depend on the worker count)."""
    from guardfl.redteam.sweep.backends import open_backend

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    quiet = (lambda line: None) if not progress else say
    started = time.time()
    plan = load_sweep(config)
    workers = _positive(workers, "workers") or available_cores()
    threads = _positive(threads, "threads") or 1
    from guardfl.redteam.certification.plan import THREADS_PER_CORE, max_threads

    if threads > max_threads():
        raise ConfigError(f"threads: expected an integer in [1, {max_threads()}] ({THREADS_PER_CORE} x the "
                          f"{available_cores()} cores available) (got {threads})")
    out_dir = _prepare_out(Path(out))
    warnings: list[str] = []
    runner = open_backend(backend, workers, ray_address, fallback_local, warn=lambda line: (warnings.append(line), say(f"warning: {line}")))
    quiet(f"sweep {plan.digest}: {sum(len(a) for a in plan.axes)} settings on {len(plan.axes)} axes"
          f"{' (autotune: bisecting monotone axes)' if plan.config.autotune else ''}; backend {runner.describe()}")
    try:
        points = _evaluate(plan, runner, out_dir, resume, strength, device, threads, quiet,
                           warn=lambda line: (warnings.append(line), say(f"warning: {line}")))
    finally:
        runner.close()
    baseline = _baseline(points, warnings)
    evaluated = [p for p in points if p["axis"] >= 0]
    bad = autotune.violations(evaluated, plan.directions)
    if bad:
        warnings.append("certification was not monotone along an axis (" + "; ".join(
            f"{w['label']} certified, {s['label']} did not" for w, s in bad[:3]) + "): autotune's bisection assumes it; "
            "run the full grid (autotune: false) before relying on the chosen setting")
    result = SweepResult(plan, points, baseline, autotune.choose(evaluated), autotune.frontier(evaluated, plan.directions),
                         bad, runner.describe(), time.time() - started, warnings, plot_metric(plan.base))
    if not any(p["certified"] for p in evaluated):
        result.warnings.append("no evaluated setting certifies: strengthen the axes (or check the claim: "
                               f"at most {plan.base['certify']['max_updates']} update(s) attacked per point)")
    _write(result, out_dir)
    return result


def _positive(value: int | None, name: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{name}: expected an integer >= 1 (got {value!r})")
    return value


def _prepare_out(out: Path) -> Path:
    """The output folder, with an earlier sweep's verdict files removed (its points stay, for --resume)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (SWEEP_JSON, PLOT, REPORT, CHOSEN):
        (out / name).unlink(missing_ok=True)
    return out


def point_spec(plan: SweepPlan, point: Point, out_dir: Path, resume: bool, strength: str | None,
               device: str | None, threads: int, redteam: bool = True) -> dict[str, Any]:
    """Everything a job needs (it travels, pickled, to a Ray task or a process): plain data, keyed by its
    hash, and the point's validated red-team config (``config``; its JSON, ``redteam_config``, is hashed)."""
    label = "no defense" if point.axis < 0 else f"{plan.config.axes[point.axis].name()} = {point.value}"
    spec = {"id": point.id, "axis": point.axis, "index": point.index, "value": point.value, "label": label,
            "defense": point.defense, "redteam_config": point.redteam.model_dump(mode="json"),
            "utility": plan.config.utility.model_dump(mode="json"),
            "strength": strength, "device": device, "threads": threads, "redteam": redteam,
            "require": plan.config.require}
    spec["key"] = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]
    spec["out"] = str(out_dir / "points" / point.id)
    spec["resume"] = resume
    spec["config"] = point.redteam
    return spec


#: the largest point record a resume reads (a point's JSON is a few KiB; anything larger is not one)
MAX_POINT_BYTES = 16 << 20
#: what ``_evaluate`` and the report read of a saved point record
_RECORD_KEYS = ("id", "key", "axis", "index", "certified", "utility", "label")


def _saved(out_dir: Path, spec: dict[str, Any], warn: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The finished record of ``spec``'s point under ``out_dir/points``, when its key matches; else None
    (the point is evaluated again and its file replaced). A file there that is not a point record of
    this sweep (not JSON, not an object, missing fields, over ``MAX_POINT_BYTES``): ``warn`` names it and
    it is evaluated again, so a resume in CI goes on instead of failing on a stray file."""
    path = out_dir / "points" / f"{spec['id']}.json"
    if not path.exists():
        return None
    why = None
    try:
        size = path.stat().st_size
        if size > MAX_POINT_BYTES:
            why = f"{size} bytes (a point record is at most {MAX_POINT_BYTES})"
        else:
            record = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(record, dict):
                why = f"a JSON {type(record).__name__}, not a point record"
            elif record.get("key") != spec["key"]:
                return None  # an earlier sweep's point of another setting: evaluated again, as usual
            elif missing := [k for k in _RECORD_KEYS if k not in record]:
                why = f"a point record without {', '.join(missing)}"
            elif record["id"] != spec["id"]:
                why = f"the record of point {record['id']!r}, not {spec['id']!r}"
    except (OSError, ValueError) as err:
        why = f"unreadable ({type(err).__name__}: {' '.join(str(err).split())[:120]})"
    if why is not None:
        if warn is not None:
            warn(f"resume: {path} is {why}; ignored, the point is evaluated again")
        return None
    return record


def _evaluate(plan: SweepPlan, runner, out_dir: Path, resume: bool, strength, device, threads, say,
              warn: Callable[[str], None] | None = None) -> list[dict]:
    sched = autotune.Scheduler([len(a) for a in plan.axes], plan.directions, plan.config.autotune)
    records: dict[str, dict] = {}
    in_flight = 0

    def start(spec: dict[str, Any]) -> None:
        nonlocal in_flight
        saved = _saved(out_dir, spec, warn) if resume else None
        if saved is not None:
            finish(saved, reused=True)
        else:
            (out_dir / "points" / f"{spec['id']}.json").unlink(missing_ok=True)
            in_flight += 1
            runner.submit(spec["id"], evaluate_point, spec)

    def finish(record: dict[str, Any], reused: bool = False) -> None:
        records[record["id"]] = record
        if not reused:
            atomic_write(out_dir / "points" / f"{record['id']}.json", json.dumps(record, indent=2, default=str))
        if record["axis"] >= 0:
            sched.record(record["axis"], record["index"], record["certified"])
        say(f"  [{len(records)} done{', reused' if reused else ''}] {_line(record)}")

    start(point_spec(plan, plan.baseline, out_dir, resume, strength, device, threads, plan.config.redteam_baseline))
    while True:
        ready = sched.ready()
        for a, i in ready:
            start(point_spec(plan, plan.axes[a][i], out_dir, resume, strength, device, threads))
        if ready:
            continue  # a reused point may have made the next probe ready
        if in_flight == 0:
            break
        _, record = runner.next_done()
        in_flight -= 1
        finish(record)
    return sorted(records.values(), key=lambda r: (r["axis"], r["index"]))


def _line(r: dict[str, Any]) -> str:
    u = r["utility"]
    text = f"{r['label']}: "
    if r.get("verdict"):
        rate = r["leak_rate"]
        worst = ", ".join(f"worst {m} {v:.3f}" for m, v in r["worst"].items() if v is not None)
        text += f"{r['verdict']} ({rate['leaked']}/{rate['samples']} leaked, bound {rate['upper_bound']:.2f}{'; ' + worst if worst else ''}); "
    text += f"accuracy {u['accuracy']:.3f}" + (f" ({0.0 - u['accuracy_drop']:+.3f})" if r["axis"] >= 0 else "")
    if u.get("epsilon") is not None:
        text += f", epsilon {u['epsilon']:.3g}"
    return text + f"; {r['seconds']:.0f} s"


def _baseline(points: list[dict], warnings: list[str]) -> dict[str, Any]:
    base = next(p for p in points if p["axis"] < 0)
    accs = {round(p["utility"]["baseline_accuracy"], 9) for p in points}
    if len(accs) > 1:
        warnings.append(f"the undefended model's accuracy differed between jobs ({sorted(accs)}): the utility task is "
                        "not deterministic here (threads or hardware); accuracy drops carry that noise")
    u = base["utility"]
    if u.get("majority") is not None and u["accuracy"] <= u["majority"] + 0.01:
        warnings.append(f"the undefended model does not learn the utility task (accuracy {u['accuracy']:.3f}; always "
                        f"answering the most frequent class gives {u['majority']:.3f}): accuracy drops say nothing here; "
                        "train longer, raise utility.lr or use more data")
    return {"utility": base["utility"], "verdict": base.get("verdict"), "worst": base.get("worst"),
            "leak_rate": base.get("leak_rate"), "report": base.get("report")}


def plot_metric(base: dict[str, Any]) -> tuple[str, float | None]:
    """The reconstruction metric the plot shows and its threshold: the first of the modality's that
    the base config thresholds (SSIM for images, ROUGE-1 for text by default)."""
    options = modality.of(base).plot_metrics
    for metric, field in options:
        if base["certify"].get(field) is not None:
            return metric, base["certify"][field]
    return options[0][0], None


# -- a job ------------------------------------------------------------------------------------------
_TASKS: dict[str, Any] = {}  # per process: the utility task's data and the undefended model's utility


def evaluate_point(spec: dict[str, Any]) -> dict[str, Any]:
    """One point: the red team (unless ``spec['redteam']`` is false) on the spec's validated config, and the
    utility. A plain record out."""
    from guardfl.redteam.sweep import utility as utility_mod

    torch.set_num_threads(spec["threads"])
    started = time.time()
    red = spec["redteam_config"]
    task_cfg = UtilitySection(**spec["utility"])
    cache_key = json.dumps([spec["utility"], red["model"], red["data"].get("tokenizer")], sort_keys=True)
    if cache_key not in _TASKS:
        task = utility_mod.load_task(task_cfg, red)
        utility_mod.train_once(task_cfg, red, None, task, task_cfg.seed)  # warm-up: a process's first training is slower
        _TASKS[cache_key] = (task, utility_mod.evaluate(task_cfg, red, None, task))
    task, base = _TASKS[cache_key]
    record: dict[str, Any] = {k: spec[k] for k in ("id", "key", "axis", "index", "value", "label", "defense")}
    if spec["redteam"]:
        from guardfl.redteam.certification.run import certify

        marker = Path(spec["out"]) / "sweep-point.key"  # whose red-team state the folder holds
        try:  # at most the key's length plus one byte: a stray file there (binary, huge) is simply not this key
            with open(marker, "rb") as fh:
                same = fh.read(len(spec["key"]) + 1) == spec["key"].encode()
        except OSError:
            same = False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(spec["key"])
        from guardfl.redteam.runtime.ray_backend import RayJobs, inside_ray_task

        # a point on Ray runs its jobs as tasks of the same cluster (nested; the certificate is the same); Ray
        # releases the CPU of this task while it waits for them, so a small cluster does not deadlock
        cert = certify(spec["config"], out=spec["out"], workers=1, threads=spec["threads"], strength=spec["strength"],
                       device=spec["device"], resume=spec["resume"] and same, progress=False,
                       backend=RayJobs() if inside_ray_task() else None)
        record.update(summarize(cert, spec.get("require", "certified")))
        record["report"] = str(Path("points") / spec["id"] / "report.html")
    else:
        record.update(verdict=None, certified=False, leak_rate=None, worst={})
    u = base if red.get("defense") is None else utility_mod.evaluate(task_cfg, red, red["defense"], task)
    record["utility"] = {**u, "baseline_accuracy": base["accuracy"], "accuracy_drop": base["accuracy"] - u["accuracy"],
                         "time_ratio": u["train_seconds"] / max(base["train_seconds"], 1e-9)}
    record["seconds"] = time.time() - started
    return record


def summarize(cert, require: str = "certified") -> dict[str, Any]:
    """What a sweep keeps of a certificate. ``certified``: whether the point meets the sweep's ``require``
    (the empirical verdict, the proven bound, or both); ``empirically_certified`` and ``bound`` say which."""
    rate = cert.evidence["leak_rate"]
    bound = getattr(cert, "bound", None) or {}
    proven = bound.get("status") == "PROVEN"
    accepted = {"certified": cert.certified, "proven": proven, "both": cert.certified and proven}[require]
    return {"verdict": cert.verdict, "certified": accepted, "empirically_certified": cert.certified,
            "bound": {k: bound.get(k) for k in ("status", "rero", "kappa", "mechanism", "reason")},
            "leak_rate": {**{k: rate[k] for k in ("leaked", "samples", "updates", "upper_bound", "lower_bound", "confidence",
                                                  "status")}, "max_leak_rate": rate["max_rate"]},
            "worst": {w["metric"]: w["worst"] for w in cert.worst},
            "per_attack": {a: {"leaked": v["leaked"], "of": v["of"]} for a, v in cert.evidence["per_attack"].items()},
            "failed_checks": [c["metric"] for c in cert.checks if not c["passed"]],
            "privacy": cert.privacy, "redteam_seconds": cert.wall_time_s, "strength": cert.strength}


# -- outputs ----------------------------------------------------------------------------------------
def _write(result: SweepResult, out_dir: Path) -> None:
    from guardfl.redteam.reports.sweep import chosen_yaml, plot, write_report

    data = result.to_dict()
    png = plot(result)
    atomic_write(out_dir / PLOT, png)
    if result.chosen is not None:
        atomic_write(out_dir / CHOSEN, chosen_yaml(result))
    write_report(result, png, out_dir / REPORT)
    atomic_write(out_dir / SWEEP_JSON, json.dumps(data, indent=2, default=str))  # last: the sweep finished
