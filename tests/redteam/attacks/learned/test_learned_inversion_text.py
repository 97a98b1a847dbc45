"""Learned inversion (LTI) for tokens: the text inverter on a small causal transformer with Markov-chain
sequences (an inverter can learn them), defenses as augmentation, Hungarian matching, the cache, refusals."""

from dataclasses import replace

import pytest
import torch

from guardfl.redteam import FedAvg, FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.attacks import LearnedInversion, PreparedCache, Setting
from guardfl.redteam.attacks.learned.learned_inversion_text import chunk_for, matched_cross_entropy, token_rows
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.modality.text.models import TextClassifier, Transformer3, next_token_labels

L = 8
#: small budgets for a 75k-parameter model (the quick budget is for transformer3)
SMALL = dict(text_hidden=256, token_hidden=64, text_epochs=20, text_batch=32, text_lr=1e-3, text_refresh_every=20,
             text_hash_dim=2048, seed=0, device="cpu")
TINY = dict(text_hidden=16, token_hidden=8, text_epochs=1, text_batch=32, text_hash_dim=256, seed=0, device="cpu")


def markov(n: int, length: int, vocab: int = 1000, used: int = 200, successors: int = 3, seed: int = 0) -> torch.Tensor:
    """Sequences of a sparse Markov chain over ``used`` of ``vocab`` token ids (3 successors per token)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab, generator=g)[:used]
    succ = torch.randint(0, used, (used, successors), generator=g)
    out = torch.empty(n, length, dtype=torch.long)
    cur = torch.randint(0, used, (n,), generator=g)
    for t in range(length):
        out[:, t] = cur
        cur = succ[cur, torch.randint(0, successors, (n,), generator=g)]
    return tokens[out]


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return Transformer3(vocab_size=1000, width=32, heads=4, ffn=64, layers=1, context=32)


@pytest.fixture(scope="module")
def data():
    seqs = markov(720, L)
    private, aux = seqs[:20], seqs[20:]
    return private, ThreatModel(aux=AuxData(aux, next_token_labels(aux)))


@pytest.fixture(scope="module")
def few(data):
    """The first 100 auxiliary sequences (for the tests that do not measure the inverter)."""
    aux = data[1].aux.images[:100]
    return ThreatModel(aux=AuxData(aux, next_token_labels(aux)))


def _client(model, tokens, defense=None, protocol=None):
    return simulate_client(model, tokens, next_token_labels(tokens), defense, protocol)


def _accuracy(attack, model, private, threat, defense, b=1):
    obs = [_client(model, private[i : i + b], defense) for i in range(0, len(private), b)]
    recs = attack.reconstruct_many(obs, threat, [0] * len(obs))
    for r in recs:
        assert r.inputs.dtype == torch.long and r.inputs.shape == (b, L)
    return float(torch.cat([(r.inputs == private[i * b : (i + 1) * b]).flatten() for i, r in enumerate(recs)]).float().mean())


def _trivial(private, threat):
    return float((private == torch.mode(threat.aux.images, 0).values).float().mean())


@pytest.mark.parametrize("defense", [None, {"kind": "sign"}, {"kind": "gradprune", "ratio": 0.99}])
def test_the_token_inverter_recovers_held_out_sequences(lm, data, defense):
    """B=1: most tokens of private sequences the attacker never saw come back without a defense, and
    under sign compression and 99% pruning the inverter still beats the trivial guess (the most frequent
    aux token per position) by far. Measured: none 0.47, sign 0.28, prune 0.49 (without the token rows 0.39,
    0.18, 0.43); trivial 0.02."""
    private, threat = data
    attack, cache = attacks.get("learned_inversion", **SMALL), PreparedCache()
    infos = []
    attack.prepare(Setting.of(_client(lm, private[:1], defense)), threat, cache=cache, on_done=infos.append)
    info = infos[0]
    assert info["vocab_out"] == 200 and info["hash_dim"] == 2048 and not info["fresh_draws"]
    assert info["holdout_token_accuracy"] > 4 * info["holdout_token_accuracy_trivial"]
    assert info["holdout_rows_informative"] == 1.0  # the token embedding's rows name the batch's tokens
    acc, trivial = _accuracy(attack, lm, private, threat, defense), _trivial(private, threat)
    assert acc > 0.15 and acc > 5 * trivial
    if defense is None:
        assert acc > 0.4
    no_rows = attacks.get("learned_inversion", **{**SMALL, "token_rows": False})
    no_rows.prepare(Setting.of(_client(lm, private[:1], defense)), threat, cache=cache, on_done=infos.append)
    assert infos[1]["cached"]  # token_rows is a reconstruction-time choice: the same trained inverter
    assert _accuracy(no_rows, lm, private, threat, defense) > 3 * trivial


def test_batches_of_two_are_matched_and_labelled(lm, data, few):
    private, threat = data[0], few
    attack = attacks.get("learned_inversion", **TINY)
    obs = _client(lm, private[:2])
    rec = attack.reconstruct(obs, threat)
    assert rec.inputs.shape == (2, L) and rec.inputs.dtype == torch.long
    torch.testing.assert_close(rec.labels, next_token_labels(rec.inputs))  # labels inferred: next tokens
    assert int(rec.inputs.min()) >= 0 and set(rec.inputs.flatten().tolist()) <= set(threat.aux.images.flatten().tolist())
    known = attack.reconstruct(obs, ThreatModel(labels="known", aux=threat.aux))
    torch.testing.assert_close(known.labels, next_token_labels(private[:2]))


def test_matched_cross_entropy_finds_the_assignment():
    torch.manual_seed(0)
    targets = torch.randint(0, 5, (3, 2, 4))
    logits = torch.nn.functional.one_hot(targets.flip(1), 5).float() * 10  # predicted rows swapped
    loss, perm = matched_cross_entropy(logits, targets, return_perm=True)
    assert perm.tolist() == [[1, 0]] * 3
    assert float(loss) < 1e-3
    plain = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1))
    assert float(plain) > 1  # unmatched, the swapped rows cost
    single = matched_cross_entropy(logits[:, :1], targets[:, 1:])
    assert float(single) < 1e-3


def test_token_rows_and_chunk_size():
    assert chunk_for(10_726_705) == 6 and chunk_for(1000) == 256
    # on a CPU, one parameter's block per chunk stays under glibc's mmap threshold (transformer3's embedding)
    assert chunk_for(10_726_705, 50_257 * 96) == 1 and chunk_for(10_726_705, 50_257 * 96, "meta") == 6
    assert chunk_for(1000, 100) == 256 and chunk_for(8_000_000, 4_000_000) == 2
    flat = torch.zeros(3 + 5 * 2)
    flat[3 + 2 * 2] = 1.0  # row 2 of a 5 x 2 embedding at offset 3
    assert token_rows(flat, (3, 5, 2), limit=4).tolist() == [2]
    assert token_rows(flat + 1, (3, 5, 2), limit=4) is None  # every row touched: not informative
    assert token_rows(flat, None, limit=4) is None


def test_prepare_is_cached_per_setting(lm, data, few, monkeypatch):
    private, threat = data[0], few
    cache = PreparedCache()
    setting = Setting.of(_client(lm, private[:1], {"kind": "sign"}))
    attacks.get("learned_inversion", **TINY).prepare(setting, threat, cache=cache)
    calls = []
    real = LearnedInversion._prepare
    monkeypatch.setattr(LearnedInversion, "_prepare", lambda self, *a: calls.append(a) or real(self, *a))
    infos = []
    attacks.get("learned_inversion", **TINY).prepare(setting, threat, cache=cache, on_done=infos.append)
    assert calls == [] and infos[0]["cached"]
    other = Setting.of(_client(lm, private[:1], {"kind": "gradprune", "ratio": 0.99}))
    attacks.get("learned_inversion", **TINY).prepare(other, threat, cache=cache)
    assert len(calls) == 1  # another defense configuration: trained again


def test_a_random_defense_is_redrawn_and_the_rows_are_not_used_under_noise(lm, data, few):
    """Gaussian noise touches every embedding row: the token rows are not informative (not used), and the
    training observations are drawn afresh every ``text_refresh_every`` epochs."""
    private = data[0]
    defense = {"kind": "gaussian", "sigma": 0.01, "seed": 3}
    infos = []
    attack = attacks.get("learned_inversion", **{**TINY, "text_epochs": 3, "text_refresh_every": 1})
    attack.prepare(Setting.of(_client(lm, private[:1], defense)), few, on_done=infos.append)
    assert infos[0]["draws"] == 3 and infos[0]["fresh_draws"] and infos[0]["holdout_rows_informative"] == 0
    rec = attack.reconstruct(_client(lm, private[:1], defense), few)
    assert not rec.info["token_rows"] and rec.inputs.shape == (1, L)


def test_a_text_classifier_is_inverted_with_inferred_labels(data):
    private, _ = data
    torch.manual_seed(1)
    model = TextClassifier(vocab_size=1000, num_classes=3, width=16, heads=2, ffn=32, layers=1, context=32)
    aux = markov(200, L, seed=5)
    threat = ThreatModel(aux=AuxData(aux, aux[:, 0] % 3))
    obs = simulate_client(model, private[:1], private[:1, 0] % 3)
    rec = attacks.get("learned_inversion", **TINY).reconstruct(obs, threat)
    assert rec.inputs.shape == (1, L) and rec.labels.shape == (1,) and rec.info["labels"] == "inferred"


def test_applicable_refuses_what_it_cannot_attack(lm, data):
    private, threat = data
    aux = threat.aux
    setting = Setting.of(_client(lm, private[:1]))
    assert LearnedInversion.applicable(setting, threat) is None
    assert "needs auxiliary data" in LearnedInversion.applicable(setting, ThreatModel())
    fedavg = Setting.of(_client(lm, private[:2], protocol=FedAvg(batch_size=1)))
    assert "fedavg='unknown'" in LearnedInversion.applicable(fedavg, ThreatModel(fedavg="unknown", aux=aux))
    assert LearnedInversion.applicable(fedavg, threat) is None
    dp = replace(setting, defense_config={"kind": "dpsgd", "noise_multiplier": 0.5, "max_grad_norm": 1.0})
    assert LearnedInversion.applicable(dp, threat) is None  # DP-SGD is simulated as augmentation
    floats = ThreatModel(aux=(aux.images.float(), aux.labels))
    assert "token ids" in LearnedInversion.applicable(setting, floats)
    short = ThreatModel(aux=AuxData(aux.images[:, :6], next_token_labels(aux.images[:, :6])))
    assert "(6,), the client's (8,)" in LearnedInversion.applicable(setting, short)
    wrong_labels = ThreatModel(aux=AuxData(aux.images, aux.labels[:, 0]))
    assert "next-token targets" in LearnedInversion.applicable(setting, wrong_labels)
    with_ood = ThreatModel(aux=AuxData(aux.images, aux.labels, ood=torch.rand(4, L)))
    assert "aux.ood" in LearnedInversion.applicable(setting, with_ood)


def test_hash_dim_is_absolute_for_images_and_text(lm, data, few):
    """``hash_dim`` overrides ``hash_ratio`` for an image client too; ``text_hash_dim`` wins for text."""
    from guardfl.redteam.modality.image.models import LeNetZhu

    torch.manual_seed(0)
    lenet = LeNetZhu((1, 12, 12), 4)
    x, y = torch.rand(40, 1, 12, 12), torch.arange(40) % 4
    infos = []
    attacks.get("learned_inversion", hidden=8, epochs=1, hash_dim=300, hash_ratio=0.9, seed=0, device="cpu").prepare(
        Setting.of(simulate_client(lenet, x[:1], y[:1])), ThreatModel(aux=(x[1:], y[1:])), on_done=infos.append)
    assert infos[0]["hash_dim"] == 300
    text = Setting.of(_client(lm, data[0][:1]))
    attacks.get("learned_inversion", **{**TINY, "text_hash_dim": None, "hash_dim": 123}).prepare(text, few, on_done=infos.append)
    attacks.get("learned_inversion", **{**TINY, "hash_dim": 123}).prepare(text, few, on_done=infos.append)
    assert infos[1]["hash_dim"] == 123 and infos[2]["hash_dim"] == TINY["text_hash_dim"]


@pytest.mark.parametrize("defense", [None, {"kind": "gradprune", "ratio": 0.9}])
def test_the_simulators_chunks_of_a_causal_lm_equal_the_client_simulation(defense):
    """``TransmitSimulator.chunks`` with (N, B, L) next-token labels, two to a chunk: every row is what the
    real client path transmits for that batch."""
    from guardfl.redteam.client.transmit import TransmitSimulator, flatten_update

    torch.manual_seed(0)
    model = Transformer3(vocab_size=1000, context=16)
    ids = markov(6, L).view(3, 2, L)
    labels = next_token_labels(ids.view(6, L)).view(3, 2, L)
    protocol = FedAvg(epochs=1, batch_size=2, lr=0.1) if defense is None else FedSGD()
    sim = TransmitSimulator(model, defense, protocol, chunk=2)
    rows = list(sim.chunks(ids, labels))
    assert [r.shape[0] for r in rows] == [2, 1]
    for i, row in enumerate(torch.cat(rows)):
        obs = simulate_client(model, ids[i], labels[i], defense, sim.protocol)
        torch.testing.assert_close(row, flatten_update(obs.update, sim.names), atol=2e-6, rtol=1e-5)
