"""The certificate's bound entry: its keys and statuses on typical and shipped configs, kappa from the
auxiliary data with the judge's criterion, and the sentence a reviewer reads."""

from pathlib import Path

import pytest
import torch

from guardfl.bounds import Client, defense_bound
from guardfl.redteam.certification import evidence
from guardfl.redteam.certification.bound import (certificate_bound, client_facts, kappa_from_aux, rounds_axis,
                                                 summary_sentence)
from guardfl.redteam.config import load_config

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"status", "rero", "kappa", "kappa_source", "claim", "mechanism", "leaf", "accountant", "neighbouring", "rounds",
        "steps", "steps_per_round", "sample_rate", "assumption", "reason", "others", "curve_rounds", "curve_kappa"}


def _cfg(defense, **client):
    return load_config({"client": {"protocol": "fedsgd", "batch_size": 4, **client}, "defense": defense,
                        "certify": {"max_ssim": 0.4, "max_leak_rate": 0.05, "max_updates": 1}})


def test_a_strong_dpsgd_client_with_a_budget_is_proven_and_the_curves_show_the_budget():
    cfg = _cfg({"kind": "dpsgd", "noise_multiplier": 30.0}, max_rounds=4)
    entry = certificate_bound(cfg, 0.01, "certify.kappa")
    assert KEYS <= set(entry) and entry["status"] == "PROVEN" and entry["reason"] == ""
    assert entry["rero"] == pytest.approx(defense_bound(cfg.defense, client_facts(cfg), 0.01).rero)
    assert entry["rero"] < 0.05 and entry["steps"] == 4 and entry["leaf"] == "dpsgd"
    rounds = [r for r, _ in entry["curve_rounds"]]
    assert 4 in rounds and max(rounds) >= 16
    values = [b for _, b in entry["curve_rounds"]]
    assert values == sorted(values)  # rises with rounds
    assert [k for k, _ in entry["curve_kappa"]] == sorted(k for k, _ in entry["curve_kappa"])


@pytest.mark.parametrize("path, status, why", [
    ("configs/dpsgd-eps8.yaml", "NOT PROVEN", "max_rounds"),           # no round budget
    ("configs/research/malicious-adaptive-clip.yaml", "NOT PROVEN", "not below"),  # sigma / clip = 0.1: the bound is 1
    ("configs/no-defense.yaml", "NO MECHANISM", "no defense"),
    ("configs/papers/huang2021-gradprune-0.9-b16.yaml", "NO MECHANISM", "pruning"),
])
def test_shipped_configs(path, status, why):
    entry = certificate_bound(load_config(ROOT / path), 0.01, "test", curves=False)
    assert entry["status"] == status and why in entry["reason"]


def test_without_kappa_nothing_is_proven_but_the_mechanism_is_named():
    entry = certificate_bound(_cfg({"kind": "gaussian", "sigma": 5.0, "clip": 1.0}, max_rounds=1), None, "")
    assert entry["status"] == "NOT PROVEN" and "kappa" in entry["reason"] and entry["mechanism"].startswith("Gaussian")


def test_the_model_gives_laplace_its_dimension_and_a_fedavg_client_its_batchnorm_statistics():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    cfg = load_config({"client": {"protocol": "fedavg", "batch_size": 2, "samples": 4, "max_rounds": 1},
                       "defense": {"kind": "laplace", "scale": 1e4, "clip": 0.1}})
    facts = client_facts(cfg, model)
    assert facts.dimension == sum(p.numel() for p in model.parameters()) and facts.released == ("1.running_mean",)
    entry = certificate_bound(cfg, 0.01, "test", model=model, curves=False)
    assert entry["status"] == "NOT PROVEN" and "running" in entry["reason"]
    fedsgd = load_config({"client": {"batch_size": 2, "max_rounds": 1}, "defense": {"kind": "laplace", "scale": 1e4, "clip": 0.1}})
    entry = certificate_bound(fedsgd, 0.01, "test", model=model, curves=False)
    assert entry["status"] == "PROVEN" and entry["epsilon"] == pytest.approx(facts.dimension ** 0.5 * 0.1 / 1e4)


def test_kappa_from_aux_counts_the_guesses_that_pass_the_judges_limit():
    torch.manual_seed(0)
    private = torch.rand(40, 1, 16, 16)
    aux = torch.rand(10, 1, 16, 16)
    cfg = _cfg(None)
    est = kappa_from_aux(cfg, aux, private)
    assert est.successes == 0 and est.trials == 40 and est.guesses == 10  # noise images resemble no private image
    aux[3] = private[5]  # one auxiliary image equals a private one: SSIM 1 there
    est = kappa_from_aux(cfg, aux, private)
    assert (est.best, est.successes) == (3, 1) and est.kappa > 1 / 40
    text = load_config(ROOT / "configs/text-default.yaml")
    assert isinstance(kappa_from_aux(text, aux, private), str)


def test_rounds_axis():
    assert rounds_axis(None)[-1] == 256 and rounds_axis(5) == [1, 2, 4, 5, 8, 16]


@pytest.mark.parametrize("verdict, status, words", [
    (evidence.CERTIFIED, "NOT PROVEN", "CERTIFIED and NOT PROVEN: our attacks missed; no theorem bounds this"),
    (evidence.CERTIFIED, "PROVEN", "CERTIFIED and PROVEN: our attacks missed, and a theorem bounds ANY attacker"),
    (evidence.CERTIFIED, "NO MECHANISM", "CERTIFIED with NO MECHANISM"),
    (evidence.NOT_CERTIFIED, "NOT PROVEN", "NOT CERTIFIED: the attacked updates refuted a claim"),
    (evidence.NOT_CERTIFIED, "PROVEN", "NOT CERTIFIED although PROVEN"),
    (evidence.INCONCLUSIVE, "PROVEN", "INCONCLUSIVE (the attacked updates decided no claim within the budget) but PROVEN"),
])
def test_the_sentence_a_reviewer_reads(verdict, status, words):
    bound = {"status": status, "claim": 0.05, "rero": 0.01, "kappa": 0.001, "rounds": 4, "mechanism": "DP-SGD",
             "kappa_source": "certify.kappa", "reason": "no round budget"}
    assert summary_sentence(verdict, bound).startswith(words)


def test_the_recipes_step_takes_kappa_from_the_config_or_estimates_it():
    from guardfl.redteam.auxdata import AuxData
    from guardfl.redteam.certification.bound import run_bound

    torch.manual_seed(3)
    aux = AuxData(torch.rand(300, 1, 8, 8), torch.zeros(300, dtype=torch.long))
    private = torch.rand(50, 1, 8, 8)
    cfg = _cfg({"kind": "gaussian", "sigma": 5.0, "clip": 1.0}, max_rounds=1)
    entry = run_bound(cfg, aux, private, None)
    assert entry["kappa_source"].startswith("estimated from 256 auxiliary guesses against 50 private samples")
    assert 1 - (0.05 / 256) ** (1 / 50) - 1e-12 <= entry["kappa"] < 1 and entry["rero"] >= entry["kappa"]
    given = load_config({**cfg.model_dump(mode="json"), "certify": {**cfg.certify.model_dump(mode="json"), "kappa": 0.001}})
    assert run_bound(given, aux, private, None)["kappa_source"] == "certify.kappa"
    entry = run_bound(_cfg({"kind": "sign"}), aux, private, None)
    assert entry["status"] == "NO MECHANISM" and entry["kappa"] is None
    entry = run_bound(cfg, None, private, None)
    assert entry["status"] == "NOT PROVEN" and "no auxiliary data" in entry["reason"]
