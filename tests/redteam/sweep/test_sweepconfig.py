"""The sweep config (``guardfl.redteam.sweep.config``, issue 17): parsed once, at the edge. Points come
ordered weak -> strong, every point's defense and red-team config is validated at load time, bad input
is one line naming the field and the allowed range (or the reason), and each point's defense is seeded
from the sweep's seed only."""

import copy

import pytest
import yaml

from guardfl.errors import ConfigError
from guardfl.redteam.config import load_config
from guardfl.redteam.sweep.config import STRONGER, deep_merge, load_sweep, point_seed, set_path

BASE = {"model": {"name": "lenet", "num_classes": 10}, "data": {"source": "lfw-faces", "limit": 64},
        "attacks": ["idlg"], "strength": "quick", "certify": {"max_updates": 2}}
GRADPRUNE = {"defense": {"kind": "gradprune"}, "param": "ratio", "values": [0.9, 0.5, 0.99, 0.7]}
DPSGD_NORM = {"defense": {"kind": "dpsgd", "noise_multiplier": 1.0}, "param": "max_grad_norm", "values": [0.5, 2.0, 1.0]}
STACK = {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.9}, {"kind": "gaussian", "sigma": 0.0}]}


def sweep(**kw):
    cfg = {"base": copy.deepcopy(BASE), "axes": [copy.deepcopy(GRADPRUNE)]}
    cfg.update(kw)
    return cfg


def refused(cfg) -> str:
    with pytest.raises(ConfigError) as info:
        load_sweep(cfg)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def values(plan, axis=0):
    return [p.value for p in plan.axes[axis]]


# --- a valid sweep ---------------------------------------------------------------------------------

def test_a_sweep_from_a_mapping():
    plan = load_sweep(sweep(axes=[GRADPRUNE, DPSGD_NORM]))
    assert plan.source is None
    assert plan.directions == ["higher", "lower"]
    assert plan.config.autotune is True and plan.config.utility.source == "lfw-detection"
    assert plan.base["model"]["name"] == "lenet" and plan.base["defense"] is None
    assert plan.baseline.axis == -1 and plan.baseline.id == "baseline" and plan.baseline.defense is None
    assert plan.baseline.redteam.defense is None and plan.baseline.redteam.model_dump(mode="json") == plan.base
    for a, axis in enumerate(plan.axes):
        assert [p.axis for p in axis] == [a] * len(axis)
        assert [p.index for p in axis] == list(range(len(axis)))
        assert [p.id for p in axis] == [f"a{a}-v{i}" for i in range(len(axis))]
        for p in axis:
            red = p.redteam.model_dump(mode="json")
            assert load_config(red) == p.redteam  # each point's red-team config, validated once, reloads as is
            assert p.redteam.defense["kind"] == p.defense["kind"]
            assert {k: v for k, v in red.items() if k != "defense"} == {k: v for k, v in plan.base.items() if k != "defense"}
    assert [p.defense["ratio"] for p in plan.axes[0]] == [0.5, 0.7, 0.9, 0.99]
    assert [p.defense["max_grad_norm"] for p in plan.axes[1]] == [2.0, 1.0, 0.5]
    assert all(p.defense["noise_multiplier"] == 1.0 for p in plan.axes[1])


def test_a_sweep_file_whose_base_is_relative_to_it(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "red.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "sweeps").mkdir()
    path = tmp_path / "sweeps" / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "../configs/red.yaml", "override": {"certify": {"max_updates": 3}},
                                    "axes": [GRADPRUNE]}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # resolved against the sweep file's folder, not the working directory
    plan = load_sweep(path)
    assert plan.source == str(path)
    assert plan.base["certify"]["max_updates"] == 3
    assert plan.base["data"]["limit"] == 64 and plan.base["model"]["name"] == "lenet"
    assert values(plan) == [0.5, 0.7, 0.9, 0.99]
    assert plan.digest == load_sweep(sweep(override={"certify": {"max_updates": 3}})).digest


def test_override_deep_merges():
    plan = load_sweep(sweep(override={"certify": {"max_updates": 4}, "data": {"limit": 32}, "attacks": ["dlg"]}))
    assert plan.base["certify"]["max_updates"] == 4
    assert plan.base["certify"]["max_ssim"] == 0.4            # the rest of the section is kept
    assert plan.base["data"] == {**plan.base["data"], "source": "lfw-faces", "limit": 32}
    assert [a["name"] for a in plan.base["attacks"]] == ["dlg"]  # a list replaces
    assert all(p.redteam.certify.max_updates == 4 for p in plan.axes[0])


def test_deep_merge_and_set_path_copy():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    merged = deep_merge(base, {"a": {"b": 2}, "e": {"f": 1}})
    assert merged == {"a": {"b": 2, "c": [1, 2]}, "d": 1, "e": {"f": 1}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    stack = set_path(STACK, "defenses.1.sigma", 0.5, "w")
    assert stack["defenses"][1]["sigma"] == 0.5 and STACK["defenses"][1]["sigma"] == 0.0


# --- ordering and grids ----------------------------------------------------------------------------

def test_points_are_ordered_weak_to_strong():
    plan = load_sweep(sweep(axes=[GRADPRUNE, DPSGD_NORM]))
    assert values(plan, 0) == [0.5, 0.7, 0.9, 0.99]   # higher ratio: stronger
    assert values(plan, 1) == [2.0, 1.0, 0.5]         # lower max_grad_norm: stronger
    assert STRONGER[("dpsgd", "max_grad_norm")] == "lower"


def test_stronger_none_keeps_the_grid_order():
    plan = load_sweep(sweep(axes=[{**GRADPRUNE, "stronger": "none"}]))
    assert plan.directions == ["none"] and values(plan) == [0.9, 0.5, 0.99, 0.7]
    explicit = load_sweep(sweep(axes=[{**GRADPRUNE, "stronger": "lower"}]))
    assert explicit.directions == ["lower"] and values(explicit) == [0.99, 0.9, 0.7, 0.5]


def test_a_parameter_not_in_the_table_is_not_monotone():
    axis = {"defense": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}, "param": "delta",
            "values": [1e-5, 1e-7, 1e-6]}
    plan = load_sweep(sweep(axes=[axis]))
    assert plan.directions == ["none"] and values(plan) == [1e-5, 1e-7, 1e-6]


def test_linear_and_log_ranges():
    plan = load_sweep(sweep(axes=[
        {"defense": {"kind": "gradprune"}, "param": "ratio", "range": {"start": 0.5, "stop": 0.9, "num": 5}},
        {"defense": {"kind": "gaussian"}, "param": "sigma", "range": {"start": 0.001, "stop": 1.0, "num": 4, "scale": "log"}},
        {"defense": {"kind": "gradprune"}, "param": "ratio", "range": {"start": 0.9, "stop": 0.5, "num": 3}},
    ]))
    assert values(plan, 0) == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    assert values(plan, 1) == pytest.approx([0.001, 0.01, 0.1, 1.0])
    assert values(plan, 2) == pytest.approx([0.5, 0.7, 0.9])  # given strong -> weak, ordered weak -> strong


# --- bad input: one line naming the field and the allowed range or the reason ------------------------

def test_an_axis_value_outside_the_defense_range_gets_the_defense_error():
    msg = refused(sweep(axes=[{**GRADPRUNE, "values": [0.5, 1.0]}]))
    assert msg.startswith("sweep.axes.0 (ratio = 1.0): ")
    assert "gradprune.ratio" in msg and "allowed: (0, 1)" in msg
    msg = refused(sweep(axes=[GRADPRUNE, {**DPSGD_NORM, "values": [1.0, -1.0]}]))
    assert msg.startswith("sweep.axes.1 (max_grad_norm = -1.0): ") and "max_grad_norm" in msg and "allowed" in msg


@pytest.mark.parametrize("grid", [
    {"values": [0.5], "range": {"start": 0.1, "stop": 0.9, "num": 3}},
    {},
])
def test_exactly_one_of_values_and_range(grid):
    axis = {"defense": {"kind": "gradprune"}, "param": "ratio", **grid}
    msg = refused(sweep(axes=[axis]))
    assert "sweep.axes" in msg and "exactly one of values" in msg and "range" in msg


@pytest.mark.parametrize("start", [0, -1])
def test_a_log_range_needs_positive_bounds(start):
    axis = {"defense": {"kind": "gaussian"}, "param": "sigma", "range": {"start": start, "stop": 1.0, "num": 3, "scale": "log"}}
    msg = refused(sweep(axes=[axis]))
    assert "sweep.axes.0.range" in msg and "start and stop > 0" in msg


def test_range_bounds():
    axis = {"defense": {"kind": "gaussian"}, "param": "sigma", "range": {"start": 0.1, "stop": 1.0, "num": 1}}
    msg = refused(sweep(axes=[axis]))
    assert "range.num" in msg and "[2, 200]" in msg


def test_repeated_values():
    msg = refused(sweep(axes=[{**GRADPRUNE, "values": [0.5, 0.9, 0.5]}]))
    assert msg.startswith("sweep.axes.0.values: ") and "repeated" in msg


def test_a_range_that_repeats_names_the_range():
    axis = {"defense": {"kind": "gaussian"}, "param": "sigma", "range": {"start": 0.1, "stop": 0.1000001, "num": 3}}
    msg = refused(sweep(axes=[axis]))
    assert "sweep.axes.0.range" in msg and "repeated" in msg


@pytest.mark.parametrize("param, expect", [
    ("defenses.5.sigma", "a list of 2; expected an index in [0, 1]"),
    ("defenses.x.sigma", "expected an index in [0, 1]"),
    ("members.1.sigma", "the template has no 'members'"),
    ("defenses.1.sigma.x", "is a value, not a mapping or list"),
])
def test_a_param_path_that_does_not_exist_in_a_stack(param, expect):
    msg = refused(sweep(axes=[{"defense": STACK, "param": param, "values": [0.1]}]))
    assert msg.startswith("sweep.axes.0.param: ") and repr(param) in msg and expect in msg


@pytest.mark.parametrize("change, field", [
    ({"model": {"name": "lenet", "num_classes": 1}}, "model.num_classes"),
    ({"attacks": ["nosuch"]}, "attacks.0.name"),
    ({"certify": {"max_updates": 0}}, "certify.max_updates"),
    ({"bogus": 1}, "bogus"),
])
def test_a_base_that_does_not_validate(change, field):
    msg = refused(sweep(base={**BASE, **change}))
    assert msg.startswith("sweep.base: ") and field in msg and ("allowed" in msg or "unknown" in msg)


def test_a_base_with_an_unknown_model_is_refused_at_load():
    msg = refused(sweep(base={**BASE, "model": {"name": "nosuchmodel", "num_classes": 10}}))
    assert msg.startswith("sweep.base: ") and "model.name" in msg


def test_an_override_that_breaks_the_base():
    msg = refused(sweep(override={"certify": {"max_updates": 0}}))
    assert msg.startswith("sweep.base: ") and "certify.max_updates" in msg and "[1, 100000]" in msg


def test_a_missing_base_file(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "missing.yaml", "axes": [GRADPRUNE]}))
    msg = refused(path)
    assert msg.startswith("sweep.base: ") and "not found" in msg and str(tmp_path / "missing.yaml") in msg


def test_a_missing_sweep_file(tmp_path):
    msg = refused(tmp_path / "nope.yaml")
    assert "sweep config not found" in msg


def test_a_base_with_a_target_section():
    base = {**BASE, "target": {"train_fn": "mymod:train"}, "client": {"protocol": "fedavg"}}
    msg = refused(sweep(base=base))
    assert msg.startswith("sweep.base: ") and "target" in msg and "cannot be swept" in msg


@pytest.mark.parametrize("cfg, field", [
    (sweep(bogus=1), "sweep.bogus"),
    (sweep(axes=[{**GRADPRUNE, "bogus": 1}]), "sweep.axes.0.bogus"),
    (sweep(utility={"bogus": 1}), "sweep.utility.bogus"),
])
def test_unknown_keys(cfg, field):
    msg = refused(cfg)
    assert msg.startswith(field) and "unknown key" in msg and "allowed" in msg


@pytest.mark.parametrize("source", ["lfw-faces", "lfw-nonfaces"])
def test_utility_source_with_synthetic_labels_is_refused(source):
    msg = refused(sweep(utility={"source": source}))
    assert msg.startswith("sweep.utility.source: ") and "synthetic labels" in msg and "lfw-detection" in msg


def test_an_unknown_utility_source():
    msg = refused(sweep(utility={"source": "imagenet"}))
    assert msg.startswith("sweep.utility.source: ") and "'imagenet'" in msg and "allowed: lfw-detection" in msg


@pytest.mark.parametrize("cfg, field, allowed", [
    (sweep(axes=[]), "sweep.axes", "1 to 32 axes"),
    (sweep(seed=-1), "sweep.seed", "[0, 2**32 - 1]"),
    (sweep(utility={"train": 0}), "sweep.utility.train", "[1, 10000000]"),
    (sweep(axes=[{**GRADPRUNE, "stronger": "up"}]), "sweep.axes.0.stronger", "'none'"),
])
def test_out_of_range_fields(cfg, field, allowed):
    msg = refused(cfg)
    assert msg.startswith(field) and allowed in msg


# --- stacks ------------------------------------------------------------------------------------------

def test_a_stack_member_parameter():
    plan = load_sweep(sweep(axes=[{"defense": STACK, "param": "defenses.1.sigma", "values": [0.1, 0.001, 0.01]}]))
    assert plan.directions == ["higher"]  # the member's entry in the table: gaussian.sigma
    assert values(plan) == [0.001, 0.01, 0.1]
    for p in plan.axes[0]:
        assert p.defense["kind"] == "stack" and p.defense["defenses"][1]["sigma"] == p.value
        assert p.defense["defenses"][0]["ratio"] == 0.9
        assert p.redteam.defense is not None


# --- seeds -------------------------------------------------------------------------------------------

def test_each_point_is_seeded_from_the_sweep_seed_only():
    plan = load_sweep(sweep(axes=[GRADPRUNE, DPSGD_NORM], seed=7))
    seeds = [p.redteam.defense["seed"] for axis in plan.axes for p in axis]
    assert seeds == [point_seed(7, p.axis, p.index) for axis in plan.axes for p in axis]
    assert len(set(seeds)) == len(seeds)
    again = load_sweep(sweep(axes=[GRADPRUNE, DPSGD_NORM], seed=7))
    assert [p.redteam.defense["seed"] for axis in again.axes for p in axis] == seeds
    other = load_sweep(sweep(axes=[GRADPRUNE, DPSGD_NORM], seed=8))
    assert all(a != b for a, b in zip(seeds, [p.redteam.defense["seed"] for axis in other.axes for p in axis]))
    for axis in plan.axes:
        for p in axis:
            assert "seed" not in p.defense  # the deployed defense draws from OS entropy


def test_a_template_seed_is_kept():
    plan = load_sweep(sweep(axes=[{**GRADPRUNE, "defense": {"kind": "gradprune", "seed": 11}}]))
    for p in plan.axes[0]:
        assert p.redteam.defense["seed"] == 11 and p.defense["seed"] == 11


def test_point_seed():
    assert point_seed(0, 0, 0) == point_seed(0, 0, 0)
    assert len({point_seed(s, a, i) for s in range(3) for a in range(3) for i in range(3)}) == 27
    assert all(0 <= point_seed(s, 1, 2) < 2**32 for s in (0, 2**32 - 1))


# --- digest ------------------------------------------------------------------------------------------

def test_digest():
    digest = load_sweep(sweep()).digest
    assert load_sweep(sweep()).digest == digest
    assert load_sweep(sweep(axes=[{**GRADPRUNE, "values": [0.9, 0.5, 0.99, 0.8]}])).digest != digest
    assert load_sweep(sweep(base={**BASE, "certify": {"max_updates": 3}})).digest != digest
    assert load_sweep(sweep(override={"data": {"limit": 32}})).digest != digest
    assert load_sweep(sweep(seed=1)).digest != digest


def test_the_shipped_sweep_loads():
    from pathlib import Path

    plan = load_sweep(Path(__file__).parents[3] / "configs" / "sweep-default.yaml")
    assert plan.directions == ["higher", "higher"] and [len(a) for a in plan.axes] == [3, 3]
    assert values(plan, 1) == pytest.approx(sorted(values(plan, 1)))
    assert plan.config.utility.source == "lfw-detection" and plan.base["model"]["name"] == "fc2"
