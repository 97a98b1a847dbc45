"""The attacks are real: they recover real faces without a defense, and do clearly worse against one."""

import pytest
import torch

from guardfl.defenses import GradPrune, SignCompression
from guardfl.errors import ConfigError
from guardfl.redteam import FedAvg, FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks.optimisation.optimiser import optimise_batched
from guardfl.redteam.modality.image.models import ConvNetSmall


def _ssim(rec, x):
    return metrics.evaluate(rec, x)["summary"]["ssim"]["best"]


def test_dlg_recovers_a_face_and_defenses_hurt_it(wide_lenet, faces):
    x, y = faces[3:4], torch.tensor([2])
    dlg = attacks.get("dlg", iterations=200, seed=0)
    clear = dlg.reconstruct(simulate_client(wide_lenet, x, y), ThreatModel())
    assert _ssim(clear, x) >= 0.6
    assert int(clear.labels) == 2  # DLG optimised the label jointly and found it
    for defense in (GradPrune(0.99, seed=0), SignCompression()):
        defended = dlg.reconstruct(simulate_client(wide_lenet, x, y, defense), ThreatModel())
        assert _ssim(defended, x) < _ssim(clear, x) - 0.3


def test_idlg_restores_the_label_and_refuses_batches(wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([7]))
    assert int(attacks.infer_labels(obs)) == 7
    rec = attacks.get("idlg", iterations=50, seed=0).reconstruct(obs)
    assert rec.info["labels"] == "inferred" and int(rec.labels) == 7
    batch = simulate_client(wide_lenet, faces[:2], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="at most 1 sample"):
        attacks.get("idlg").reconstruct(batch)


def test_batch_label_restoration_with_distinct_labels(wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:3], torch.tensor([5, 1, 8]))
    assert sorted(attacks.infer_labels(obs).tolist()) == [1, 5, 8]


def test_inverting_gradients_winner_is_chosen_by_its_objective(wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([2]))
    rec = attacks.get("inverting_gradients", iterations=60, restarts=3, seed=1).reconstruct(obs)
    assert rec.objective == min(rec.restart_objectives) and len(rec.restart_objectives) == 3
    assert rec.inputs.shape == (1, 1, 25, 25) and 0 <= float(rec.inputs.min()) <= float(rec.inputs.max()) <= 1


def test_batched_restarts_equal_sequential_restarts(wide_lenet, faces):
    from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica

    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([2]))
    knowledge = ThreatModel(labels="known").knowledge(obs)
    replica = Replica(obs, knowledge, ObjectiveWeights("cosine", tv=1e-2), torch.device("cpu"))
    labels = knowledge.labels
    f = lambda x, a: replica.objective(x, labels, a)  # noqa: E731
    x0 = torch.rand(3, 1, 1, 25, 25, generator=torch.Generator().manual_seed(0))
    batched = optimise_batched(f, x0, iterations=25, lr=0.1, bounds=(0, 1))
    for r in range(3):
        alone = optimise_batched(f, x0[r : r + 1], iterations=25, lr=0.1, bounds=(0, 1))
        assert torch.allclose(batched[r], alone[0], atol=1e-5)


def test_fedavg_update_matching_recovers_both_samples(wide_lenet, faces):
    """Outpost paper scenario 2 (E=1, n=2, B=1) on the worst-case wide init: delta matching works."""
    x, y = faces[:2], torch.tensor([1, 2])
    obs = simulate_client(wide_lenet, x, y, None, FedAvg(epochs=1, batch_size=1, lr=0.1))
    rec = attacks.get("dlg", iterations=200, seed=0).reconstruct(obs, ThreatModel(labels="known"))
    assert rec.inputs.shape == x.shape
    assert metrics.evaluate(rec, x)["summary"]["ssim"]["worst"] > 0.6


def test_gradinversion_with_exact_bn_prior(faces):
    torch.manual_seed(0)
    model = ConvNetSmall((1, 25, 25), 10)
    x, y = faces[:2], torch.tensor([0, 1])
    obs = simulate_client(model, x, y)
    rec = attacks.get("gradinversion", iterations=30, restarts=2, group_every=10, seed=0).reconstruct(
        obs, ThreatModel(labels="known", bn="exact")
    )
    assert rec.inputs.shape == x.shape and len(rec.restart_objectives) == 2


def test_registry_and_budget_errors():
    assert {"dlg", "idlg", "inverting_gradients", "gradinversion"} <= set(attacks.available())
    with pytest.raises(ConfigError, match="unknown attack 'telepathy'"):
        attacks.get("telepathy")
    with pytest.raises(ConfigError, match="inverting_gradients.restarts"):
        attacks.get("inverting_gradients", restarts=0)
    with pytest.raises(ConfigError, match=r"gradinversion.restarts.*greater than or equal to 2.*allowed: an integer in \[2, 64\]"):
        attacks.get("gradinversion", restarts=1)


def test_inferred_labels_refuse_batches_larger_than_the_classes(faces):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(625, 2))
    obs = simulate_client(model, faces[:3], torch.tensor([0, 1, 0]), protocol=FedSGD())
    with pytest.raises(ValueError, match="at most 2 sample"):
        attacks.get("inverting_gradients").reconstruct(obs)
