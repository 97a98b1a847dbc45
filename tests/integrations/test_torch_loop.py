"""guardfl.integrations.torch: local_update and the per-client state."""

import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from guardfl.defenses import DPSGD, GaussianNoise, GradPrune, Identity, SignCompression, Stack
from guardfl.errors import ConfigError
from guardfl.integrations.torch import ClientState, local_update, round_defense


def mlp(bn: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Flatten(), torch.nn.Linear(16, 8)]
    layers += [torch.nn.BatchNorm1d(8)] if bn else []
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(8, 3))


def loader(n=32, batch_size=8):
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)), batch_size=batch_size)


sgd = lambda lr: (lambda params: torch.optim.SGD(params, lr=lr))  # noqa: E731


def test_identity_matches_a_plain_loop_bit_for_bit():
    model, ref = mlp(), mlp()
    start = copy.deepcopy(ref.state_dict())
    result = local_update(model, loader(), sgd(0.1), Identity(), epochs=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in loader():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            opt.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
        assert torch.equal(result.delta[k], v - start[k])
    assert (result.steps, result.num_examples, result.state.rounds) == (8, 64, 1)
    assert math.isinf(result.epsilon)


def test_sign_update_is_a_multiple_of_lr_and_prune_is_sparse():
    result = local_update(mlp(), loader(), sgd(0.05), SignCompression())
    for v in result.delta.values():
        steps = v / 0.05
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= result.steps + 1e-4
    one_step = local_update(mlp(), loader(8), sgd(0.1), GradPrune(0.75))
    for v in one_step.delta.values():
        assert (v == 0).sum() >= math.floor(0.75 * v.numel())
    assert all(s["stages"][0]["layers"] for s in one_step.defense_stats)


def test_dp_epsilon_is_cumulative_over_rounds_and_hooks_are_removed():
    from opacus.accountants import RDPAccountant

    model, state = mlp(), ClientState()  # a seeded defense needs the round counter from round 0
    for _ in range(3):
        result = local_update(model, loader(), sgd(0.1), DPSGD(noise_multiplier=1.0, seed=1), state=state)
        state = ClientState.from_json(result.state.to_json())  # saved and restored between rounds
    ref = RDPAccountant()
    for _ in range(12):
        ref.step(noise_multiplier=1.0, sample_rate=0.25)
    assert result.epsilon == pytest.approx(ref.get_epsilon(1e-5))
    assert state.rounds == 3 and state.steps == 12
    assert type(model[1]) is torch.nn.Linear
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert not hasattr(model[1].weight, "grad_sample")


def test_dp_refuses_a_batchnorm_model():
    with pytest.raises(ConfigError, match="dp_compatible"):
        local_update(mlp(bn=True), loader(), sgd(0.1), DPSGD(noise_multiplier=1.0))


def test_seeded_defense_draws_a_new_stream_every_round_reproducibly():
    noise = GaussianNoise(sigma=0.1, seed=5)
    streams = []
    for r in range(3):
        d = round_defense(noise, r)
        streams.append(d([torch.zeros(100)])[0][0])
    assert not torch.equal(streams[0], streams[1]) and not torch.equal(streams[1], streams[2])
    assert torch.equal(round_defense(noise, 1)([torch.zeros(100)])[0][0], streams[1])
    stacked = Stack(GradPrune(0.5), GaussianNoise(sigma=0.1), seed=9)
    a = round_defense(stacked, 2)([torch.ones(50)])[0][0]
    assert torch.equal(a, round_defense(stacked, 2)([torch.ones(50)])[0][0])
    assert not torch.equal(a, round_defense(stacked, 3)([torch.ones(50)])[0][0])
    unseeded = GaussianNoise(sigma=0.1)
    assert not torch.equal(round_defense(unseeded, 0)([torch.zeros(10)])[0][0], round_defense(unseeded, 0)([torch.zeros(10)])[0][0])



@pytest.mark.parametrize("defense", [GaussianNoise(sigma=0.1, seed=5), DPSGD(noise_multiplier=1.0, seed=1),
                                     Stack(GradPrune(0.5), GaussianNoise(sigma=0.1), seed=9),
                                     {"kind": "outpost", "seed": 3}])
def test_a_seeded_random_defense_needs_the_round_counter(defense):
    """Without a ClientState every call is round 0: a seeded defense would send the same noise every round,
    and two rounds' updates of one batch differenced cancel it. One line naming ``state``; with
    ``ClientState()`` it trains, and two rounds draw different noise."""
    with pytest.raises(ConfigError, match=r"^state: required with a defense seeded explicitly") as err:
        local_update(mlp(), loader(), sgd(0.1), defense)
    assert "\n" not in str(err.value) and "ClientState()" in str(err.value)
    first = local_update(mlp(), loader(), sgd(0.1), defense, state=ClientState())
    again = local_update(mlp(), loader(), sgd(0.1), defense, state=ClientState())
    second = local_update(mlp(), loader(), sgd(0.1), defense, state=first.state)
    key = "3.weight"
    assert torch.equal(first.delta[key], again.delta[key])  # the seed: reproducible
    assert not torch.equal(first.delta[key], second.delta[key])  # the next round: other noise


@pytest.mark.parametrize("defense", [GradPrune(0.5, seed=2), SignCompression(seed=2), GaussianNoise(sigma=0.1), None])
def test_deterministic_or_unseeded_defenses_need_no_counter(defense):
    local_update(mlp(), loader(), sgd(0.1), defense)


def test_bad_input_is_one_clear_error():
    with pytest.raises(ConfigError, match="epochs"):
        local_update(mlp(), loader(), sgd(0.1), epochs=0)
    with pytest.raises(ConfigError, match="yielded no batches"):
        local_update(mlp(), [], sgd(0.1))
    with pytest.raises(ConfigError, match="make_optimizer"):
        local_update(mlp(), loader(), lambda p: None)
    with pytest.raises(ConfigError, match="client state"):
        ClientState.from_json("{not json")


def test_outpost_schedule_restarts_every_round():
    from guardfl.defenses import Outpost

    model, state = mlp(), None
    for _ in range(2):
        result = local_update(model, loader(), sgd(0.1), Outpost(beta=100.0), state=state)
        state = result.state
        iterations = [s["iteration"] for s in result.defense_stats]
        assert iterations == [1, 2, 3, 4]
        assert result.defense_stats[0]["fired"]  # i = 1 always perturbs
        assert result.defense_stats[0]["stages"][0]["layers"][0]["name"] == "1.weight"


def test_inspect_enabled_reads_the_inspect_arguments():
    from guardfl.integrations.torch import inspect_enabled

    assert inspect_enabled(False) is False and inspect_enabled(True) is True and inspect_enabled("strict") is True
    assert inspect_enabled(True, True) is True
    with pytest.raises(ConfigError, match=r"^inspect: expected False, True or 'strict'"):
        inspect_enabled("yes")
    with pytest.raises(ConfigError, match=r"^inspect_disaggregation: True adds a check"):
        inspect_enabled(False, True)
