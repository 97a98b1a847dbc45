"""Learned inversion (LTI): the defense as augmentation, the trained inverter, hashing, LTI-OOD data."""

import pytest
import torch

from guardfl.redteam import FedAvg, FedSGD, ThreatModel, attacks, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks import LearnedInversion, Setting
from guardfl.redteam.client.transmit import TransmitSimulator, flatten_update
from guardfl.redteam.auxdata import AuxData, dct_matrix, ood_pseudo_images, random_flips
from guardfl.redteam.modality.image.data import lfw_faces, lfw_nonfaces
from guardfl.redteam.modality.image.models import ConvNetSmall, LeNetZhu, set_model_state


@pytest.fixture(scope="module")
def faces():
    return lfw_faces(10)


@pytest.fixture(scope="module")
def lenet():
    return set_model_state(LeNetZhu((1, 25, 25), 10), "wide-init", seed=0)


def _flat(obs):
    return flatten_update(obs.update, list(obs.update))


@pytest.mark.parametrize("protocol", [FedSGD(), FedAvg(epochs=2, batch_size=1, lr=0.05, momentum=0.9, weight_decay=1e-3)])
@pytest.mark.parametrize("defense", [None, {"kind": "gradprune", "ratio": 0.7}, {"kind": "sign"},
                                     {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.5}, {"kind": "sign"}]}])
def test_transmit_simulator_equals_the_client_simulation(faces, lenet, protocol, defense):
    """Deterministic defenses: every batch's row is exactly what simulate_client (the real optimizer path)
    transmits for it, FedSGD and FedAvg with momentum and weight decay."""
    x, y = faces
    n = 2 if isinstance(protocol, FedAvg) else 1
    xb, yb = x[: 3 * n].view(3, n, 1, 25, 25), y[: 3 * n].view(3, n)
    rows = TransmitSimulator(lenet, defense, protocol).updates(xb, yb)
    for i in range(3):
        want = _flat(simulate_client(lenet, xb[i], yb[i], defense, protocol))
        torch.testing.assert_close(rows[i], want, atol=2e-6, rtol=1e-5)


def test_transmit_simulator_runs_batchnorm_in_train_mode_and_the_needs_params_defense(faces):
    x, y = faces
    model = set_model_state(ConvNetSmall((1, 25, 25), 10), "default", seed=1)
    xb, yb = x[:8].view(2, 4, 1, 25, 25), y[:8].view(2, 4)
    rows = TransmitSimulator(model, None, FedSGD()).updates(xb, yb)
    for i in range(2):
        torch.testing.assert_close(rows[i], _flat(simulate_client(model, xb[i], yb[i])), atol=2e-6, rtol=1e-5)
    # Outpost reads each batch's weights (ctx.params), prunes 80% of every layer, noises the top-Fisher 40%
    outpost = TransmitSimulator(model, {"kind": "outpost"}, FedSGD()).updates(xb, yb)
    assert float((outpost == 0).float().mean()) > 0.5 and not torch.equal(outpost, rows)


def test_defense_augmentation_draws_fresh_randomness_every_draw(faces, lenet):
    """The attacker knows the configuration, never the randomness: the config's seed is dropped, and two
    draws of the same batch differ."""
    x, y = faces
    sim = TransmitSimulator(lenet, {"kind": "gaussian", "sigma": 0.1, "seed": 3}, FedSGD())
    xb, yb = x[:1].expand(2, 1, 1, 25, 25).clone(), y[:1].expand(2, 1).clone()
    a, b = sim.updates(xb, yb), sim.updates(xb, yb)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], b[0])
    clean = _flat(simulate_client(lenet, x[:1], y[:1]))
    seeded_client = _flat(simulate_client(lenet, x[:1], y[:1], {"kind": "gaussian", "sigma": 0.1, "seed": 3}))
    assert not torch.equal(a[0], seeded_client)  # the client's own noise is not reproduced
    # but the noise has the configured scale
    assert abs(float((a - clean).std()) - 0.1) < 0.01


def test_dct_pseudo_images_follow_the_fitted_gaussian():
    d = dct_matrix(8)
    torch.testing.assert_close(d @ d.T, torch.eye(8, dtype=d.dtype), atol=1e-10, rtol=0)
    ood = lfw_nonfaces()[0][:, :, :8, :8]
    samples = ood_pseudo_images(ood, 4000, torch.Generator().manual_seed(0), input_range=(-10.0, 10.0))
    dh = dct_matrix(8)
    fit, got = dh @ ood.double() @ dh.T, dh @ samples.double() @ dh.T
    assert float((fit.mean(0) - got.mean(0)).abs().max()) < 0.05
    assert float((fit.std(0) - got.std(0)).abs().max() / fit.std(0).max()) < 0.1


@pytest.fixture(scope="module")
def trained(faces, lenet):
    """An inverter trained against sign compression on aux faces 10.. plus OOD non-faces (small budget)."""
    x, y = faces
    aux = AuxData(x[10:], y[10:], ood=lfw_nonfaces()[0], ood_samples=300)
    threat = ThreatModel(labels="known", aux=aux)
    attack = attacks.get("learned_inversion", hidden=256, epochs=25, batch=32, lr=1e-3, seed=0)
    setting = Setting.of(simulate_client(lenet, x[:1], y[:1], {"kind": "sign"}))
    infos = []
    attack.prepare(setting, threat, on_done=infos.append)
    return attack, threat, infos[0]


def test_the_inverter_beats_the_mean_aux_image_on_held_out_samples(faces, lenet, trained):
    attack, threat, info = trained
    assert info["holdout_mse"] < 0.8 * info["holdout_mse_mean_image"]
    x, y = faces
    mean_image = torch.cat([x[10:]]).mean(0, keepdim=True)
    lti, trivial = [], []
    for i in range(5):  # private faces the attacker never saw
        obs = simulate_client(lenet, x[i : i + 1], y[i : i + 1], {"kind": "sign"})
        rec = attack.reconstruct(obs, threat)
        lti.append(metrics.evaluate(rec, x[i : i + 1])["per_image"][0]["mse"])
        trivial.append(float((mean_image - x[i : i + 1]).pow(2).mean()))
    assert sum(lti) < 0.9 * sum(trivial)  # measured: 0.136 vs 0.167 (tiny budget, sign compression)


def test_reconstruct_reuses_the_preparation_and_refuses_what_it_cannot_attack(faces, lenet, trained, monkeypatch):
    attack, threat, _ = trained
    x, y = faces
    calls = []
    monkeypatch.setattr(LearnedInversion, "_prepare", lambda *a: calls.append(a))
    attack.reconstruct(simulate_client(lenet, x[3:4], y[3:4], {"kind": "sign"}), threat)
    assert calls == []  # same setting: the trained inverter is reused
    with pytest.raises(ValueError, match="needs auxiliary data"):
        attacks.get("learned_inversion").reconstruct(simulate_client(lenet, x[:1], y[:1]), ThreatModel())
    obs = simulate_client(lenet, x[:2], y[:2], None, FedAvg(batch_size=1))
    assert "fedavg='unknown'" in LearnedInversion.applicable(Setting.of(obs), ThreatModel(fedavg="unknown", aux=(x[10:], y[10:])))


def test_aux_data_overlapping_the_private_images_is_refused(faces, lenet):
    x, y = faces
    obs = simulate_client(lenet, x[:2], y[:2])
    with pytest.raises(ValueError, match="disjoint"):
        ThreatModel(aux=(x[1:40], y[1:40])).knowledge(obs)
    ThreatModel(aux=(x[2:40], y[2:40])).knowledge(obs)  # disjoint: fine
    aux = AuxData(x[5:], y[5:], ood=x[:1])  # an OOD image that is a private one
    with pytest.raises(ValueError, match=r"aux.ood: 1 auxiliary image"):
        aux.check_disjoint(x[:2])


def test_threat_accepts_a_dataset_or_a_tensor_pair(faces):
    x, y = faces
    a = ThreatModel(aux=torch.utils.data.TensorDataset(x[10:20], y[10:20])).aux
    b = ThreatModel(aux=(x[10:20], y[10:20])).aux
    assert a.digest() == b.digest() and len(a.images) == 10
    with pytest.raises(ValueError, match="aux: expected"):
        ThreatModel(aux=42)


def test_the_simulated_defense_draws_from_the_attackers_seed(faces, lenet):
    """The same attack seed trains the same inverter against a random defense (a reproducible red team,
    the same with any worker count); the client's seed is never used."""
    from guardfl.redteam.attacks.setting import Setting

    x, y = faces
    obs = simulate_client(lenet, x[:1], y[:1], {"kind": "outpost", "seed": 0})
    threat = ThreatModel(labels="known", aux=(x[10:60], y[10:60]))

    def prepared(seed):
        a = attacks.get("learned_inversion", hidden=16, epochs=2, batch=16, refresh_every=1, seed=seed, device="cpu")
        return a.prepare(Setting.of(obs), threat)

    first, again, other = prepared(0), prepared(0), prepared(1)
    assert all(torch.equal(first["net"][k], again["net"][k]) for k in first["net"])
    assert not all(torch.equal(first["net"][k], other["net"][k]) for k in first["net"])
    seeded = TransmitSimulator(lenet, {"kind": "outpost", "seed": 0}, FedSGD(), seed=0).updates(x[:1, None], y[:1, None])
    assert not torch.equal(seeded[0], _flat(obs))  # the attacker's seed 0 is not the client's seed 0


def test_random_flips_mirror_some_images_and_copy():
    x = torch.rand(64, 3, 5, 7)
    keep = x.clone()
    out = random_flips(x, torch.Generator().manual_seed(0))
    assert torch.equal(x, keep)  # the input is untouched
    same = [bool(torch.equal(out[i], x[i])) for i in range(64)]
    mirrored = [bool(torch.equal(out[i], x[i].flip(-1))) for i in range(64)]
    assert all(s != m for s, m in zip(same, mirrored))  # each image is itself or its mirror
    assert 16 < sum(mirrored) < 48


def test_flip_redraws_mirrored_aux_images_only(faces, lenet, monkeypatch):
    """flip: every draw trains on auxiliary images or their mirrors (never a private image), redrawn every
    ``refresh_every`` epochs even for a deterministic defense; the holdout is scored on unflipped images."""
    from guardfl.redteam.auxdata import content_hashes

    x, y = faces
    obs = simulate_client(lenet, x[:1], y[:1], {"kind": "sign"})
    aux = x[10:60]
    seen = []
    real = TransmitSimulator.updates
    monkeypatch.setattr(TransmitSimulator, "updates", lambda self, xb, yb, sketch=None: seen.append(xb) or real(self, xb, yb, sketch))
    a = attacks.get("learned_inversion", hidden=16, epochs=4, batch=16, refresh_every=2, flip=True, seed=0, device="cpu")
    infos = []
    a.prepare(Setting.of(obs), ThreatModel(labels="known", aux=(aux, y[10:60])), on_done=infos.append)
    assert infos[0]["flip"] and infos[0]["fresh_draws"]
    assert len(seen) == 3  # first draw, one redraw at epoch 2, the holdout
    allowed = set(content_hashes(aux)) | set(content_hashes(aux.flip(-1)))
    private = set(content_hashes(x[:10]))
    for xb in seen:
        got = set(content_hashes(xb.flatten(0, 1)))
        assert got <= allowed and not got & private
    assert not torch.equal(seen[0], seen[1])
    assert set(content_hashes(seen[2].flatten(0, 1))) <= set(content_hashes(aux))  # holdout: unflipped
