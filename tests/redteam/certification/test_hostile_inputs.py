"""Hostile inputs of issue 33 beyond the red-team configs of ``hostile/`` (those run through
``test_hostile_configs``): claims no attack tested (malicious server, threat fields an attack never
reads), and unbounded inputs on the sweep, text, malicious-server and CLI surfaces. Each is refused with
one line naming the field and its allowed range, before any work, and fast."""

from __future__ import annotations

import json
import os
import time

import pytest
import yaml

from guardfl.cli import main
from guardfl.errors import ConfigError
from guardfl.redteam.config import load_config

TINY = {"model": {"name": "lenet"}, "data": {"source": "lfw-faces", "limit": 4}, "certify": {"max_updates": 1}}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------ claims (item 4)
@pytest.mark.parametrize("attacks, needle", [
    ([{"name": "idlg", "threat": {"server": "malicious"}}], "threat.server: 'malicious', but idlg is an honest-server attack"),
    ([{"name": "fishing", "threat": {"server": "malicious", "labels": "known"}},
      {"name": "inverting_gradients", "threat": {"server": "malicious"}}], "attacks[1] inverting_gradients: threat.server"),
    ([{"name": "fishing", "threat": {"server": "malicious", "labels": "known", "bn": "exact"}}], "fishing never reads threat.bn"),
    ([{"name": "robbing_the_fed", "threat": {"server": "malicious", "fedavg": "unknown"}}],
     "robbing_the_fed never reads threat.fedavg"),
    ([{"name": "trap_weights", "threat": {"server": "malicious", "bn": "exact"}}],
     "trap_weights never reads threat.bn"),
    ([{"name": "cocktail_party", "threat": {"fedavg": "unknown"}}], "cocktail_party never reads threat.fedavg"),
    ([{"name": "gradinversion", "budget": {"bn": 0.5}, "threat": {"bn": "proxy"}}], "budget.bn: 0.5 weighs a BatchNorm prior"),
    ([{"name": "fishing", "budget": {"strategy": "class", "alpha": 10.0}, "threat": {"server": "malicious", "labels": "known"}}],
     "alpha: 10.0 is a feature-fishing option"),
])
def test_a_threat_no_attack_tests_is_refused(attacks, needle):
    cfg = {**TINY, "client": {"protocol": "fedavg"}, "attacks": attacks}
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


def test_the_message_names_the_attacks_that_back_a_threat():
    with pytest.raises(ConfigError, match=r"attacks that back it: fishing, robbing_the_fed"):
        load_config({**TINY, "attacks": [{"name": "inverting_gradients", "threat": {"server": "malicious"}}]})


def test_tested_threats_and_defaults_are_accepted_and_round_trip():
    cfg = load_config({**TINY, "attacks": [
        {"name": "robbing_the_fed", "threat": {"server": "malicious", "labels": "known", "bn": "none"}},
        {"name": "fishing", "budget": {"strategy": "feature", "feature": 3}, "threat": {"server": "malicious", "labels": "known"}},
        {"name": "inverting_gradients", "threat": {"labels": "known"}}]})
    assert load_config(cfg.model_dump(mode="json")) == cfg  # every field explicit at its default: still valid


def test_attacks_all_records_unread_threat_fields_at_their_defaults():
    """The strongest threat grants bn exact on a BatchNorm model; an attack that never reads it is
    listed (and recorded) with bn: none, what it was run with."""
    from guardfl.redteam.attacks import Setting
    from guardfl.redteam.certification.plan import plan_attacks
    from guardfl.redteam.client.simulate import FedSGD
    from guardfl.redteam.modality.image.models import build_model

    cfg = load_config({**TINY, "model": {"name": "resnet20"}, "attacks": "all"})
    model = build_model("resnet20", (3, 32, 32), 10)
    setting = Setting(model, FedSGD(), 1, (3, 32, 32), 10, (0.0, 1.0), None)
    _, listing = plan_attacks(cfg, setting, "quick", None)
    threats = {line["attack"]: line.get("threat") for line in listing}
    assert threats["inverting_gradients"]["bn"] == "exact"
    assert threats["cocktail_party"]["bn"] == "none" and threats["learned_inversion"]["bn"] == "none"


# ----------------------------------------------------------------------- malicious server (item 5)
@pytest.mark.parametrize("shape, samples, bins, refused", [
    ((3, 1024, 1024), 64, None, True),   # the case: 256 bins x 3M inputs, 36 GiB
    ((1, 1024, 1024), 1, None, False),   # 4 bins: ~0.2 GiB
    ((3, 32, 32), 64, None, False),      # the shipped malicious-rtf.yaml's size
    ((3, 32, 32), 64, 65536, True),      # the most bins: 3072 x 65536 x 48 B = 9.0 GiB, past 8 GiB
])
def test_robbing_the_fed_memory_estimate(shape, samples, bins, refused):
    from guardfl.redteam.attacks import RobbingTheFed, Setting
    from guardfl.redteam.attacks.malicious.robbing_the_fed import memory_bound, memory_estimate
    from guardfl.redteam.client.simulate import FedSGD

    setting = Setting(None, FedSGD(), samples, shape, 10, (0.0, 1.0), None)
    attack = RobbingTheFed(**({"bins": bins} if bins else {}))
    why = attack.refuses(setting)
    need = memory_estimate(shape, bins or 4 * samples)
    assert (why is not None) == (need > memory_bound())
    if refused:
        assert why is not None and "GiB" in why and "past the bound" in why


# ------------------------------------------------------------------------------------ sweep (item 5)
def _sweep_config(axes: int, values: int, **extra) -> dict:
    from tests.redteam.sweep.test_sweep import BASE

    grid = [round(0.1 + 0.8 * i / values, 6) for i in range(values)]
    return {"base": BASE, "axes": [{"defense": {"kind": "gradprune"}, "param": "ratio", "values": grid}] * axes, **extra}


def test_a_huge_sweep_grid_is_refused_before_any_point_is_validated(tmp_path, capsys):
    from guardfl.redteam.sweep.config import DEFAULT_MAX_POINTS, load_sweep

    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"axes: 6400 settings on 32 axes .*at most max_points = {DEFAULT_MAX_POINTS}"):
        load_sweep(_sweep_config(32, 200))
    assert time.perf_counter() - t0 < 2
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(_sweep_config(32, 200)))
    assert main(["sweep", "--config", str(path), "--out", str(tmp_path / "o"), "--backend", "sequential"]) == 2
    assert "max_points" in _one_line(capsys)
    with pytest.raises(ConfigError, match=r"max_points.*2000"):
        load_sweep(_sweep_config(1, 2, max_points=10_000))
    assert len(load_sweep(_sweep_config(2, 3, max_points=6)).axes) == 2  # raised explicitly: accepted


@pytest.mark.parametrize("content, why", [
    ("[1, 2, 3]", "a JSON list, not a point record"),
    ('"hello"', "a JSON str"),
    ('{"key": "KEY"}', "a point record without id"),
    ("{not json", "unreadable (JSONDecodeError"),
    (b"\xff\xfe\x00", "unreadable (UnicodeDecodeError"),
])
def test_a_foreign_file_in_points_is_ignored_with_a_warning(tmp_path, content, why):
    from guardfl.redteam.sweep.run import _saved

    (tmp_path / "points").mkdir()
    path = tmp_path / "points" / "a0-v1.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    warned: list[str] = []
    assert _saved(tmp_path, {"id": "a0-v1", "key": "KEY"}, warned.append) is None
    assert len(warned) == 1 and str(path) in warned[0] and why in warned[0] and "evaluated again" in warned[0], warned


def test_a_point_record_of_another_setting_is_reevaluated_silently(tmp_path):
    from guardfl.redteam.sweep.run import _saved

    (tmp_path / "points").mkdir()
    (tmp_path / "points" / "a0-v1.json").write_text(json.dumps({"id": "a0-v1", "key": "OLD"}))
    warned: list[str] = []
    assert _saved(tmp_path, {"id": "a0-v1", "key": "NEW"}, warned.append) is None and not warned


def test_a_huge_point_file_is_not_read(tmp_path):
    from guardfl.redteam.sweep.run import MAX_POINT_BYTES, _saved

    (tmp_path / "points").mkdir()
    path = tmp_path / "points" / "a0-v1.json"
    with open(path, "wb") as fh:
        fh.truncate(MAX_POINT_BYTES + 1)  # sparse
    warned: list[str] = []
    assert _saved(tmp_path, {"id": "a0-v1", "key": "KEY"}, warned.append) is None
    assert "bytes (a point record is at most" in warned[0]


# ------------------------------------------------------------------------------------- text (item 5)
@pytest.fixture
def huge_text(tmp_path):
    path = tmp_path / "huge.txt"
    with open(path, "wb") as fh:
        fh.truncate(8 << 30)  # 8 GiB, sparse: nothing is written
    return path


@pytest.mark.parametrize("section", ["data", "aux"])
def test_a_huge_text_file_is_refused_from_its_size(huge_text, section):
    from guardfl.redteam.modality.text.data import MAX_TEXT_BYTES

    cfg = {"model": {"name": "transformer3"}, "data": {"source": "text"}, "attacks": ["tag"], "certify": {"max_updates": 1}}
    if section == "aux":
        cfg["aux"] = {"source": "text", "path": str(huge_text)}
    else:
        cfg["data"]["path"] = str(huge_text)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"{section}.path: .*huge.txt holds 8192 MiB of text; allowed: at most "
                                          rf"{MAX_TEXT_BYTES >> 20} MiB"):
        load_config(cfg)
    assert time.perf_counter() - t0 < 1


def test_a_huge_text_file_as_a_sweeps_utility_data_is_refused(huge_text):
    from guardfl.redteam.sweep.config import load_sweep

    base = {"model": {"name": "transformer3"}, "data": {"source": "text", "seq_len": 8}, "attacks": ["tag"],
            "certify": {"max_updates": 1}}
    sweep_cfg = {"base": base, "axes": [{"defense": {"kind": "gradprune"}, "param": "ratio", "values": [0.5]}],
                 "utility": {"source": "text", "path": str(huge_text)}}
    with pytest.raises(ConfigError, match=r"sweep.utility.path: .*8192 MiB of text; allowed: at most"):
        load_sweep(sweep_cfg)


def test_a_huge_text_file_exits_2_from_the_cli(huge_text, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "transformer3"}, "data": {"source": "text", "path": str(huge_text)},
                                   "attacks": ["tag"], "certify": {"max_updates": 1}}))
    assert main(["redteam", "--config", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "data.path" in _one_line(capsys)
    assert not (tmp_path / "o" / "certificate.json").exists()


def test_a_huge_text_folder_and_tsv_are_refused_when_read(tmp_path, huge_text):
    from guardfl.redteam.modality.text.data import load_labelled, load_text

    with pytest.raises(ConfigError, match="data.path: .* MiB of text; allowed: at most"):
        load_text(tmp_path)  # the folder holds huge.txt
    tsv = tmp_path / "huge.tsv"
    os.link(huge_text, tsv)
    with pytest.raises(ConfigError, match="data.path: .* MiB of text"):
        load_labelled(tsv)


# -------------------------------------------------------------------------------------- CLI (item 5)
@pytest.fixture
def defense_yaml(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("kind: gradprune\nratio: 0.9\n")
    return path


@pytest.mark.parametrize("args, needle", [
    (["--num-classes", "0"], "--num-classes: expected an integer in [2, 100000] (got 0)"),
    (["--num-classes", "1"], "--num-classes: expected an integer in [2, 100000] (got 1)"),
    (["--num-classes", "100001"], "--num-classes: expected an integer in [2, 100000]"),
    (["--input-shape", "3", "0", "32"], "--input-shape: expected C H W with C in [1, 16], H and W in [1, 1024] (got [3, 0, 32])"),
    (["--input-shape", "3", "100000", "100000"], "--input-shape: expected C H W"),
    (["--input-shape", "-1", "32", "32"], "--input-shape: expected C H W"),
])
def test_check_bounds_its_model_arguments(defense_yaml, capsys, args, needle):
    t0 = time.perf_counter()
    assert main(["check", str(defense_yaml), "--model", "lenet", *args]) == 2
    assert needle in _one_line(capsys)
    assert time.perf_counter() - t0 < 5


def test_check_reads_a_redteam_configs_classes_without_replacing_them(tmp_path, capsys):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("model: {name: lenet, num_classes: 0}\ndefense: {kind: gradprune, ratio: 0.9}\n")
    assert main(["check", str(cfg)]) == 2
    assert "model.num_classes: expected an integer in [2, 100000] (got 0)" in _one_line(capsys)
    assert main(["check", str(cfg), "--num-classes", "2"]) == 0  # the flag overrides the config's


# a sweep's --workers are not bounded by this machine's cores: they may be Ray tasks on a cluster
@pytest.mark.parametrize("command, flag", [("redteam", "--threads"), ("redteam", "--workers"), ("sweep", "--threads")])
def test_threads_and_workers_are_bounded(tmp_path, capsys, command, flag):
    from guardfl.redteam.certification.plan import max_threads

    with pytest.raises(SystemExit) as exit_:
        main([command, "--config", str(tmp_path / "c.yaml"), flag, "10000"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: expected an integer in [1, {max_threads()}]" in err and "cores available" in err and "Traceback" not in err


def test_certify_and_sweep_bound_threads_from_python(tmp_path):
    from guardfl.redteam.certification.run import certify
    from guardfl.redteam.certification.plan import max_threads
    from guardfl.redteam.sweep.run import sweep

    with pytest.raises(ConfigError, match=rf"threads: expected an integer in \[1, {max_threads()}\]"):
        certify({**TINY, "attacks": ["idlg"]}, threads=10_000)
    with pytest.raises(ConfigError, match=rf"workers: expected an integer in \[1, {max_threads()}\]"):
        certify({**TINY, "attacks": ["idlg"]}, workers=10_000)
    with pytest.raises(ConfigError, match=rf"threads: expected an integer in \[1, {max_threads()}\]"):
        sweep(_sweep_config(1, 2), out=tmp_path / "o", backend="sequential", threads=10_000, progress=False)


# ----------------------------------------------------------------- image data sizes (item 5, same kind)
def test_a_population_at_a_huge_image_size_is_refused_before_resizing(monkeypatch):
    from guardfl.redteam.modality.image import data

    monkeypatch.setattr(data, "memory_bound", lambda cap=data.MAX_TENSOR_BYTES: 100 << 20)
    with pytest.raises(data.DataError, match=r"data.image_size: 100 images of 1 channel\(s\) at 1024x1024 needs about "
                                             r"0.4 GiB, past the bound of 0.1 GiB .*set data.limit"):
        data.load("lfw-faces", image_size=1024)
    assert data.load("lfw-faces", image_size=1024, limit=4)[0].shape == (4, 1, 1024, 1024)  # 16 MiB: fine


def test_a_huge_npz_array_is_refused_from_its_header(tmp_path, monkeypatch):
    import numpy as np

    from guardfl.redteam.modality.image import data

    np.savez(tmp_path / "d.npz", x=np.zeros((10, 3, 64, 64), np.float32), y=np.zeros(10, np.int64))
    monkeypatch.setattr(data, "memory_bound", lambda cap=data.MAX_TENSOR_BYTES: 100_000)
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("the array was loaded"))
    with pytest.raises(data.DataError, match=r"data.path: its array 'x' \[10, 3, 64, 64\] \(as float32\) needs about"):
        data.load("npz", path=str(tmp_path / "d.npz"))
