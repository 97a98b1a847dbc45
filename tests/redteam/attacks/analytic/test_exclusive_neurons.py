"""Exclusively activated neurons: the maths of the reading, the check that claims only real samples, peeling,
the defenses it adapts to, and where it does not apply."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guardfl.redteam import FedAvg, ThreatModel, attacks, simulate_client
from guardfl.redteam.attacks import ExclusiveNeurons, NotApplicable, Setting
from guardfl.redteam.attacks.analytic import exclusive
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import FC2, FC2BN, LeNetZhu, set_model_state

KNOWN = ThreatModel(labels="known", defense="known")


@pytest.fixture(scope="module")
def faces():
    x, y = lfw_faces(10)
    return x[:64], y[:64]


def _fc2(seed: int) -> FC2:
    torch.manual_seed(seed)
    return FC2((1, 25, 25), 10)


def _nearest(images: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image: its largest absolute difference to the nearest private image, and that image's index."""
    diff = (images.flatten(1)[:, None] - truth.flatten(1)[None]).abs().amax(2)
    return diff.min(1)


# -- the maths ------------------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31), units=st.integers(2, 12), samples=st.integers(1, 5))
@settings(max_examples=30, deadline=None)
def test_a_unit_that_fires_for_one_sample_holds_it_and_peeling_removes_its_share(seed, units, samples):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(samples, 7, generator=gen, dtype=torch.float64)
    d = torch.randn(samples, units, generator=gen, dtype=torch.float64)
    fires = torch.rand(samples, units, generator=gen) < 0.5
    fires[:, 0] = False
    fires[0, 0] = True  # unit 0 fires for sample 0 alone
    d = d * fires
    weight, bias = d.T @ x, d.sum(0)
    rows, cands = exclusive.ratios(weight, bias, 0.0, scale=float(bias.abs().max()))
    assert 0 in rows.tolist()
    torch.testing.assert_close(cands[rows.tolist().index(0)], x[0])
    w2, b2 = exclusive.peel(weight, bias, d[:1], x[:1])
    torch.testing.assert_close(w2, d[1:].T @ x[1:])
    torch.testing.assert_close(b2, d[1:].sum(0))


def test_ratios_skip_units_without_mass():
    weight, bias = torch.ones(3, 4), torch.tensor([1.0, 1e-9, 0.0])
    rows, _ = exclusive.ratios(weight, bias, 1e-4)
    assert rows.tolist() == [0]
    rows, cands = exclusive.ratios(weight, torch.zeros(3), 1e-4)
    assert rows.numel() == 0 and cands.shape == (0, 4)


def test_distinct_keeps_the_first_of_near_copies_and_skips_those_already_kept():
    x = torch.tensor([[0.0, 0.0], [0.0, 1e-6], [1.0, 1.0], [0.5, 0.5]])
    assert exclusive.distinct(x, 1e-4).tolist() == [0, 2, 3]
    assert exclusive.distinct(x, 1e-4, keep=torch.tensor([[1.0, 1.0]])).tolist() == [0, 3]


def _distinct_naive(x, tol, keep=None):
    chosen = []
    for i in range(x.shape[0]):
        ref = [x[j] for j in chosen] + ([] if keep is None else list(keep))
        if any(float((r - x[i]).abs().max()) <= tol for r in ref):
            continue
        chosen.append(i)
    return chosen


@given(seed=st.integers(0, 2**31), rows=st.integers(0, 40), kept=st.integers(0, 5), tol=st.sampled_from([1e-4, 0.05, 0.3]))
@settings(max_examples=40, deadline=None)
def test_distinct_is_the_first_of_each_group_of_near_copies_as_a_pairwise_scan_finds_it(seed, rows, kept, tol):
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(6, 5, generator=gen, dtype=torch.float64)
    x = base[torch.randint(0, 6, (rows,), generator=gen)] + (torch.rand(rows, 5, generator=gen, dtype=torch.float64) - 0.5) * 2 * tol
    keep = base[:kept] if kept else None
    assert exclusive.distinct(x, tol, keep).tolist() == _distinct_naive(x, tol, keep)


@given(seed=st.integers(0, 2**31), bound=st.floats(0.05, 2.0))
@settings(max_examples=25, deadline=None)
def test_pruned_entries_are_filled_within_their_bound_and_kept_entries_are_untouched(seed, bound):
    gen = torch.Generator().manual_seed(seed)
    row = torch.rand(1 * 6 * 6, generator=gen, dtype=torch.float64) + 0.1
    row[torch.rand(36, generator=gen) < 0.5] = 0.0
    bias = 2.0
    missing, low, high = exclusive.pruned_bounds(row, bias, bound * bias, (0.0, 1.0))
    assert torch.equal(missing, row == 0)
    assert float(high.max()) <= min(1.0, bound) + 1e-12 and float(low.min()) >= 0.0
    image = (row / bias).view(1, 6, 6)
    filled = exclusive.inpaint(image, missing.view(1, 6, 6), low.view(1, 6, 6), high.view(1, 6, 6))
    keep = ~missing.view(1, 6, 6)
    assert torch.equal(filled[keep], image[keep])
    assert bool((filled[~keep] >= low.view(1, 6, 6)[~keep]).all() and (filled[~keep] <= high.view(1, 6, 6)[~keep]).all())


# -- the attack against the client's real update ------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_every_checked_sample_is_a_private_image_with_its_label(faces, seed):
    """The check claims only real samples (each within float error of one private face, with that face's
    label): 27 and 8 of 64 faces in [0, 1] on FC-2 at two initialisations, undefended."""
    x, y = faces
    obs = simulate_client(_fc2(seed), x, y, None)
    rec = attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
    checked = rec.info["checked"]
    assert checked >= 5
    diff, index = _nearest(rec.inputs[:checked], x)
    assert float(diff.max()) < 1e-3
    assert len(set(index.tolist())) == checked  # distinct faces
    assert torch.equal(rec.labels[:checked], y[index])
    assert rec.inputs.shape == x.shape and rec.labels.shape == y.shape
    assert rec.objective == 64 - checked


def test_peeling_reads_faces_no_unit_held_alone_at_first(faces):
    x, y = faces
    obs = simulate_client(_fc2(0), x, y, None)
    once = attacks.get("exclusive_neurons", rounds=1).reconstruct(obs, KNOWN)
    peeled = attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
    assert peeled.info["rounds"] > 1 and peeled.info["checked"] > once.info["checked"] + 5


def test_inferred_labels_check_against_every_class(faces):
    x, y = faces
    obs = simulate_client(_fc2(0), x, y, None)
    rec = attacks.get("exclusive_neurons").reconstruct(obs, ThreatModel(labels="inferred"))
    checked = rec.info["checked"]
    assert checked >= 5 and rec.info["label_source"] == "inferred"
    diff, index = _nearest(rec.inputs[:checked], x)
    assert float(diff.max()) < 1e-3 and torch.equal(rec.labels[:checked], y[index])


@pytest.mark.parametrize("defense", [{"kind": "gaussian", "sigma": 0.01}, {"kind": "soteria"},
                                     {"kind": "gradprune", "ratio": 0.9}, {"kind": "sign"}])
def test_a_defended_update_gets_no_false_claim(faces, defense):
    """Against defenses that change the layer's update, whatever the check accepts is still a private
    face (none is accepted here: the checks fail, the candidates are returned unchecked)."""
    x, y = faces
    obs = simulate_client(_fc2(0), x, y, defense)
    rec = attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
    checked = rec.info["checked"]
    if checked:
        assert float(_nearest(rec.inputs[:checked], x)[0].max()) < 1e-3
    assert rec.inputs.shape == x.shape and bool(torch.isfinite(rec.inputs).all())
    assert float(rec.inputs.min()) >= 0.0 and float(rec.inputs.max()) <= 1.0


def test_known_pruning_fills_the_pruned_pixels_within_their_bounds(faces):
    """GradPrune 0.9 zeroes most of a candidate's pixels; knowing it, the attacker fills them within
    the bound the smallest kept entry gives (never the zeros the pruning left), and keeps the rest."""
    x, y = faces
    obs = simulate_client(_fc2(0), x, y, {"kind": "gradprune", "ratio": 0.9})
    known = attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
    blind = attacks.get("exclusive_neurons").reconstruct(obs, ThreatModel(labels="known", defense="unknown"))
    k = known.info["unchecked"]
    assert k == blind.info["unchecked"] > 0
    zeros_blind = float((blind.inputs[:k] == 0).float().mean())
    zeros_known = float((known.inputs[:k] == 0).float().mean())
    assert zeros_blind > 0.5 and zeros_known < zeros_blind / 5
    kept = blind.inputs[:k] != 0
    torch.testing.assert_close(known.inputs[:k][kept], blind.inputs[:k][kept])


def test_fedavg_candidates_are_returned_unchecked(faces):
    x, y = faces
    obs = simulate_client(_fc2(0), x, y, None, FedAvg(epochs=2, batch_size=16, lr=0.1))
    rec = attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
    assert rec.info["checked"] == 0 and rec.info["unchecked"] > 0
    assert rec.inputs.shape == x.shape
    # units that fired for one sample in every step still hold it exactly
    assert int((_nearest(rec.inputs, x)[0] < 1e-3).sum()) >= 1


def test_centred_inputs_leave_few_exclusive_units(faces):
    x, y = faces
    xc = (x - x.mean()) / x.std()
    rng = (float(xc.min()), float(xc.max()))
    obs = simulate_client(_fc2(0), xc, y, None, input_range=rng)
    rec = attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
    assert rec.info["checked"] <= 2


# -- where it does not apply ------------------------------------------------------------------------------------
def _setting(model, n=4):
    x, y = lfw_faces(10)
    return Setting.of(simulate_client(model, x[:n], y[:n], None))


def test_not_applicable_without_a_dense_first_layer_or_through_a_normalisation():
    lenet = set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)
    assert "nn.Linear on the whole flattened input" in ExclusiveNeurons.applicable(_setting(lenet))
    torch.manual_seed(0)
    reason = ExclusiveNeurons.applicable(_setting(FC2BN((1, 25, 25), 10)))
    assert "BatchNorm1d before the ReLU" in reason and "no unit is exclusive" in reason
    assert ExclusiveNeurons.applicable(_setting(_fc2(0))) is None


def test_a_non_finite_update_is_refused_with_the_layer_named(faces):
    x, y = faces
    obs = simulate_client(_fc2(0), x[:4], y[:4], None)
    name = next(k for k in obs.update if k.endswith("bias"))
    obs.update[name] = obs.update[name].clone()
    obs.update[name][0] = float("nan")
    with pytest.raises(NotApplicable, match=f"{name}.*non-finite"):
        attacks.get("exclusive_neurons").reconstruct(obs, KNOWN)
