"""TAG (Deng et al. 2021) on text models: its distance is the paper's L2 + alpha * w_l * L1 (value and
gradient), the token bag it reads from the embedding gradient is exactly the batch's tokens, it recovers
most of a private sentence of a small causal LM (tied or known labels) and of a classifier, it runs under
pruning and FedAvg, it stays on its modality, and its restarts are judged by the objective alone."""

from dataclasses import replace

import pytest
import torch

from guardfl.defenses import GaussianNoise, GradPrune, SignCompression
from guardfl.redteam import FedAvg, ThreatModel, attacks, simulate_client
from guardfl.redteam.attacks.optimisation import objectives as obj
from guardfl.redteam.attacks.base import NotApplicable
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.attacks.text.tag import TAG, token_bag
from guardfl.redteam.modality.image.models import LeNetZhu
from guardfl.redteam.modality.text.models import TextClassifier, Transformer3, next_token_labels

V, L = 500, 8


def _lm(seed: int = 0, vocab: int = V) -> Transformer3:
    torch.manual_seed(seed)
    return Transformer3(vocab_size=vocab, context=32)


def _sentence(n: int = 1, seed: int = 1, vocab: int = V) -> torch.Tensor:
    """``n`` rows of ``L`` distinct token ids (no id repeats anywhere, so the bag is unambiguous)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: n * L].reshape(n, L)


def _token_acc(rec: torch.Tensor, x: torch.Tensor) -> float:
    return float((rec == x).float().mean())


def _bag_recall(rec: torch.Tensor, x: torch.Tensor) -> float:
    """Multiset recall of the private tokens (order ignored)."""
    from collections import Counter

    got, truth = Counter(rec.flatten().tolist()), Counter(x.flatten().tolist())
    return sum((got & truth).values()) / sum(truth.values())


# ------------------------------------------------------------------------------------------ (a) distance
def _reference(sim, obs, masks, alpha, signed):
    """TAG's distance written out with autograd: sum_l ||d_l||^2 + alpha * w_l * ||d_l||_1."""
    w = obj.tag_weights(len(sim))
    total = 0.0
    for i, (s, o) in enumerate(zip(sim, obs)):
        d = torch.relu(-s * o) if signed else s - o
        if masks is not None:
            d = d * masks[i]
        total = total + d.pow(2).sum() + alpha * float(w[i]) * d.abs().sum()
    return total


def _layers(gen, shapes, **kw):
    return [torch.randn(*s, generator=gen, dtype=torch.float64, **kw) for s in shapes]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("signed", [False, True])
def test_tag_distance_equals_the_autograd_reference_in_value_and_gradient(masked, signed):
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 4), (4,), (3, 5), (5,)]
    sim = [t.requires_grad_(True) for t in _layers(gen, shapes)]
    obs = _layers(gen, shapes)
    for o in obs:
        o[o.abs() < 0.6] = 0.0  # a pruned update: zeros where the client dropped coordinates
    if signed:
        obs = [o.sign() for o in obs]
    masks = [o != 0 for o in obs] if masked else None
    alpha = 0.3
    value = obj.tag_distance_layers(sim, obs, masks, alpha, signed=signed)
    ref = _reference(sim, obs, masks, alpha, signed)
    assert value.dtype == torch.float64
    assert torch.allclose(value, ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(value, sim)
    g_ref = torch.autograd.grad(ref, sim)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    if masked:  # nothing off the mask moves
        assert all(bool((a[~m] == 0).all()) for a, m in zip(g, masks))
    # the one-pass backward against finite differences (away from the L1 kink: d != 0 almost surely)
    assert torch.autograd.gradcheck(lambda *s: obj.tag_distance_layers(list(s), obs, masks, alpha, signed=signed),
                                    tuple(sim))


def test_tag_distance_is_zero_at_the_observed_update_and_alpha_zero_is_l2():
    gen = torch.Generator().manual_seed(1)
    obs = _layers(gen, [(5, 3), (3,)])
    assert float(obj.tag_distance_layers(obs, obs, None, 0.1)) == 0.0
    sim = _layers(gen, [(5, 3), (3,)])
    assert torch.allclose(obj.tag_distance_layers(sim, obs, None, 0.0), obj.l2_distance_layers(sim, obs))


def test_tag_weights_decrease_from_one():
    for n in (1, 2, 5, 12):
        w = obj.tag_weights(n)
        assert w.shape == (n,) and float(w[0]) == 1.0 and float(w.min()) > 0
        assert bool((w[1:] < w[:-1]).all())


# --------------------------------------------------------------------------------------------- (b) bag
@pytest.fixture(scope="module")
def lm_batch():
    """Two sequences; one token appears only at the first row's last position (no target, no gradient),
    one token at the first row's last position AND inside the second row (it has a gradient there)."""
    x = _sentence(2, seed=3)
    x[1, 3] = x[0, -2]  # a repeat, counted once in the bag
    only_last = int(x[0, -1])
    x[1, 0] = x[1, -1]  # row 1's last token also opens row 1: in the bag
    expected = sorted(set(x[:, :-1].flatten().tolist()))
    assert only_last not in expected and int(x[1, -1]) in expected
    return _lm(), x, expected


def test_token_bag_is_the_batch_tokens_except_those_seen_only_last(lm_batch):
    model, x, expected = lm_batch
    obs = simulate_client(model, x, next_token_labels(x))
    rows = obs.update["token.weight"]
    assert token_bag(rows, x.numel()).tolist() == expected
    # sign compression keeps the zero rows zero: the same bag
    signed = simulate_client(model, x, next_token_labels(x), SignCompression())
    assert token_bag(signed.update["token.weight"], x.numel()).tolist() == expected


def test_token_bag_under_noise_takes_the_rows_that_stand_out(lm_batch):
    model, x, expected = lm_batch
    noisy = simulate_client(model, x, next_token_labels(x), GaussianNoise(1e-3, seed=0))
    rows = noisy.update["token.weight"]
    assert bool((rows.norm(dim=1) > 0).all())  # noise: every row non-zero, the z-score path
    bag = token_bag(rows, x.numel())
    assert bag is not None and len(bag) <= x.numel()
    found = set(bag.tolist())
    assert len(found & set(expected)) / len(expected) >= 0.9  # recall
    assert len(found & set(expected)) / len(found) >= 0.9  # mostly true tokens
    top = token_bag(rows, 3)  # at most ``most``: the largest rows
    assert len(top) == 3 and set(top.tolist()) <= found
    # drowned in noise: nothing stands out
    drowned = simulate_client(model, x, next_token_labels(x), GaussianNoise(0.1, seed=0))
    assert token_bag(drowned.update["token.weight"], x.numel()) is None
    pure = torch.randn(V, 96, generator=torch.Generator().manual_seed(0))
    assert token_bag(pure, 16) is None


# -------------------------------------------------------------------------------------- (c) end to end
def test_tag_recovers_a_sentence_of_a_small_causal_lm_with_tied_labels():
    model, x = _lm(), _sentence()
    obs = simulate_client(model, x, next_token_labels(x))
    rec = attacks.get("tag", iterations=200, seed=0).reconstruct(obs, ThreatModel(labels="inferred"))
    assert rec.info["labels"] == "tied" and rec.info["bag"] == L - 1  # the last token has no gradient row
    assert rec.inputs.shape == (1, L) and rec.inputs.dtype == torch.long
    # 7 of 8 is the most: the last token is in no gradient row; chance is 1/7 within the bag, 1/500 without
    assert _bag_recall(rec.inputs, x) >= 0.75
    assert _token_acc(rec.inputs, x) >= 0.5
    assert torch.equal(rec.labels, next_token_labels(rec.inputs))  # the labels are the guess's own next tokens


def test_tag_recovers_a_sentence_with_known_labels():
    model, x = _lm(seed=1, vocab=200), _sentence(seed=2, vocab=200)
    obs = simulate_client(model, x, next_token_labels(x))
    rec = attacks.get("tag", iterations=150, seed=0).reconstruct(obs, ThreatModel(labels="known"))
    assert rec.info["labels"] == "known"
    assert _token_acc(rec.inputs, x) >= 0.75 and _bag_recall(rec.inputs, x) >= 0.75
    assert torch.equal(rec.labels, next_token_labels(x))


def test_tag_recovers_a_classifier_sentence_and_its_label():
    torch.manual_seed(0)
    model = TextClassifier(vocab_size=V, num_classes=2, context=32)
    x, y = _sentence(seed=4), torch.tensor([1])
    obs = simulate_client(model, x, y)
    rec = attacks.get("tag", iterations=250, seed=0).reconstruct(obs, ThreatModel(labels="inferred"))
    assert rec.info["labels"] == "inferred" and rec.labels.tolist() == [1]
    assert rec.info["bag"] == L  # a classifier's every position has a gradient
    assert _token_acc(rec.inputs, x) >= 0.75 and _bag_recall(rec.inputs, x) >= 0.75


def test_tag_runs_under_pruning_and_fedavg_and_returns_token_ids():
    model = _lm(vocab=200)
    x = _sentence(seed=5, vocab=200)
    pruned = simulate_client(model, x, next_token_labels(x), GradPrune(0.9, seed=0))
    rec = attacks.get("tag", iterations=15, seed=0).reconstruct(pruned, ThreatModel(labels="inferred"))
    assert rec.inputs.shape == (1, L) and rec.inputs.dtype == torch.long
    assert 0 <= int(rec.inputs.min()) and int(rec.inputs.max()) < 200
    two = _sentence(2, seed=6, vocab=200)
    fedavg = simulate_client(model, two, next_token_labels(two), protocol=FedAvg(epochs=1, batch_size=1, lr=0.1))
    rec = attacks.get("tag", iterations=8, seed=0).reconstruct(fedavg, ThreatModel(labels="inferred"))
    assert rec.inputs.shape == (2, L) and rec.inputs.dtype == torch.long and rec.labels.shape == (2, L)
    assert 0 <= int(rec.inputs.min()) and int(rec.inputs.max()) < 200 and rec.objective == rec.objective  # finite


# ---------------------------------------------------------------------------------------- (d) modality
def test_tag_is_for_text_and_image_attacks_are_not(faces):
    torch.manual_seed(0)
    image_obs = simulate_client(LeNetZhu((1, 25, 25), 10), faces[:1], torch.tensor([3]))
    reason = TAG.applicable(Setting.of(image_obs), ThreatModel())
    assert reason is not None and "text" in reason and "image" in reason
    with pytest.raises(NotApplicable, match="text"):
        attacks.get("tag", iterations=1).reconstruct(image_obs)

    x = _sentence(vocab=200)
    text_obs = simulate_client(_lm(vocab=200), x, next_token_labels(x))
    text_setting = Setting.of(text_obs)
    assert text_setting.modality == "text" and TAG.applicable(text_setting, ThreatModel()) is None
    image_only = [name for name, cls in attacks.ATTACKS.items() if "text" not in cls.capabilities.modalities]
    assert {"dlg", "idlg", "inverting_gradients"} <= set(image_only)
    for name in image_only:
        reason = attacks.ATTACKS[name].applicable(text_setting, ThreatModel(labels="known"))
        assert reason is not None and "image" in reason and "text" in reason, (name, reason)
    with pytest.raises(NotApplicable, match="image"):
        attacks.get("dlg", iterations=1).reconstruct(text_obs)


# ---------------------------------------------------------------------------------------- (e) restarts
def test_restarts_are_judged_by_the_objective_never_the_ground_truth():
    model, x = _lm(vocab=200), _sentence(seed=7, vocab=200)
    obs = simulate_client(model, x, next_token_labels(x))
    tag = attacks.get("tag", iterations=25, restarts=3, seed=0)
    rec = tag.reconstruct(obs, ThreatModel(labels="inferred"))
    objectives = rec.restart_objectives
    assert len(objectives) == 3 and len(set(objectives)) == 3  # different restarts, different ends
    assert rec.info["winner"] == min(range(3), key=objectives.__getitem__)
    assert rec.objective == objectives[rec.info["winner"]] == min(objectives)
    # what never leaves the client (its true next tokens, its content hashes) changes nothing
    blind = replace(obs, side=replace(obs.side, labels=torch.zeros_like(obs.side.labels), input_hashes=()))
    again = tag.reconstruct(blind, ThreatModel(labels="inferred"))
    assert torch.equal(again.inputs, rec.inputs) and again.restart_objectives == objectives
    assert again.info["winner"] == rec.info["winner"]
