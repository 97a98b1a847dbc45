"""Certifying an NVFlare site as deployed: examples/nvflare's Client API train round, with the site's result
filters run on what it returns (guardfl.redteam.client.target.run_nvflare, target.nvflare)."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("nvflare")

from guardfl.errors import ConfigError  # noqa: E402
from guardfl.redteam.certification.run import certify  # noqa: E402
from guardfl.redteam.client.simulate import FedAvg, simulate_client  # noqa: E402
from guardfl.redteam.config import load_config  # noqa: E402
from guardfl.redteam.client.target import TargetError, load_object, nvflare_result_filters, observe, on_path, run_nvflare  # noqa: E402
from tests.claims import LOOSE_CLAIM  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "nvflare"
PRUNE_FILTER = {"path": "guardfl.integrations.nvflare.GuardUpdateFilter", "args": {"defense": {"kind": "gradprune", "ratio": 0.9}}}
SITE = {"model": "lenet", "dataset": "faces", "samples": 2, "batch_size": 1, "lr": 0.02}
DLG_FAST = [{"name": "dlg", "budget": {"iterations": 150}, "threat": {"labels": "known"}}]


@pytest.fixture(scope="module")
def site_train():
    with on_path(EXAMPLE):
        from task import lenet

        yield load_object("client:train", "target.nvflare"), lenet


def run_site(site_train, filters=(), **settings):
    from guardfl.redteam.modality.image.models import set_model_state

    fn, lenet = site_train
    model = set_model_state(lenet(), "wide-init", seed=0)
    with on_path(EXAMPLE):
        returned, steps = run_nvflare(fn, model, site="site-2", kwargs={**SITE, **settings},
                                      filters=nvflare_result_filters(None, list(filters)))
    return model, observe(model, returned, steps, FedAvg(batch_size=1, lr=0.02), None, "target.nvflare")


def test_the_red_team_attacks_exactly_what_the_site_trains(site_train):
    model, run = run_site(site_train, defense="none")
    assert run.steps == 2 and run.inputs.shape == (2, 3, 16, 16) and run.labels.tolist() == [2, 3]
    sim = simulate_client(model, run.inputs, run.labels, None, FedAvg(batch_size=1, lr=0.02))
    for name, delta in run.observation.update.items():
        assert torch.allclose(delta, sim.update[name], atol=1e-6), name


def test_the_observed_update_carries_the_sites_defense_and_its_result_filter(site_train):
    _, run = run_site(site_train, filters=[PRUNE_FILTER], defense="sign")
    for name, delta in run.observation.update.items():
        assert (delta == 0).float().mean() >= 0.8, name
        steps = delta[delta != 0] / 0.02
        assert torch.allclose(steps, steps.round(), atol=1e-3), name


def test_a_result_the_sites_filter_refuses_is_not_certified(site_train):
    only_diffs = {**PRUNE_FILTER, "args": {**PRUNE_FILTER["args"], "data_kinds": ["WEIGHT_DIFF"]}}
    with pytest.raises(TargetError, match="GuardUpdateFilter refused"):
        run_site(site_train, filters=[only_diffs])  # the round returns FULL weights


def test_the_site_name_is_the_red_teams(site_train):
    with pytest.raises(TargetError, match="'site' is set by the red team"):
        run_site(site_train, site="site-1")


def test_filters_come_from_an_exported_job(tmp_path):
    job = tmp_path / "job" / "app" / "config"
    job.mkdir(parents=True)
    (job / "config_fed_client.json").write_text(json.dumps({"task_result_filters": [
        {"tasks": ["validate"], "filters": [{"path": "nvflare.app_common.filters.PercentilePrivacy", "args": {}}]},
        {"tasks": ["train"], "filters": [PRUNE_FILTER]}]}))
    (f,) = nvflare_result_filters(str(tmp_path / "job"), None)
    assert type(f).__name__ == "GuardUpdateFilter" and f.defense == {"kind": "gradprune", "ratio": 0.9}
    with pytest.raises(ConfigError, match="unknown kind"):
        nvflare_result_filters(None, [{**PRUNE_FILTER, "args": {"defense": {"kind": "nope"}}}])
    with pytest.raises(ConfigError, match="exactly one config_fed_client.json"):
        nvflare_result_filters(str(tmp_path / "nothing"), None)


@pytest.mark.parametrize("target, field", [
    ({"nvflare": "client:train", "train_fn": "a:b"}, "exactly one"),
    ({"train_fn": "a:b", "result_filters": [PRUNE_FILTER]}, "target.nvflare only"),
    ({"nvflare": "client:train", "job": "x", "result_filters": [PRUNE_FILTER]}, "at most one"),
])
def test_target_section_validation(target, field):
    with pytest.raises(ConfigError, match=field):
        load_config({"target": target, "client": {"protocol": "fedavg"}, "model": {"name": "lenet"}})


def test_shipped_nvflare_example_configs_validate():
    cfg = load_config(ROOT / "configs" / "nvflare-example.yaml")
    assert cfg.target.nvflare == "client:train" and cfg.target.result_filters == [PRUNE_FILTER]
    bare = load_config(ROOT / "configs" / "nvflare-example-no-defense.yaml")
    assert bare.target.result_filters is None and bare.defense is None and bare.target.run_config["defense"] == "none"


def test_certify_the_example_site_without_defenses_finds_the_leak(tmp_path):
    cfg = {"target": {"nvflare": "client:train", "app_dir": str(EXAMPLE), "run_config": {**SITE, "defense": "none"}},
           "model": {"name": "task:lenet", "state": "wide-init"},
           "client": {"protocol": "fedavg", "lr": 0.02, "batch_size": 1, "samples": 2},
           "attacks": DLG_FAST, "certify": {"max_ssim": 0.4, "max_updates": 2, **LOOSE_CLAIM}}
    cert = certify(cfg, out=tmp_path)
    assert not cert.certified and cert.worst[0]["worst"] > 0.9
    assert cert.client["kind"] == "nvflare" and cert.client["batches"]["0"]["site"] == "site-1"
    assert "the user's nvflare" in (tmp_path / "report.html").read_text()
