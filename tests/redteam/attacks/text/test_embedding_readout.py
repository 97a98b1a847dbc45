"""Embedding readout and the maths behind it (``textleak``): the token rows are the position rows times a
0/1 assignment, so one undefended sequence comes back exactly (all but a causal LM's last token, which has
no gradient), sign compression does not stop it, B > 1 gives each position's tokens, the bigram model
orders sequences, and the attack refuses models whose embedding is frozen or has no learned positions."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.redteam import FedAvg, ThreatModel, attacks, simulate_client
from guardfl.redteam.attacks.base import NotApplicable
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.attacks.text.embedding_readout import EmbeddingReadout
from guardfl.redteam.attacks.text.textleak import Bigram, assign_positions, order_sequences, position_sets
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.modality.text.models import TextClassifier, Transformer3, embedding_names, next_token_labels

V, L = 500, 8


def _lm(tied: bool = False) -> Transformer3:
    torch.manual_seed(0)
    return Transformer3(vocab_size=V, context=32, tied=tied)


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ the maths
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 12), st.integers(1, 6))
def test_assignment_is_exact_when_token_rows_are_sums_of_position_rows(seed, length, distinct):
    """R = A Q with A a 0/1 assignment (repeats allowed): the least squares returns A's argmax."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, 16, generator=gen, dtype=torch.float64)
    which = torch.randint(0, distinct, (length,), generator=gen)
    which[:distinct] = torch.arange(min(distinct, length))  # every token used at least once
    k = int(which.max()) + 1
    r = torch.zeros(k, 16, dtype=torch.float64).index_add_(0, which, q)
    assert assign_positions(r, q).tolist() == which.tolist()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 0.95))
def test_pruned_position_rows_are_matched_on_their_surviving_coordinates(seed, pruned):
    """Unique tokens, the position rows cut (a share of each row's coordinates set to zero, at least
    three kept): their surviving coordinates still equal the token rows' there, so each finds its token."""
    gen = torch.Generator().manual_seed(seed)
    length, width = 10, 48
    q = torch.randn(length, width, generator=gen, dtype=torch.float64)
    r = q[torch.randperm(length, generator=gen)]
    truth = [int((r == q[p]).all(1).nonzero()) for p in range(length)]
    keep = torch.rand(length, width, generator=gen) > pruned
    keep[:, :3] = True
    assert assign_positions(r, q * keep).tolist() == truth


def test_zero_position_rows_are_left_unassigned():
    q = torch.randn(4, 8, dtype=torch.float64)
    q[3] = 0
    r = q[:3].clone()
    assert assign_positions(r, q).tolist() == [0, 1, 2, -1]


def test_position_sets_recover_each_positions_tokens():
    """Four sequences, every token used once: each position's row is the sum of four token rows."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(4 * 6, 32, generator=gen, dtype=torch.float64)  # token j at position j // 4
    q = rows.reshape(6, 4, 32).sum(1)
    sets = position_sets(rows, q, 4)
    assert [sorted(s) for s in sets] == [list(range(4 * p, 4 * p + 4)) for p in range(6)]


def test_bigram_orders_sequences_and_fills_missing_positions():
    aux = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]] * 5)
    bigram = Bigram(aux, 10)
    assert bigram.best_next(3) == 4 and bigram.logp(1, 2) > bigram.logp(1, 6)
    sets = [[1, 5], [6, 2], [7, 3], []]  # position 1 and 2 arrive in the wrong order, position 3 unread
    out = order_sequences(sets, 2, bigram, fill=0)
    assert out.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert order_sequences(sets, 2, None, fill=9)[:, 3].tolist() == [9, 9]


# ------------------------------------------------------------------------------------------ the attack
def _readout(observation, aux=None, labels="inferred"):
    return attacks.get("embedding_readout").reconstruct(observation, ThreatModel(labels=labels, aux=aux))


@pytest.mark.parametrize("defense", [None, {"kind": "sign"}])
def test_one_sequence_comes_back_except_the_last_token(defense):
    model, x = _lm(), _tokens(1)
    obs = simulate_client(model, x, next_token_labels(x), defense)
    rec = _readout(obs)
    assert torch.equal(rec.inputs[0, :-1], x[0, :-1])
    assert rec.inputs.shape == x.shape and torch.equal(rec.labels, next_token_labels(rec.inputs))
    assert rec.info["positions_read"] == L - 1  # the last position has no target, so no gradient row


def test_pruned_update_still_reads_most_positions():
    model, x = _lm(), _tokens(1, seed=3)
    obs = simulate_client(model, x, next_token_labels(x), {"kind": "gradprune", "ratio": 0.9, "seed": 0})
    rec = _readout(obs)
    assert float((rec.inputs[0, :-1] == x[0, :-1]).float().mean()) >= 0.7


def test_noise_drowns_the_readout():
    """sigma 1 on a small model's gradient: nothing stands out; the attack still answers (and fails)."""
    model, x = _lm(), _tokens(1, seed=4)
    obs = simulate_client(model, x, next_token_labels(x), {"kind": "gaussian", "sigma": 1.0, "seed": 0})
    rec = _readout(obs)
    assert rec.inputs.shape == x.shape
    assert float((rec.inputs == x).float().mean()) < 0.5


def test_batch_positions_and_bigram_order_from_aux():
    """B = 2: each position's pair comes back; with auxiliary text that contains the two sentences'
    bigrams the sequences are untangled too (the aux holds other windows with the same bigrams)."""
    model = _lm()
    x = torch.randperm(V, generator=torch.Generator().manual_seed(5))[: 2 * L].reshape(2, L)
    obs = simulate_client(model, x, next_token_labels(x))
    blind = _readout(obs)
    for p in range(L - 1):
        assert sorted(blind.inputs[:, p].tolist()) == sorted(x[:, p].tolist())
    # aux: the private sentences' bigrams, but as shifted windows (never the private windows themselves)
    shifted = torch.cat([x[:, 1:], x[:, :1]], dim=1)
    aux = AuxData(shifted, next_token_labels(shifted), name="aux")
    aux.check_disjoint(x)
    ordered = _readout(obs, aux)
    rows = sorted(ordered.inputs[:, :-1].tolist())
    assert rows == sorted(x[:, :-1].tolist())


def test_classifier_labels_from_the_threat_model():
    torch.manual_seed(0)
    model = TextClassifier(vocab_size=V, num_classes=3, context=32)
    x, y = _tokens(1, seed=6), torch.tensor([2])
    obs = simulate_client(model, x, y)
    rec = _readout(obs, labels="known")
    assert torch.equal(rec.inputs, x) and rec.labels.tolist() == [2]  # bidirectional: every position has a row


def test_fedavg_several_steps_reads_the_sequence():
    model, x = _lm(), _tokens(1, seed=7)
    obs = simulate_client(model, x, next_token_labels(x), None, FedAvg(epochs=3, batch_size=1, lr=0.01))
    rec = _readout(obs)
    assert float((rec.inputs[0, :-1] == x[0, :-1]).float().mean()) >= 0.85


def test_refuses_frozen_embeddings_and_models_without_learned_positions():
    x = _tokens(1)
    tied = simulate_client(_lm(tied=True), x, next_token_labels(x))
    reason = EmbeddingReadout.applicable(Setting.of(tied), ThreatModel())
    assert reason is not None and "token embedding" in reason
    with pytest.raises(NotApplicable):
        _readout(tied)


def test_embedding_names_fall_back_to_the_one_other_embedding():
    model = _lm()
    assert embedding_names(model) == ("token.weight", "position.weight")

    class NoGetter(torch.nn.Module):
        task = "causal-lm"

        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(10, 4), torch.nn.Embedding(6, 4)

        def get_input_embeddings(self):
            return self.tok

    assert embedding_names(NoGetter()) == ("tok.weight", "pos.weight")
