"""``reconstruct_many``: several private samples of one setting in one call, each its own result.

A sample's reconstruction depends on its observation and its seed only: a chunk of one is ``reconstruct``
bit for bit, a chunk of several gives every sample what its own call gives (up to float32 reduction order
of the batched kernels), whoever its chunk-mates are.
"""

import pytest
import torch

from guardfl.defenses import from_config
from guardfl.redteam import FedAvg, FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.attacks import Capabilities
from guardfl.redteam.modality.image.data import lfw_faces
from guardfl.redteam.modality.image.models import ConvNetSmall, FC2, build_model, set_model_state

KNOWN = ThreatModel(labels="known")
#: small budgets: a few seconds per test on 2 cores
BUDGETS = {
    "inverting_gradients": {"iterations": 20, "restarts": 3},
    "gradinversion": {"iterations": 20, "restarts": 3, "group_every": 5},
    "cocktail_party": {"iterations": 20, "lr": 1e-2, "restarts": 2, "fi_iterations": 20, "fi_restarts": 2},
}


@pytest.fixture(scope="module")
def lenet():
    return set_model_state(build_model("lenet", (1, 25, 25), 10), "wide-init", seed=0)


@pytest.fixture(scope="module")
def private():
    return lfw_faces()


def _clients(model, private, rows, defense=None, protocol=None, n=1):
    """One observation per private sample (or per group of ``n``), one client update each."""
    x, y = private
    return [simulate_client(model, x[r : r + n], y[r : r + n], from_config(defense) if defense else None, protocol or FedSGD())
            for r in rows]


def _alone(name, obs, seed, threat=KNOWN, **budget):
    return attacks.get(name, seed=seed, **{**BUDGETS.get(name, {}), **budget}).reconstruct(obs, threat)


def _assert_same(a, b, atol=1e-4):
    assert torch.allclose(a.inputs, b.inputs, atol=atol, rtol=0), float((a.inputs - b.inputs).abs().max())
    assert torch.equal(a.labels, b.labels)
    assert a.objective == pytest.approx(b.objective, rel=1e-4, abs=1e-6)
    assert a.restart_objectives == pytest.approx(b.restart_objectives, rel=1e-4, abs=1e-6)
    # the winner, how labels were had, CPA's layer and scale (its float diagnostics up to rounding)
    assert a.info.keys() == b.info.keys()
    for key, value in a.info.items():
        assert value == (pytest.approx(b.info[key], rel=1e-4, abs=1e-6) if isinstance(value, float) else b.info[key]), key


@pytest.mark.parametrize("name", list(BUDGETS))
def test_a_chunk_of_one_is_reconstruct_bit_for_bit(name, lenet, private):
    (obs,) = _clients(lenet, private, [4])
    (many,) = attacks.get(name, **BUDGETS[name]).reconstruct_many([obs], KNOWN, [7])
    alone = _alone(name, obs, 7)
    assert torch.equal(many.inputs, alone.inputs) and many.restart_objectives == alone.restart_objectives
    assert many.info == alone.info


@pytest.mark.parametrize("name", list(BUDGETS))
def test_each_sample_of_a_chunk_gets_its_own_calls_result(name, lenet, private):
    observations = _clients(lenet, private, [0, 1, 2])
    seeds = [10, 11, 12]
    many = attacks.get(name, **BUDGETS[name]).reconstruct_many(observations, KNOWN, seeds)
    assert len(many) == 3
    for obs, seed, rec in zip(observations, seeds, many):
        _assert_same(rec, _alone(name, obs, seed))


def test_a_samples_result_does_not_depend_on_its_chunk_mates(lenet, private):
    observations = _clients(lenet, private, [0, 1, 2, 3, 4])
    attack = attacks.get("gradinversion", **BUDGETS["gradinversion"])
    first = attack.reconstruct_many(observations[:3], KNOWN, [5, 6, 7])[0]
    others = attack.reconstruct_many([observations[3], observations[0], observations[4]], KNOWN, [8, 5, 9])[1]
    pair = attack.reconstruct_many([observations[2], observations[0]], KNOWN, [7, 5])[1]
    _assert_same(first, others)
    _assert_same(first, pair)


def test_seeds_default_to_the_attacks_seed_and_must_match_the_observations(lenet, private):
    observations = _clients(lenet, private, [0, 1])
    attack = attacks.get("inverting_gradients", seed=3, iterations=5, restarts=2)
    unseeded = attack.reconstruct_many(observations, KNOWN)
    seeded = attack.reconstruct_many(observations, KNOWN, [3, None])
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(unseeded, seeded))
    with pytest.raises(ValueError, match="1 seeds for 2 observations"):
        attack.reconstruct_many(observations, KNOWN, [3])
    assert attack.reconstruct_many([], KNOWN) == []


def test_observations_of_different_settings_are_refused(lenet, private):
    x, y = private
    base = simulate_client(lenet, x[:1], y[:1])
    other_weights = simulate_client(set_model_state(build_model("lenet", (1, 25, 25), 10), "wide-init", seed=1), x[1:2], y[1:2])
    defended = simulate_client(lenet, x[1:2], y[1:2], from_config({"kind": "gradprune", "ratio": 0.9}))
    two = simulate_client(lenet, x[1:3], y[1:3])
    fedavg = simulate_client(lenet, x[1:2], y[1:2], None, FedAvg(epochs=1, batch_size=1, lr=0.1))
    attack = attacks.get("inverting_gradients", seed=0, iterations=2, restarts=2)
    for other, why in [(other_weights, "weights"), (defended, "defense_config"), (two, "num_samples"), (fedavg, "protocol")]:
        with pytest.raises(ValueError, match=f"observation 1 is not of observation 0's setting.*{why}"):
            attack.reconstruct_many([base, other], KNOWN)
    with pytest.raises(ValueError, match="observation 2 is not"):  # every observation is checked, before any work
        attacks.get("dlg", iterations=2).reconstruct_many([base, base, two], KNOWN)
    # the same defense with another seed (its randomness, never the attacker's) is the same setting
    a = simulate_client(lenet, x[:1], y[:1], from_config({"kind": "gradprune", "ratio": 0.9, "seed": 1}))
    b = simulate_client(lenet, x[1:2], y[1:2], from_config({"kind": "gradprune", "ratio": 0.9, "seed": 2}))
    assert len(attack.reconstruct_many([a, b], KNOWN)) == 2


@pytest.mark.parametrize("defense", [{"kind": "gradprune", "ratio": 0.9}, {"kind": "sign"}, {"kind": "outpost", "seed": 0}],
                         ids=["gradprune", "sign", "outpost"])
def test_defense_aware_objectives_batch_like_the_loop(defense, lenet, private):
    """Per-sample masks of pruned updates (each sample's own non-zero coordinates), the sign hinge loss."""
    observations = _clients(lenet, private, [0, 1, 2], defense)
    many = attacks.get("inverting_gradients", **BUDGETS["inverting_gradients"]).reconstruct_many(observations, KNOWN, [1, 2, 3])
    for obs, seed, rec in zip(observations, [1, 2, 3], many):
        _assert_same(rec, _alone("inverting_gradients", obs, seed))


def test_fedavg_clipping_and_inferred_labels_batch_like_the_loop(lenet, private):
    """Unrolled FedAvg steps over two samples each, and DP-SGD's per-sample clipping; labels restored per
    observation (each sample's own)."""
    protocol = FedAvg(epochs=1, batch_size=1, lr=0.1)
    cases = [(_clients(lenet, private, [0, 2], None, protocol, n=2), ThreatModel(labels="inferred")),
             (_clients(lenet, private, [0, 2], {"kind": "dpsgd", "noise_multiplier": 0.5, "max_grad_norm": 1.0}, n=2), KNOWN)]
    for observations, threat in cases:
        many = attacks.get("inverting_gradients", iterations=10, restarts=2).reconstruct_many(observations, threat, [1, 2])
        for obs, seed, rec in zip(observations, [1, 2], many):
            _assert_same(rec, _alone("inverting_gradients", obs, seed, threat, iterations=10, restarts=2))


def test_batchnorm_prior_batches_and_proxy_statistics_loop(private):
    """bn='exact': each sample's prior pulls toward its own batch statistics. bn='proxy' writes each
    sample's released statistics into the replica's model: that case runs the loop (exact)."""
    x, y = private
    torch.manual_seed(0)
    model = ConvNetSmall((1, 25, 25), 10)
    observations = [simulate_client(model, x[r : r + 2], y[r : r + 2]) for r in (0, 2)]
    budget = {"iterations": 10, "restarts": 2, "group_every": 5}
    for bn in ("exact", "proxy"):
        threat = ThreatModel(labels="known", bn=bn)
        many = attacks.get("gradinversion", **budget).reconstruct_many(observations, threat, [1, 2])
        for obs, seed, rec in zip(observations, [1, 2], many):
            alone = _alone("gradinversion", obs, seed, threat, **budget)
            if bn == "proxy":
                assert torch.equal(rec.inputs, alone.inputs)
            else:
                _assert_same(rec, alone)


def test_encoded_views_batch_like_the_loop(lenet, private):
    """MixUp clients: the attack reconstructs the encodings (soft labels, per sample) from each view."""
    from guardfl.redteam.attacks.analytic.encoded import attack_view

    x, y = private
    views = [attack_view(simulate_client(lenet, x[r : r + 2], y[r : r + 2], from_config({"kind": "mixup", "k": 2, "seed": r})), True)
             for r in (0, 2)]
    assert views[0].side.training_labels().dim() == 2  # soft labels
    many = attacks.get("inverting_gradients", iterations=10, restarts=2).reconstruct_many(views, KNOWN, [1, 2])
    for view, seed, rec in zip(views, [1, 2], many):
        _assert_same(rec, _alone("inverting_gradients", view, seed, iterations=10, restarts=2))


def test_cpa_skips_the_ica_of_one_sample_with_the_loops_result(lenet, private):
    """For one sample the 1 x 1 unmixing matrix never moves (its gradient through the row normalisation is
    exactly 0): skipping Adam gives the loop's matrix and loss bit for bit, for image and embedding sources."""
    x, y = private
    fc = set_model_state(FC2((1, 25, 25), 10), "default", seed=0)
    for model, image_shape in [(fc, (1, 25, 25)), (lenet, None)]:
        obs = simulate_client(model, x[3:4], y[3:4])
        attack = attacks.get("cocktail_party", iterations=50, lr=1e-2, restarts=3, seed=0)
        name = next(n for n, t in obs.update.items() if t.dim() == 2)
        g = obs.update[name]
        skipped = attack.unmix(g, 1, image_shape, 0.0, torch.Generator().manual_seed(0))
        looped = attack.unmix(g, 1, image_shape, 0.0, torch.Generator().manual_seed(0), skip_trivial=False)
        assert torch.equal(skipped[0], looped[0]) and skipped[1] == looped[1]


def test_default_loop_for_attacks_that_do_not_batch(lenet, private):
    """DLG (L-BFGS couples coordinates: batching would change the maths) runs one call per sample."""
    observations = _clients(lenet, private, [0, 1])
    many = attacks.get("dlg", iterations=3).reconstruct_many(observations, KNOWN, [1, 2])
    for obs, seed, rec in zip(observations, [1, 2], many):
        alone = attacks.get("dlg", iterations=3, seed=seed).reconstruct(obs, KNOWN)
        assert torch.equal(rec.inputs, alone.inputs) and rec.restart_objectives == alone.restart_objectives


def test_learned_inversion_answers_a_chunk_in_one_forward(lenet, private):
    x, y = private
    observations = _clients(lenet, private, [0, 1, 2])
    threat = ThreatModel(labels="known", aux=(x[10:60], y[10:60]))
    attack = attacks.get("learned_inversion", hidden=16, epochs=2, batch=8, seed=0)
    many = attack.reconstruct_many(observations, threat, [0, 0, 0])
    for obs, rec in zip(observations, many):
        _assert_same(rec, attack.reconstruct(obs, threat), atol=1e-6)


def test_capabilities_say_which_attacks_batch_samples():
    batching = {name for name, cls in attacks.ATTACKS.items() if cls.capabilities.batches_samples}
    assert batching == {"inverting_gradients", "gradinversion", "cocktail_party", "learned_inversion"}
    assert Capabilities().batches_samples is False


def test_samples_as_separate_forwards_give_the_vmapped_result(lenet, private):
    """``vmap_restarts=False`` (large models on a CPU) runs S x R ordinary objectives: the same result,
    each sample's anchor its own restarts' mean."""
    from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
    from guardfl.redteam.attacks.optimisation.optimiser import optimise_batched
    from guardfl.redteam.attacks.optimisation.targets import observation_target, stack_targets

    observations = _clients(lenet, private, [0, 1])
    knowledge = [KNOWN.knowledge(o) for o in observations]
    replica = Replica(observations[0], knowledge[0], ObjectiveWeights("cosine", tv=1e-2, group=1e-2), torch.device("cpu"))
    targets = stack_targets([{**observation_target(o, k, False, torch.device("cpu")), "labels": k.labels}
                             for o, k in zip(observations, knowledge)])
    f = lambda x, a, t: replica.objective(x, t["labels"], a, t)  # noqa: E731
    x0 = torch.rand(2, 3, 1, 1, 25, 25, generator=torch.Generator().manual_seed(0))
    kw = dict(iterations=10, lr=0.1, bounds=(0, 1), group_every=3, targets=targets)
    assert torch.allclose(optimise_batched(f, x0, **kw), optimise_batched(f, x0, vmap_restarts=False, **kw), atol=1e-5)
