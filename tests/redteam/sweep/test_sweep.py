"""``guardfl sweep`` end to end on tiny settings: the outputs, the same results on every backend and
worker count, resume, the CLI's exit codes and one-line errors, and the report in a real browser.

Each point is a real red-team run (lenet on the shipped faces, iDLG at 40 iterations, 2 faces) and a
real utility training (local_update, 1 epoch on 40 images); a sweep of 4 points takes a few seconds.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from guardfl.cli import main
from guardfl.defenses import parse_config
from guardfl.errors import ConfigError
from guardfl.redteam.runtime.ray_connection import BackendError, reachable
from guardfl.redteam.sweep.backends import open_backend
from guardfl.redteam.sweep.run import CHOSEN, PLOT, REPORT, SWEEP_JSON, sweep
from tests.browser import browser_path

BASE = {
    "model": {"name": "lenet", "state": "wide-init"},
    "data": {"source": "lfw-faces", "limit": 16},
    "client": {"batch_size": 1},
    "attacks": [{"name": "idlg", "budget": {"iterations": 40}}],
    "strength": "quick",
    "certify": {"max_updates": 2, "max_leak_rate": 0.5, "confidence": 0.6, "max_ssim": 0.4, "prior_margin": None},
}
UTILITY = {"train": 40, "test": 20, "epochs": 1, "repeats": 1, "batch_size": 8}


def config(**extra):
    cfg = {"base": BASE, "axes": [
        {"defense": {"kind": "gaussian"}, "param": "sigma", "values": [0.0001, 1.0, 0.001], "label": "noise"},
        {"defense": {"kind": "gradprune"}, "param": "ratio", "values": [0.5], "stronger": "none"},
    ], "utility": UTILITY}
    cfg.update(extra)
    return cfg


def untimed(record):
    return {k: v for k, v in record.items() if k not in ("seconds", "redteam_seconds")} | {
        "utility": {k: v for k, v in record["utility"].items() if "seconds" not in k and k != "time_ratio"}}


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    out = tmp_path_factory.mktemp("seq")
    return sweep(config(), out=out, backend="sequential", progress=False), out


def test_outputs_and_choice(sequential):
    result, out = sequential
    data = json.loads((out / SWEEP_JSON).read_text())
    assert data["grid_size"] == 4
    # the gaussian axis is bisected weak -> strong: 0.001 (index 1) first, then 1.0; gradprune ('none') fully
    noise = next(a for a in data["axes"] if a["label"] == "noise")
    assert noise["values"] == [0.0001, 0.001, 1.0]
    assert data["evaluations"] <= 3
    chosen = data["chosen"]
    assert chosen is not None and chosen["certified"]
    assert all(not p["certified"] or p["utility"]["accuracy_drop"] >= chosen["utility"]["accuracy_drop"]
               for p in data["points"] if p["axis"] >= 0)
    assert (out / PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "CHOSEN" in (out / REPORT).read_text()
    text = (out / CHOSEN).read_text()
    doc = yaml.safe_load(text)
    parsed = parse_config(doc)  # ready to use as it is
    assert parsed.kind == chosen["defense"]["kind"] and parsed.seed is None  # no sweep seed in a deployed defense
    for p in data["points"]:
        if p["axis"] >= 0:
            assert (out / p["report"]).is_file() and (out / "points" / f"{p['id']}.json").is_file()
            assert p["verdict"] in ("CERTIFIED", "NOT CERTIFIED", "INCONCLUSIVE")
    assert data["baseline"]["utility"]["time_ratio"] == 1.0


def test_processes_give_the_sequential_results(sequential, tmp_path):
    result, _ = sequential
    other = sweep(config(), out=tmp_path, backend="processes", workers=2, progress=False)
    assert [untimed(p) for p in other.points] == [untimed(p) for p in result.points]
    assert other.chosen["id"] == result.chosen["id"]


def test_ray_gives_the_sequential_results(sequential, tmp_path):
    pytest.importorskip("ray")
    result, _ = sequential
    other = sweep(config(), out=tmp_path, backend="ray", workers=2, progress=False)
    assert other.backend["backend"] == "ray"
    assert [untimed(p) for p in other.points] == [untimed(p) for p in result.points]


def test_ray_points_run_their_jobs_as_tasks_without_deadlock_on_one_cpu(sequential, tmp_path):
    """Nested on Ray (issue 36): each point's certificate runs its jobs as tasks of the same instance; one
    CPU, held by a point while it waits for them, would deadlock if Ray did not release it."""
    import signal

    pytest.importorskip("ray")
    result, _ = sequential

    def hung(*_):
        raise TimeoutError("a Ray sweep of one CPU hung: nested jobs deadlocked")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    try:
        other = sweep(config(), out=tmp_path, backend="ray", workers=1, progress=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert [untimed(p) for p in other.points] == [untimed(p) for p in result.points]
    nested = [json.loads(p.read_text())["environment"]["backend"] for p in tmp_path.glob("points/*/certificate.json")]
    assert nested and all(b["backend"] == "ray" and b["cpus"] == 1 for b in nested)


def test_resume_reuses_finished_points(sequential, tmp_path):
    first = sweep(config(), out=tmp_path, backend="sequential", progress=False)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "points").glob("*.json")}
    lines = []
    again = sweep(config(), out=tmp_path, backend="sequential", resume=True, say=lines.append)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "points").glob("*.json")} == stamps
    assert sum("reused" in line for line in lines) == len(stamps)
    assert [untimed(p) for p in again.points] == [untimed(p) for p in first.points]
    # another sweep seed: every defended point is new (the undefended baseline does not depend on it)
    lines = []
    sweep(config(seed=7), out=tmp_path, backend="sequential", resume=True, say=lines.append)
    assert [line for line in lines if "reused" in line] == [next(line for line in lines if "no defense" in line)]


def test_full_grid_without_autotune(tmp_path):
    result = sweep(config(autotune=False), out=tmp_path, backend="sequential", progress=False)
    assert sum(1 for p in result.points if p["axis"] >= 0) == 4


def test_cli_exit_codes(tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config()))
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "o"), "--backend", "sequential", "--quiet"]) == 0
    assert "CHOSEN" in capsys.readouterr().out
    weak = config(axes=[{"defense": {"kind": "gaussian"}, "param": "sigma", "values": [0.0001]}])
    path.write_text(yaml.safe_dump(weak))
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "w"), "--backend", "sequential", "--quiet"]) == 1
    assert "NO SETTING CERTIFIED" in capsys.readouterr().out


@pytest.mark.parametrize("axes, needle", [
    ([{"defense": {"kind": "gradprune"}, "param": "ratio", "values": [0.5, 1.0]}], "gradprune.ratio"),
    ([{"defense": {"kind": "gaussian"}, "param": "sigma", "values": [-1.0]}], "gaussian.sigma"),
])
def test_cli_one_line_errors(tmp_path, capsys, axes, needle):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config(axes=axes)))
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "o"), "--backend", "sequential"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sweep.axes.0" in err and needle in err and "allowed" in err


def test_bad_base_is_one_line(tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config(base={**BASE, "model": {"name": "nope"}})))
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sweep.base:") and "model.name" in err and "\n" not in err


def test_unreachable_ray_address(tmp_path, capsys):
    assert reachable("127.0.0.1:1", timeout=2) is not None
    with pytest.raises(BackendError, match=r"--ray-address: cannot reach the Ray cluster at 127\.0\.0\.1:1.*--fallback-local"):
        open_backend("auto", 2, "127.0.0.1:1")
    warned = []
    backend = open_backend("auto", 1, "127.0.0.1:1", fallback=True, warn=warned.append)
    assert backend.name == "sequential" and "unreachable" in warned[0]
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config()))
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "o"), "--ray-address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--ray-address" in err
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "o"), "--ray-address", "127.0.0.1:1",
                 "--fallback-local", "--workers", "1", "--quiet"]) == 0
    assert "unreachable" in capsys.readouterr().out


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="workers: expected an integer >= 1"):
        sweep(config(), out=tmp_path, workers=0)
    with pytest.raises(BackendError, match="backend: unknown"):
        open_backend("gpu", 1)
    with pytest.raises(BackendError, match="given with backend 'processes'"):
        open_backend("processes", 1, "host:1")


@pytest.mark.browser
@pytest.mark.skipif(browser_path() is None, reason="no Chromium to load the report in")
def test_report_in_a_browser(tmp_path):
    """The sweep's page is self-contained, loads without errors, shows its banner, and a label with
    markup is text."""
    from tests.browser import inspect_page

    label = "<img src=x onerror=alert(1)> noise"
    cfg = config(axes=[{"defense": {"kind": "gaussian"}, "param": "sigma", "values": [0.0001, 1.0], "label": label}])
    sweep(cfg, out=tmp_path, backend="sequential", progress=False)
    shot = os.environ.get("GUARDFL_SWEEP_SCREENSHOT") or tmp_path / "sweep.png"
    page = inspect_page(tmp_path / REPORT, screenshot=shot)
    assert page.errors == []
    assert page.images and all(i["src_kind"] == "data" and i["complete"] and i["natural_width"] > 0 for i in page.images)
    assert page.banner_visible and page.banner_text.startswith("CHOSEN")
    assert label in page.text
    assert page.active_content == []


def test_sequential_runs_a_job_when_its_result_is_asked():
    """So that each point is saved (and shown) before the next one starts: an interrupted sequential
    sweep keeps what it finished."""
    calls = []
    backend = open_backend("sequential", 1)
    backend.submit("a", calls.append, 1)
    backend.submit("b", calls.append, 2)
    assert calls == []
    assert backend.next_done() == ("a", None) and calls == [1]
    assert backend.next_done() == ("b", None) and calls == [1, 2]


def test_a_text_sweep(tmp_path):
    """A text client: TAG's ROUGE-1 is the plotted metric, and the utility is a classifier's held-out
    accuracy on the built-in labelled sentences."""
    cfg = {
        "base": {"model": {"name": "text-classifier", "num_classes": 2},
                 "data": {"source": "labelled-text", "seq_len": 8, "limit": 200},
                 "attacks": [{"name": "tag", "budget": {"iterations": 10}}], "strength": "quick",
                 "certify": {"max_updates": 1, "max_leak_rate": 0.5, "confidence": 0.5}},
        "axes": [{"defense": {"kind": "gaussian"}, "param": "sigma", "values": [0.0001, 1.0]}],
        "utility": {"source": "labelled-text", "train": 40, "test": 20, "epochs": 1, "repeats": 1, "batch_size": 8},
    }
    result = sweep(cfg, out=tmp_path, backend="sequential", progress=False)
    assert result.metric == ("rouge1", 0.5)
    points = [p for p in result.points if p["axis"] == 0]
    assert points and all("rouge1" in p["worst"] for p in points)
    assert 0 <= result.baseline["utility"]["accuracy"] <= 1
    assert (tmp_path / PLOT).is_file()


def test_utility_of_another_modality_is_refused():
    cfg = config(utility={**UTILITY, "source": "labelled-text"})
    with pytest.raises(ConfigError, match=r"^sweep\.utility\.source: 'labelled-text' is text but the base's data"):
        from guardfl.redteam.sweep.config import load_sweep

        load_sweep(cfg)


def test_a_utility_task_that_does_not_learn_is_flagged():
    from guardfl.redteam.sweep.run import _baseline

    point = {"axis": -1, "index": 0, "utility": {"accuracy": 0.5, "baseline_accuracy": 0.5, "majority": 0.52}}
    warnings = []
    _baseline([point], warnings)
    assert len(warnings) == 1 and "does not learn the utility task" in warnings[0]
    warnings = []
    _baseline([{**point, "utility": {**point["utility"], "accuracy": 0.9, "baseline_accuracy": 0.9}}], warnings)
    assert warnings == []


def test_majority_floor():
    import torch

    from guardfl.redteam.sweep.utility import majority

    assert majority(torch.tensor([1, 1, 0, 2])) == 0.5
    assert majority(torch.tensor([[3, -100], [3, 4]])) == 2 / 3
