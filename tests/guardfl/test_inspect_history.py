"""The leak limit across rounds (``inspect_model(..., leak_limit=k, history=LeakHistory())``): what a server
reads by differencing two updates of the same batch, and what earlier rounds gave away, count together."""

import pickle

import pytest
import torch

from guardfl.errors import ConfigError
from guardfl.inspect import inspect_model
from guardfl.inspect_history import LeakHistory, difference_reads, dominated_reads, fingerprint
from guardfl.redteam.modality.image.models import FC2


def centred(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 32, 32, generator=g) - 0.5) / 0.29, torch.arange(n) % 10


def test_a_row_dominated_by_one_sample_reads_it_whatever_its_support():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 50, generator=g, dtype=torch.float64)
    delta = torch.full((40, 3), 1e-7, dtype=torch.float64)  # rounding-level terms everywhere: every sample in support
    delta[7, 0] = 1.0  # row 0: sample 7 alone, up to rounding
    delta[:, 1] = torch.rand(40, generator=g, dtype=torch.float64)  # row 1: every sample alike
    delta[3, 2], delta[4, 2] = 1.0, 0.9  # row 2: two samples, neither read
    assert dominated_reads(delta, a) == [7]
    assert dominated_reads(torch.zeros(40, 3, dtype=torch.float64), a) == []


def test_the_difference_of_two_rounds_reads_the_sample_that_changed_alone():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 30, generator=g, dtype=torch.float64)
    d0 = torch.randn(16, 8, generator=g, dtype=torch.float64)
    d1 = d0.clone()
    d1[5] += torch.randn(8, generator=g, dtype=torch.float64)  # only sample 5's coefficients moved
    assert difference_reads({"l": (d1, a)}, {"l": (d0, a)}) == {"l": [5]}
    assert difference_reads({"l": (d0, a)}, {"l": (d0, a)}) == {"l": []}  # the same update twice: nothing new
    spread = d0 + 0.3 * torch.randn(16, 8, generator=g, dtype=torch.float64)  # every sample moved alike
    assert difference_reads({"l": (spread, a)}, {"l": (d0, a)}) == {"l": []}
    # a layer whose input changed between the rounds: the two rounds' terms side by side, a read is the sample's
    b = a + 0.5 * torch.randn(16, 30, generator=g, dtype=torch.float64)
    d2 = torch.zeros_like(d0)
    d2[9, 0] = 1.0
    assert difference_reads({"l": (d2, b)}, {"l": (torch.zeros_like(d0), a)}) == {"l": [9]}
    assert difference_reads({"l": (d1, a)}, {"other": (d0, a)}) == {}  # no layer in common: nothing compared


def _switching(model: FC2, x: torch.Tensor, sample: int) -> FC2:
    """The honest model with its first layer lifted (every unit fires for every sample) and the classifier
    turned so that only ``sample`` changes its prediction: ``threshold_bins``' step, for one sample."""
    sent = FC2()
    sent.load_state_dict(model.state_dict())
    with torch.no_grad():
        first = sent.net[1]
        pre = x.flatten(1) @ first.weight.T + first.bias
        first.bias += (-pre.min(0).values).clamp(min=0) + 3 * pre.std(0)
        sent.net[3].weight *= 1000
        h = (x.flatten(1) @ first.weight.T + first.bias).clamp(min=0)
        logits = sent.net[3](h)
        direction = torch.zeros(10)
        direction[0] = 1.0
        push = torch.zeros(len(x))
        push[sample] = 1e4
        # a classifier bias can only shift every sample: the sample's own hidden vector steers its row instead
        sent.net[3].weight[0] += 1e4 * h[sample] / h[sample].pow(2).sum() * (1 if logits[sample, 0] < logits[sample].max() else -1)
    return sent


def test_a_server_that_differences_two_queries_is_refused_the_second_and_only_accepted_rounds_are_remembered():
    torch.manual_seed(0)
    honest = FC2()
    x, y = centred()
    history = LeakHistory()
    first = _switching(honest, x, 3)
    assert inspect_model(first, honest, batch=(x, y), leak_limit=0).ok  # alone, each passes the one-update limit
    assert inspect_model(honest, honest, batch=(x, y), leak_limit=0, history=history).ok
    assert history.rounds(x, y) == 1
    result = inspect_model(first, honest, batch=(x, y), leak_limit=0, history=history)
    assert not result.ok and len(result.reasons) == 1
    assert result.reasons[0].startswith("leak limit: a server reads") and "by differencing" in result.reasons[0]
    assert result.checks["leak_limit"]["read"] == 0 and result.checks["leak_limit"]["read_with_history"] >= 1
    assert history.rounds(x, y) == 1  # the refused model's update was never sent
    other = (x + 0.01, y)  # another batch: nothing to difference with
    assert inspect_model(first, honest, batch=other, leak_limit=0, history=history).ok
    with pytest.raises(Exception, match="leak limit"):
        inspect_model(first, honest, batch=(x, y), leak_limit=0, history=history, strict=True)


def test_the_honest_model_sent_again_is_accepted_and_its_rounds_remembered():
    """The same honest model on the same centred batch, round after round (a server resending it, a round
    the aggregate did not move): the differences are zero and read nothing, every round is accepted."""
    torch.manual_seed(0)
    model = FC2()
    x, y = centred()
    history = LeakHistory()
    for k in range(4):
        result = inspect_model(model, model, batch=(x, y), leak_limit=0, history=history)
        assert result.ok, result.reasons
        assert result.checks["leak_limit"]["history"]["rounds"] == k
    assert history.rounds(x, y) == 4 and result.checks["leak_limit"]["read_with_history"] == 0


def test_a_batch_answered_as_often_as_the_history_remembers_is_refused():
    torch.manual_seed(0)
    model = FC2()
    x, y = centred()
    history = LeakHistory(max_rounds=2)
    for _ in range(2):
        assert inspect_model(model, model, batch=(x, y), leak_limit=0, history=history).ok
    result = inspect_model(model, model, batch=(x, y), leak_limit=0, history=history)
    assert not result.ok and "max_rounds = 2" in result.reasons[0]
    restored = pickle.loads(pickle.dumps(history))  # a worker process gets it whole
    assert restored.rounds(x, y) == 2


def test_past_max_batches_the_least_recently_answered_batch_is_dropped_and_a_round_on_it_refused():
    """A shuffling loader's first batch is new every round: the history keeps ``max_batches`` of them, drops
    the least recently answered, and refuses a round on a dropped one (never compared with nothing)."""
    torch.manual_seed(0)
    model = FC2()
    history = LeakHistory(max_batches=2)
    a, b, c = centred(seed=0), centred(seed=1), centred(seed=2)
    for batch in (a, b, a, c):  # a answered again, so b is the least recent when c comes
        assert inspect_model(model, model, batch=batch, leak_limit=0, history=history).ok
    assert history.rounds(*a) == 2 and history.rounds(*b) == 0 and history.rounds(*c) == 1
    result = inspect_model(model, model, batch=b, leak_limit=0, history=history)
    assert not result.ok and "dropped from the history (more than max_batches = 2" in result.reasons[0]
    restored = LeakHistory.from_bytes(history.to_bytes())
    assert not inspect_model(model, model, batch=b, leak_limit=0, history=restored).ok
    assert restored.rounds(*a) == 2 and restored.max_batches == 2


def test_bad_history_arguments_are_one_line_naming_them():
    torch.manual_seed(0)
    model = FC2()
    batch = centred()
    with pytest.raises(ConfigError, match="^history: .*leak_limit is None"):
        inspect_model(model, model, batch=batch, history=LeakHistory())
    with pytest.raises(ConfigError, match="^history: must be a guardfl.inspect_history.LeakHistory, got dict"):
        inspect_model(model, model, batch=batch, leak_limit=0, history={})
    for bad in (0, -1, 1.5, True, 100_001):
        with pytest.raises(ConfigError, match=r"^max_rounds: must be an integer in \[1, 100000\]"):
            LeakHistory(max_rounds=bad)
        with pytest.raises(ConfigError, match=r"^max_batches: must be an integer in \[1, 100000\]"):
            LeakHistory(max_batches=bad)
    x, y = batch
    assert fingerprint(x, y) == fingerprint(x.clone(), y.clone()) != fingerprint(x, (y + 1) % 10)
