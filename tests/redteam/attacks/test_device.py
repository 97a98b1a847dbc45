"""The attacks' device plumbing, checked without a GPU: on PyTorch's ``meta`` device.

A meta tensor has a shape and a device but no data. An operation mixing it with a CPU tensor raises the
same "not on the expected device" error that CUDA raises for a CPU tensor, and anything that reads a value
back to the host (``.item()``, ``float()``, ``.cpu()``) raises "no data". So running an attack with
``device="meta"`` shows on a CPU (CI has no GPU) that

- every tensor the attack computes with lives on the attack's device (the observation, the granted labels,
  soft labels of an encoding, BatchNorm statistics, masks of a known defense), and
- its inner loop reads nothing back to the host: the batched optimiser runs to the end, and an attack
  fails only where it reads its final result back (after the loop).

The same code then runs on CUDA (``bench/bench_paper_configs.py`` on a GPU machine).
"""

import re

import pytest
import torch

from guardfl.defenses import DPSGD, GradPrune, InstaHide, Outpost
from guardfl.redteam import FedAvg, ThreatModel, attacks, simulate_client
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.optimisation.optimiser import optimise_batched
from guardfl.redteam.modality.image.models import resnet18_cifar

META = torch.device("meta")
#: what meta tensors raise when a value is read back to the host (allowed only after the inner loop; a
#: defense reads back one flag per application: its fail-closed check for non-finite gradients)
READBACK = re.compile(r"meta tensors|no data|meta tensor|nonzero\(\) raises unimplemented")


def _reaches_readback(fn) -> str:
    """Run ``fn``; it may stop only where it reads a value back, never on a device mismatch."""
    try:
        fn()
    except (RuntimeError, NotImplementedError) as err:
        message = str(err)
        assert READBACK.search(message), message  # a device mismatch, or any other failure, fails here
        return message
    return "finished"


@pytest.mark.parametrize("name", ["dlg", "idlg", "inverting_gradients", "gradinversion", "cocktail_party"])
def test_each_attack_computes_on_its_device(name, wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([2]))
    threat = ThreatModel(labels="inferred" if name == "idlg" else "known")
    attack = attacks.get(name, device="meta", seed=0, iterations=3,
                         **({"restarts": 2} if name in ("inverting_gradients", "gradinversion") else {}))
    _reaches_readback(lambda: attack.reconstruct(obs, threat))


@pytest.mark.parametrize("defense", [GradPrune(0.9, seed=0), Outpost(seed=0)], ids=["pruned", "outpost"])
def test_known_defense_objectives_and_fedavg_run_on_the_device(defense, wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:2], torch.tensor([2, 5]), defense,
                          protocol=FedAvg(epochs=1, batch_size=1, lr=0.01))
    attack = attacks.get("inverting_gradients", device="meta", seed=0, iterations=3, restarts=2)
    _reaches_readback(lambda: attack.reconstruct(obs, ThreatModel(labels="known")))


def test_soft_labels_of_an_encoding_and_dp_clipping_run_on_the_device(wide_lenet, faces):
    from guardfl.redteam.attacks.analytic.encoded import attack_view

    obs = simulate_client(wide_lenet, faces[:4], torch.tensor([0, 1, 2, 3]), InstaHide(k=2, seed=0))
    view = attack_view(obs, True)
    attack = attacks.get("gradinversion", device="meta", seed=0, iterations=3, restarts=2)
    _reaches_readback(lambda: attack.reconstruct(view, ThreatModel(labels="known")))
    dp = simulate_client(wide_lenet, faces[:2], torch.tensor([0, 1]), DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0))
    _reaches_readback(lambda: attack.reconstruct(dp, ThreatModel(labels="known")))


def test_batchnorm_prior_of_gradinversion_runs_on_the_device(faces):
    torch.manual_seed(0)
    model = resnet18_cifar((1, 25, 25), 10)
    obs = simulate_client(model, faces[:2], torch.tensor([2, 5]))
    attack = attacks.get("gradinversion", device="meta", seed=0, iterations=3, restarts=2)
    _reaches_readback(lambda: attack.reconstruct(obs, ThreatModel(labels="known", bn="exact")))


def test_the_batched_optimiser_never_syncs_with_the_host(wide_lenet, faces):
    """The whole inner loop (vmapped objective, backward, Adam, schedule, group anchor) runs on meta."""
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([2])).to(META)
    knowledge = ThreatModel(labels="known").knowledge(obs).to(META)
    replica = Replica(obs, knowledge, ObjectiveWeights("cosine", tv=1e-2, group=1e-2), META)
    steps = []
    x = optimise_batched(lambda x, a: replica.objective(x, knowledge.labels, a), torch.zeros(3, 1, 1, 25, 25, device=META),
                         iterations=20, lr=0.1, bounds=(0, 1), group_every=5, progress=steps.append)
    assert x.device == META and len(steps) == 20


def test_knowledge_moves_labels_and_batchnorm_statistics(faces):
    torch.manual_seed(0)
    obs = simulate_client(resnet18_cifar((1, 25, 25), 10), faces[:2], torch.tensor([2, 5]))
    k = ThreatModel(labels="known", bn="exact").knowledge(obs)
    moved = k.to(META)
    assert moved.labels.device == META and all(m.device == META and v.device == META for m, v in moved.bn_target)
    assert k.labels.device.type == "cpu"  # the original is untouched


@pytest.mark.parametrize("defense", [None, GradPrune(0.5, seed=0)], ids=["none", "pruned"])
def test_learned_inversion_trains_on_the_device(defense, wide_lenet, faces):
    """Simulated defended updates of the auxiliary data and a whole epoch of the inverter's training
    (one readback per epoch, for the loss curve) run on the attack's device."""
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([2]), defense)
    threat = ThreatModel(labels="known", aux=(faces[10:60], torch.arange(50) % 10))
    attack = attacks.get("learned_inversion", device="meta", hidden=16, epochs=2, batch=8, seed=0)
    message = _reaches_readback(lambda: attack.reconstruct(obs, threat))
    assert message != "finished"


def test_attacks_run_in_exact_float32_and_restore_the_callers_settings(wide_lenet, faces):
    """TF32 (cuDNN's default for float32 convolutions on CUDA) is off while an attack prepares and
    reconstructs, and the caller's flags come back afterwards (the flags exist on a CPU build too)."""
    from guardfl.redteam.attacks.optimisation import inverting_gradients as ig

    seen = []
    original = ig.optimise_batched

    def spy(*args, **kwargs):
        seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32))
        return original(*args, **kwargs)

    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([2]))
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, True
    try:
        ig.optimise_batched = spy
        attacks.get("inverting_gradients", iterations=2, restarts=2, seed=0, device="cpu").reconstruct(obs, ThreatModel(labels="known"))
        assert seen == [(False, False)]
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True)
    finally:
        ig.optimise_batched = original
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("name", ["inverting_gradients", "gradinversion", "cocktail_party"])
def test_samples_batched_in_one_call_run_on_the_device(name, wide_lenet, faces):
    """``reconstruct_many``'s batched loop (samples x restarts, each sample's own target and anchor;
    CPA's feature inversion of every sample) moves every target to the device and reads nothing back."""
    observations = [simulate_client(wide_lenet, faces[i : i + 1], torch.tensor([i])) for i in range(3)]
    attack = attacks.get(name, device="meta", iterations=3, restarts=2,
                         **({"group_every": 2} if name == "gradinversion" else {}))
    if name == "cocktail_party":  # its ICA reads values back per sample: the batched part on its own
        moved = observations[0].to(META)
        zs = [torch.rand(1, moved.model.fc.in_features, device=META) for _ in observations]
        gens = [torch.Generator().manual_seed(s) for s in range(3)]
        message = _reaches_readback(lambda: attack._invert_features_many(moved, moved.model.fc, zs, META, gens))
        assert message != "finished"
        return
    message = _reaches_readback(lambda: attack.reconstruct_many(observations, ThreatModel(labels="known"), [0, 1, 2]))
    assert message != "finished"  # it stopped where it reads its winners back, after the loop


def test_the_batched_optimiser_over_samples_never_syncs_with_the_host(wide_lenet, faces):
    from guardfl.redteam.attacks.optimisation.targets import observation_target, stack_targets

    observations = [simulate_client(wide_lenet, faces[i : i + 1], torch.tensor([i])).to(META) for i in range(3)]
    knowledge = [ThreatModel(labels="known").knowledge(o).to(META) for o in observations]
    replica = Replica(observations[0], knowledge[0], ObjectiveWeights("cosine", tv=1e-2, group=1e-2), META)
    targets = stack_targets([{**observation_target(o, k, False, META), "labels": k.labels} for o, k in zip(observations, knowledge)])
    steps = []
    x = optimise_batched(lambda x, a, t: replica.objective(x, t["labels"], a, t), torch.zeros(3, 2, 1, 1, 25, 25, device=META),
                         iterations=20, lr=0.1, bounds=(0, 1), group_every=5, progress=steps.append, targets=targets)
    assert x.device == META and x.shape == (3, 2, 1, 1, 25, 25) and len(steps) == 20


# --- text attacks -------------------------------------------------------------------------------------


def _text_client(kind: str, batch: int, defense=None):
    from guardfl.redteam.modality.text.models import next_token_labels
    from tests.textmodels import LENGTH, VOCAB, make

    model = make(kind)
    x = torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(1))
    y = torch.arange(batch) % 3 if kind == "classifier" else next_token_labels(x)
    return simulate_client(model, x, y, defense)


@pytest.mark.parametrize("kind, labels, defense", [
    ("causal-lm", "tied", None), ("causal-lm", "known", None), ("causal-lm-tied", "known", None),
    ("classifier", "known", None), ("causal-lm", "tied", "prune"), ("causal-lm", "known", "sign"),
])
def test_tag_inner_loop_never_syncs_with_the_host(kind, labels, defense):
    """TAG's loop (the replica's L2 + L1 distance, masked for a pruned update, the hinge for a sign-compressed
    one, soft labels tied to the guess, Adam with warm-up and cosine decay) runs on meta to the end. Its
    data-dependent setup (the token bag, the embedding scale) reads back once, before the loop."""
    from guardfl.defenses import SignCompression
    from guardfl.redteam.attacks.text.tag import _without, optimise_embeddings, tag_objective
    from guardfl.redteam.modality.text.models import embedding_names

    chosen = {None: None, "prune": GradPrune(0.9, seed=0), "sign": SignCompression()}[defense]
    obs = _text_client(kind, 1, chosen)
    view = _without(obs, embedding_names(obs.model)[0]).to(META)
    knowledge = ThreatModel(labels="known").knowledge(view).to(META)
    replica = Replica(view, knowledge, ObjectiveWeights(distance="tag", tag_alpha=0.1), META)
    table = view.model.get_input_embeddings().weight.detach()
    bag = torch.arange(7, device=META)
    objective = tag_objective(replica, None if labels == "tied" else knowledge.labels, table[bag], bag,
                              obs.num_classes, 1.0)
    steps = []
    e = optimise_embeddings(objective, torch.zeros(1, *obs.input_shape, table.shape[1], device=META),
                            iterations=6, lr=0.05, warmup=2, step=steps.append)
    assert e.device == META and len(steps) == 6


@pytest.mark.parametrize("kind", ["causal-lm", "classifier"])
def test_learned_inversion_for_tokens_trains_on_the_device(kind):
    """Simulated updates of the auxiliary sequences, their count sketch and a whole epoch of the token
    inverter's training run on the attack's device: the first read-back is the epoch's mean loss."""
    import traceback

    from guardfl.redteam.auxdata import AuxData
    from guardfl.redteam.modality.text.models import next_token_labels
    from tests.textmodels import LENGTH, VOCAB

    obs = _text_client(kind, 1)
    ax = torch.randint(0, VOCAB, (40, LENGTH), generator=torch.Generator().manual_seed(2))
    ay = torch.arange(40) % 3 if kind == "classifier" else next_token_labels(ax)
    attack = attacks.get("learned_inversion", device="meta", seed=0, epochs=2, batch=8)
    try:
        attack.reconstruct(obs, ThreatModel(labels="known", aux=AuxData(ax, ay, name="aux")))
    except RuntimeError as err:
        assert READBACK.search(str(err)), err
        where = traceback.extract_tb(err.__traceback__)[-2]  # the frame that read back (the last is torch's)
        assert where.name == "train_inverter" and "losses.append" in where.line, where  # the epoch's loss
    else:
        raise AssertionError("a meta run cannot finish: its result is read back")
