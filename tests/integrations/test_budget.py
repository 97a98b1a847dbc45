"""guardfl.integrations.budget: the client's round budget, and local_update keeping it."""

import pytest
import torch
from hypothesis import given, strategies as st

from guardfl.errors import ConfigError, RoundBudgetError
from guardfl.integrations.budget import MAX_ROUNDS_LIMIT, check_budget_left, check_max_rounds
from guardfl.integrations.torch import ClientState, local_update

DATA = [(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 0, 1, 1, 0]))]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@given(st.integers(1, 50), st.integers(0, 60))
def test_a_budget_of_n_answers_exactly_n_rounds(n, done):
    if done < n:
        check_budget_left(n, done)
    else:
        with pytest.raises(RoundBudgetError, match=f"answered {done} rounds, its budget of {n}"):
            check_budget_left(n, done)


@pytest.mark.parametrize("bad", [0, -1, MAX_ROUNDS_LIMIT + 1, 2.5, True, "4"])
def test_a_bad_budget_is_one_line_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"^max_rounds: expected None or an integer in \[1, 1000000\]"):
        check_max_rounds(bad)
    assert check_max_rounds(None) is None and check_max_rounds(7) == 7


def test_local_update_sends_max_rounds_updates_then_refuses_before_training():
    model, state = torch.nn.Linear(4, 2), ClientState()
    noise = {"kind": "gaussian", "sigma": 0.01, "clip": 1.0}
    for _ in range(3):
        state = local_update(model, DATA, sgd, noise, state=state, max_rounds=3).state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RoundBudgetError, match="budget of 3"):
        local_update(model, DATA, sgd, noise, state=state, max_rounds=3)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and state.rounds == 3
    # the count is the state's: a state restored from its JSON keeps it, so a relaunch cannot reset the budget
    with pytest.raises(RoundBudgetError):
        local_update(model, DATA, sgd, noise, state=ClientState.from_json(state.to_json()), max_rounds=3)
    local_update(model, DATA, sgd, noise, state=state, max_rounds=4)  # a larger budget, set by the operator


def test_a_budget_without_the_state_that_counts_it_is_refused():
    with pytest.raises(ConfigError, match="^state: required with max_rounds"):
        local_update(torch.nn.Linear(4, 2), DATA, sgd, None, max_rounds=5)


def test_a_refused_model_spends_no_round():
    from tests import malicious as M
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = ClientState()
    with pytest.raises(Exception, match="class fishing"):
        local_update(M.class_fishing(net, target=1), DATA, sgd, None, state=state, max_rounds=1, inspect=True)
    assert state.rounds == 0
    assert local_update(net, DATA, sgd, None, state=state, max_rounds=1, inspect=True).state.rounds == 1


@given(st.integers(0, 10 ** 6))
def test_a_budget_file_round_trips_its_count(rounds):
    import tempfile
    from pathlib import Path

    from guardfl.integrations.budget import read_count, write_count
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sub" / "budget.json"
        assert read_count(path) == 0
        write_count(path, rounds)
        assert read_count(path) == rounds and sorted(p.name for p in path.parent.iterdir()) == ["budget.json", "budget.json.created"]


@pytest.mark.parametrize("text", ["{", "[]", '{"rounds": -1}', '{"rounds": 2.5}', '{"rounds": true}', '{"count": 3}'])
def test_a_bad_budget_file_is_refused_never_counted_from_zero(tmp_path, text):
    from guardfl.integrations.budget import read_count
    path = tmp_path / "budget.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="refusing rather than counting from 0"):
        read_count(path)
