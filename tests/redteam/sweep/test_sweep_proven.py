"""The sweep's ``require``: a point is chosen for its empirical verdict, its proven bound, or both."""

from types import SimpleNamespace

import pytest

from guardfl.errors import ConfigError
from guardfl.redteam.sweep.config import load_sweep
from guardfl.redteam.sweep.run import point_spec, summarize

BASE = {"model": {"name": "lenet", "num_classes": 10}, "data": {"source": "lfw-faces", "limit": 64},
        "attacks": ["idlg"], "strength": "quick", "certify": {"max_updates": 2}}
AXIS = {"defense": {"kind": "dpsgd", "max_grad_norm": 1.0}, "param": "noise_multiplier", "values": [0.5, 2.0]}


def _cert(certified: bool, bound: str):
    rate = {"leaked": 0, "samples": 2, "updates": 2, "upper_bound": 0.7, "lower_bound": 0.0, "max_rate": 0.05,
            "confidence": 0.95, "status": "x"}
    return SimpleNamespace(verdict="CERTIFIED" if certified else "NOT CERTIFIED", certified=certified,
                           evidence={"leak_rate": rate, "per_attack": {}}, worst=[], checks=[], privacy=None,
                           wall_time_s=1.0, strength="quick", bound={"status": bound, "rero": 0.01, "kappa": 0.001})


@pytest.mark.parametrize("require, certified, bound, accepted", [
    ("certified", True, "NOT PROVEN", True), ("proven", True, "NOT PROVEN", False), ("proven", False, "PROVEN", True),
    ("both", True, "PROVEN", True), ("both", False, "PROVEN", False),
])
def test_the_requirement_decides_the_point(require, certified, bound, accepted):
    out = summarize(_cert(certified, bound), require)
    assert out["certified"] is accepted and out["empirically_certified"] is certified and out["bound"]["status"] == bound


def test_require_is_in_the_points_key_and_refused_when_unknown(tmp_path):
    plain = load_sweep({"base": BASE, "axes": [AXIS]})
    proven = load_sweep({"base": BASE, "axes": [AXIS], "require": "proven"})
    assert plain.config.require == "certified"
    a = point_spec(plain, plain.axes[0][0], tmp_path, False, None, None, 1)
    b = point_spec(proven, proven.axes[0][0], tmp_path, False, None, None, 1)
    assert b["require"] == "proven" and a["key"] != b["key"]
    with pytest.raises(ConfigError) as info:
        load_sweep({"base": BASE, "axes": [AXIS], "require": "theorem"})
    assert "require" in str(info.value) and "'proven'" in str(info.value)
