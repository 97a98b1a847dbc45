"""bench/compare_certificates.py: which configs it skips and why, and its diff of two output folders
(running certificates is the script's own job: too slow for a test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_certificates", ROOT / "bench" / "compare_certificates.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)


def test_configs_that_cannot_run_here_are_skipped_with_the_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sweep config" in cc.skip_reason(ROOT / "configs" / "sweep-default.yaml")
    assert cc.skip_reason(ROOT / "configs" / "papers" / "huang2021-gradprune-0.9-b16.yaml") == "needs a GPU (device: cuda); none here"
    assert cc.skip_reason(ROOT / "configs" / "no-defense.yaml") is None


def test_the_defense_seed_is_pinned_only_where_the_config_leaves_it_unset(tmp_path):
    assert cc.pinned(ROOT / "configs" / "default.yaml", 0).defense["seed"] == 0
    assert cc.pinned(ROOT / "configs" / "no-defense.yaml", 0).defense is None
    seeded = tmp_path / "seeded.yaml"
    seeded.write_text((ROOT / "configs" / "default.yaml").read_text().replace("kind: outpost", "kind: outpost\n  seed: 5"))
    assert cc.pinned(seeded, 0).defense["seed"] == 5


def test_diff_names_each_differing_value_by_its_path():
    a = {"verdict": "CERTIFIED", "results": [{"ssim": 0.1}, {"ssim": 0.2}], "x": 1}
    b = {"verdict": "NOT CERTIFIED", "results": [{"ssim": 0.1}, {"ssim": 0.3}, {"ssim": 0.4}], "y": 2}
    assert cc.diff(a, b) == ['results: 2 items != 3 items', 'results[1].ssim: 0.2 != 0.3', 'verdict: "CERTIFIED" != "NOT CERTIFIED"',
                             'x: only in A (1)', 'y: only in B (2)']
    assert cc.diff(a, json.loads(json.dumps(a))) == []


def _folder(path: Path, certs: dict[str, dict], skipped: dict[str, str] = {}) -> Path:
    path.mkdir()
    entries = [{"config": n, "status": "ran", "verdict": c["verdict"]} for n, c in certs.items()]
    entries += [{"config": n, "status": "skipped", "reason": r} for n, r in skipped.items()]
    for name, cert in certs.items():
        (path / f"{name}.json").write_text(json.dumps(cert))
    (path / cc.INDEX).write_text(json.dumps({"settings": {"samples": 2, "seed": 0, "workers": 1}, "configs": entries}))
    return path


def test_compare_exits_0_for_identical_folders_and_1_with_a_per_config_diff(tmp_path, capsys):
    cert = {"verdict": "NOT CERTIFIED", "checks": [{"worst": 0.9}]}
    a = _folder(tmp_path / "a", {"default": cert, "no-defense": cert}, {"sweep-default": "a sweep config"})
    b = _folder(tmp_path / "b", {"default": cert, "no-defense": cert}, {"sweep-default": "a sweep config"})
    assert cc.main(["--compare", str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "identical"
    c = _folder(tmp_path / "c", {"default": cert, "no-defense": {**cert, "checks": [{"worst": 0.8}]}})
    assert cc.main(["--compare", str(a), str(c)]) == 1
    out = capsys.readouterr().out
    assert "DIFF  no-defense: 1 value(s)" in out and "checks[0].worst: 0.9 != 0.8" in out and "  same  default" in out
    assert "DIFF  sweep-default" in out and out.splitlines()[-1] == "2 config(s) differ"
    assert cc.main(["--compare", str(a), str(c), "configs/default.yaml"]) == 0  # only the configs named


def test_compare_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert cc.main(["--compare", str(tmp_path / "x"), str(tmp_path / "x")]) == 2
    assert "has no index.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cc.main([])  # neither --out nor --compare
