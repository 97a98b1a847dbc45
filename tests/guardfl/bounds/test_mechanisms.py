"""Which defenses are mechanisms, with what parameters, and why the others are not."""

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order")

import math

import pytest

from guardfl.bounds import NO_MECHANISM, NOT_PROVEN, Client, Unbounded, analyse, defense_bound, gdp_rero, verdict
from guardfl.bounds.mechanisms import WHY_NOT


@pytest.mark.parametrize("config", [
    None, {"kind": "identity"}, {"kind": "gradprune", "ratio": 0.9}, {"kind": "sign"}, {"kind": "soteria"},
    {"kind": "outpost"}, {"kind": "graddefense"}, {"kind": "mixup"}, {"kind": "instahide"},
    {"kind": "gaussian", "sigma": 0.1}, {"kind": "laplace", "scale": 0.1},
    {"kind": "dpsgd", "noise_multiplier": 0.0},
    {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.9}, {"kind": "gaussian", "sigma": 0.1}]},
])
def test_no_mechanism_with_the_reason(config):
    found = analyse(config, Client(max_rounds=1))
    assert isinstance(found, Unbounded) and found.status == NO_MECHANISM and found.reason
    kinds = {leaf["kind"] for leaf in (config or {"kind": "identity"}).get("defenses", [config or {"kind": "identity"}])}
    for kind in kinds:
        assert WHY_NOT[kind].split(":")[0] in found.reason


def test_dpsgd_is_a_subsampled_gaussian_at_the_clients_rate_and_steps():
    m = analyse({"kind": "dpsgd", "noise_multiplier": 1.1, "max_grad_norm": 0.5},
                Client(protocol="fedavg", batch_size=10, samples=95, epochs=2))[0]
    assert (m.noise, m.noise_multiplier, m.sample_rate, m.steps_per_round) == ("gaussian", 1.1, 10 / 95, 2 * 10)
    m = analyse({"kind": "dpsgd", "noise_multiplier": 1.1}, Client(batch_size=1, dataset_size=1000))[0]
    assert (m.sample_rate, m.steps_per_round) == (0.001, 1)  # FedSGD: one Poisson batch of the local dataset a round
    m = analyse({"kind": "dpsgd", "noise_multiplier": 1.1, "poisson_sampling": False}, Client(batch_size=1, dataset_size=1000))[0]
    assert m.sample_rate == 1.0 and "no amplification" in m.reference


def test_target_epsilon_resolves_to_opacus_noise_multiplier():
    from opacus.accountants.utils import get_noise_multiplier

    config = {"kind": "dpsgd", "target_epsilon": 8, "epochs": 10, "delta": 1e-5}
    m = analyse(config, Client(batch_size=1, dataset_size=1000))[0]
    assert m.noise_multiplier == pytest.approx(get_noise_multiplier(target_epsilon=8, target_delta=1e-5, sample_rate=0.001,
                                                                     epochs=10, accountant="rdp"))
    found = analyse(config, Client(batch_size=1))
    assert isinstance(found, Unbounded) and "dataset_size" in found.reason


def test_clipped_noise_is_a_gaussian_of_multiplier_sigma_over_clip_every_step():
    m = analyse({"kind": "gaussian", "sigma": 0.01, "clip": 0.1}, Client(protocol="fedavg", batch_size=4, samples=10))[0]
    assert (m.noise_multiplier, m.sample_rate, m.steps_per_round) == (pytest.approx(0.1), 1.0, 3)
    b = defense_bound({"kind": "gaussian", "sigma": 2.0, "clip": 1.0}, Client(max_rounds=4), 0.1)
    assert b.rero == pytest.approx(gdp_rero(0.1, math.sqrt(4) / 2.0), abs=2e-4) and b.steps == 4


def test_clipped_laplace_is_pure_dp_with_the_l1_sensitivity_and_needs_the_dimension():
    config = {"kind": "laplace", "scale": 10.0, "clip": 0.5}
    m = analyse(config, Client(dimension=400))[0]
    assert m.noise == "laplace" and m.epsilon == pytest.approx(math.sqrt(400) * 0.5 / 10.0)
    found = analyse(config, Client())
    assert isinstance(found, Unbounded) and found.status == NOT_PROVEN and "entries" in found.reason


def test_post_processing_keeps_the_bound_and_a_reader_of_the_inputs_voids_it():
    noise = {"kind": "gaussian", "sigma": 1.0, "clip": 1.0}
    for after in ({"kind": "gradprune", "ratio": 0.9}, {"kind": "sign"}, {"kind": "outpost"}):
        assert not isinstance(analyse({"kind": "stack", "defenses": [noise, after]}, Client()), Unbounded)
        assert not isinstance(analyse({"kind": "stack", "defenses": [after, noise]}, Client()), Unbounded)
    found = analyse({"kind": "stack", "defenses": [noise, {"kind": "soteria"}]}, Client())
    assert isinstance(found, Unbounded) and found.status == NOT_PROVEN and "soteria" in found.reason
    # before the noise, the clip bounds whatever Soteria made of the update
    assert not isinstance(analyse({"kind": "stack", "defenses": [{"kind": "soteria"}, noise]}, Client()), Unbounded)
    # DP-SGD's gradient stages all follow its noise, wherever they stand in the list
    dp = {"kind": "dpsgd", "noise_multiplier": 1.0}
    found = analyse({"kind": "stack", "defenses": [{"kind": "graddefense"}, dp]}, Client())
    assert isinstance(found, Unbounded) and "graddefense" in found.reason


def test_an_encoding_voids_dpsgd_but_not_a_clipped_update():
    dp = {"kind": "dpsgd", "noise_multiplier": 1.0}
    found = analyse({"kind": "stack", "defenses": [{"kind": "mixup"}, dp]}, Client(batch_size=8))
    assert isinstance(found, Unbounded) and found.status == NOT_PROVEN and "mixup" in found.reason
    noise = {"kind": "gaussian", "sigma": 1.0, "clip": 1.0}
    assert not isinstance(analyse({"kind": "stack", "defenses": [{"kind": "mixup"}, noise]}, Client(batch_size=8)), Unbounded)


def test_the_least_bound_of_several_mechanisms_and_released_statistics():
    weak, strong = {"kind": "gaussian", "sigma": 0.5, "clip": 1.0}, {"kind": "gaussian", "sigma": 4.0, "clip": 1.0}
    b = defense_bound({"kind": "stack", "defenses": [weak, strong]}, Client(max_rounds=1), 0.1)
    assert b.mechanism.noise_multiplier == 4.0 and len(b.others) == 1
    found = analyse(strong, Client(released=("bn.running_mean", "bn.running_var")))
    assert isinstance(found, Unbounded) and "running" in found.reason


def test_no_round_budget_is_not_proven_and_the_verdict_needs_the_bound_below_the_claim():
    b = defense_bound({"kind": "dpsgd", "noise_multiplier": 1.0}, Client(), 0.1)
    assert b.status == NOT_PROVEN and b.rero is None and "max_rounds" in b.reason
    b = defense_bound({"kind": "dpsgd", "noise_multiplier": 20.0}, Client(max_rounds=1), 0.01)
    assert verdict(b, 0.05)[0] == "PROVEN" and verdict(b, b.rero)[0] == NOT_PROVEN
    status, why = verdict(defense_bound({"kind": "dpsgd", "noise_multiplier": 20.0}, Client(max_rounds=1), 0.1), 0.05)
    assert status == NOT_PROVEN and "kappa" in why
