"""DP-SGD accounting of a certified deployment."""

import pytest

from guardfl.errors import ConfigError
from guardfl.redteam.client.privacy import resolve


def test_target_epsilon_resolves_to_the_noise_that_spends_it():
    cfg = {"kind": "stack", "defenses": [{"kind": "dpsgd", "target_epsilon": 4.0, "epochs": 5, "delta": 1e-5},
                                         {"kind": "gradprune", "ratio": 0.5}]}
    resolved, summary = resolve(cfg, batch_size=32, dataset_size=5000)
    dp = resolved.defenses[0]
    assert dp.target_epsilon is None and dp.noise_multiplier > 0
    assert summary["epsilon"] == pytest.approx(4.0, abs=0.05)
    assert summary["sample_rate"] == 32 / 5000
    assert cfg["defenses"][0]["target_epsilon"] == 4.0  # the caller's config is left alone


def test_more_noise_spends_less_epsilon():
    eps = [resolve({"kind": "dpsgd", "noise_multiplier": s, "epochs": 3}, 16, 1000)[1]["epsilon"] for s in (0.8, 1.6)]
    assert eps[1] < eps[0]


def test_errors_name_the_field():
    with pytest.raises(ConfigError, match="client.dataset_size"):
        resolve({"kind": "dpsgd", "target_epsilon": 1.0, "epochs": 1}, 8, None)
    with pytest.raises(ConfigError, match="client.dataset_size"):
        resolve({"kind": "dpsgd", "noise_multiplier": 1.0}, 8, 4)
    resolved, summary = resolve({"kind": "gradprune", "ratio": 0.5}, 8, None)
    assert resolved.kind == "gradprune" and resolved.ratio == 0.5 and summary is None
    assert resolve(None, 8, None) == (None, None)


def test_shipped_dp_config_spends_the_epsilon_it_states():
    from pathlib import Path

    from guardfl.redteam.config import load_config

    cfg = load_config(Path(__file__).parents[3] / "configs" / "dpsgd-eps8.yaml")
    _, summary = resolve(cfg.defense, cfg.client.batch_size, cfg.client.dataset_size)
    assert summary["epsilon"] == pytest.approx(8.0, abs=0.1) and summary["delta"] == 1e-5


# -- the audit's DP cases (issue 13) ------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_noise_multiplier_zero_is_clipping_only_without_asking_the_accountant(accountant):
    """PRV raised OverflowError on noise multiplier 0; RDP took 2 s to answer inf (not valid JSON)."""
    _, summary = resolve({"kind": "dpsgd", "noise_multiplier": 0.0, "epochs": 2, "accountant": accountant}, 4, 1000)
    assert summary["epsilon"] is None and "no privacy guarantee" in summary["note"]


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_the_largest_noise_multiplier_accounts_quickly(accountant):
    import time

    t0 = time.perf_counter()
    _, summary = resolve({"kind": "dpsgd", "noise_multiplier": 1000.0, "epochs": 2, "accountant": accountant}, 4, 1000)
    assert 0 < summary["epsilon"] < 1 and time.perf_counter() - t0 < 5


@pytest.mark.parametrize("field, value, expect", [
    ("noise_multiplier", float("inf"), "dpsgd.noise_multiplier: Input should be a finite number (got inf); allowed: null or finite, in [0, 1000]"),
    ("noise_multiplier", 1e4, "allowed: null or finite, in [0, 1000]"),
    ("max_grad_norm", float("inf"), "dpsgd.max_grad_norm: Input should be a finite number (got inf); allowed: finite, in (0, 1e6]"),
    ("target_epsilon", float("inf"), "dpsgd.target_epsilon: Input should be a finite number (got inf); allowed: null or finite, in (0, 100]"),
    ("target_epsilon", 1e3, "allowed: null or finite, in (0, 100]"),
])
def test_the_red_team_config_refuses_unbounded_dp_settings(field, value, expect):
    from guardfl.redteam.config import load_config

    dp = {"kind": "dpsgd", "epochs": 1, field: value}
    if field != "noise_multiplier" and field != "target_epsilon":
        dp["noise_multiplier"] = 1.0
    with pytest.raises(ConfigError) as err:
        load_config({"defense": dp, "client": {"dataset_size": 100}})
    assert expect in str(err.value) and str(err.value).startswith("config.defense: ") and "\n" not in str(err.value)


def test_a_parsed_config_resolves_to_itself_with_the_dp_leaf_replaced():
    from guardfl.defenses import parse_config

    cfg = parse_config({"kind": "stack", "defenses": [
        {"kind": "gradprune", "ratio": 0.5},
        {"kind": "stack", "defenses": [{"kind": "dpsgd", "target_epsilon": 4.0, "epochs": 5}, {"kind": "gradprune", "ratio": 0.3}]},
    ]}).model_dump(mode="json")  # as RedTeamConfig.defense holds it
    resolved, summary = resolve(cfg, batch_size=32, dataset_size=5000)
    expected = {**cfg, "defenses": [cfg["defenses"][0], {**cfg["defenses"][1], "defenses": [
        {**cfg["defenses"][1]["defenses"][0], "noise_multiplier": summary["noise_multiplier"], "target_epsilon": None},
        cfg["defenses"][1]["defenses"][1]]}]}
    assert resolved.model_dump(mode="json") == expected and list(resolved.model_dump(mode="json")) == list(cfg)
    assert resolved.leaves()[1].noise_multiplier == summary["noise_multiplier"] > 0
