"""TransmitSimulator under every defense kind: what it simulates equals what ``simulate_client`` (the real
``guardfl.protect`` path) transmits. With the client's seed given to the simulator as its own, the draws
come from the same streams in the same order, so random defenses compare to float tolerance too; without
it (as the red team runs it) the randomness is fresh and the checks are on its distribution."""

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import guardfl
from guardfl.defenses import DPSGD
from guardfl.errors import ConfigError
from guardfl.redteam import FedAvg, FedSGD, simulate_client
from guardfl.redteam.client.transmit import TransmitSimulator, flatten_update
from guardfl.redteam.modality.image.models import ConvNetSmall, LeNetZhu, set_model_state

FEDAVG = FedAvg(epochs=2, batch_size=2, lr=0.05, momentum=0.9, weight_decay=1e-3)
NO_POISSON = {"poisson_sampling": False}


@pytest.fixture(scope="module")
def lenet():
    return set_model_state(LeNetZhu((1, 8, 8), 10), "wide-init", seed=0)


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.rand(12, 1, 8, 8, generator=gen), torch.arange(12) % 10


@pytest.fixture(scope="module")
def public_npz(tmp_path_factory):
    x = (np.random.default_rng(1).random((6, 8, 8, 1)) * 255).astype(np.uint8)
    path = tmp_path_factory.mktemp("public") / "public.npz"
    np.savez(path, x=x)
    return str(path)


def _flat(obs):
    return flatten_update(obs.update, list(obs.update))


def _public_tensor(path):
    from guardfl.defenses.encoding import load_public

    return load_public(path)


SEEDED = {
    "dpsgd-clip-only": {"kind": "dpsgd", "noise_multiplier": 0.0, "max_grad_norm": 0.5, **NO_POISSON},
    "dpsgd": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 0.5, "seed": 5, **NO_POISSON},
    "dpsgd-poisson": {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 0.5, "seed": 5},
    "mixup": {"kind": "mixup", "k": 2, "seed": 3},
    "instahide-intra": {"kind": "instahide", "k": 2, "seed": 3},
    "soteria": {"kind": "soteria", "prune": 0.5},
    "outpost": {"kind": "outpost", "seed": 9},
    "graddefense": {"kind": "graddefense", "seed": 7},
    "dpsgd+gradprune+soteria": {"kind": "stack", "seed": 11, "defenses": [
        {"kind": "dpsgd", "noise_multiplier": 0.5, **NO_POISSON}, {"kind": "gradprune", "ratio": 0.5}, {"kind": "soteria"}]},
    "mixup+graddefense": {"kind": "stack", "seed": 11, "defenses": [{"kind": "mixup", "k": 2}, {"kind": "graddefense"}]},
    "instahide+dpsgd+gaussian": {"kind": "stack", "seed": 2, "defenses": [
        {"kind": "instahide", "k": 2}, {"kind": "dpsgd", "noise_multiplier": 0.3, **NO_POISSON}, {"kind": "gaussian", "sigma": 0.01}]},
}


@pytest.mark.parametrize("protocol", [FedSGD(), FEDAVG], ids=["fedsgd", "fedavg"])
@pytest.mark.parametrize("name", list(SEEDED))
def test_seeded_simulation_equals_the_client(lenet, data, protocol, name):
    """The client's seed handed to the simulator: the same clipping, noise, encodings, masks and slices
    (every stage's stream in the client's order), so the row is the client's update to float tolerance."""
    config = SEEDED[name]
    x, y = data[0][:4], data[1][:4]
    row = TransmitSimulator(lenet, config, protocol, seed=config.get("seed")).updates(x[None], y[None])[0]
    want = _flat(simulate_client(lenet, x, y, config, protocol))
    torch.testing.assert_close(row, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("protocol", [FedSGD(), FEDAVG], ids=["fedsgd", "fedavg"])
def test_inter_instahide_with_the_clients_public_set_equals_the_client(lenet, data, public_npz, protocol):
    """An attacker who holds the client's public set passes it as ``public``: the client's encodings."""
    config = {"kind": "instahide", "k": 3, "mode": "inter", "public": public_npz, "seed": 4}
    x, y = data[0][:4], data[1][:4]
    sim = TransmitSimulator(lenet, config, protocol, seed=4, public=_public_tensor(public_npz))
    torch.testing.assert_close(sim.updates(x[None], y[None])[0], _flat(simulate_client(lenet, x, y, config, protocol)),
                               atol=1e-6, rtol=1e-5)


def test_inter_instahide_never_reads_the_clients_file_and_needs_partners(lenet, data, tmp_path):
    config = {"kind": "instahide", "k": 3, "mode": "inter", "public": str(tmp_path / "absent.npz")}
    with pytest.raises(ConfigError, match=r"^instahide\.public: .*pass public="):
        TransmitSimulator(lenet, config, FedSGD())
    stand_in = data[0][4:]  # the attacker's own images as partners: no file is opened
    rows = TransmitSimulator(lenet, config, FedSGD(), public=stand_in).updates(data[0][:2, None], data[1][:2, None])
    assert rows.shape == (2, sum(p.numel() for p in lenet.parameters())) and torch.isfinite(rows).all()


CLIP_ONLY_GRADDEFENSE = {"kind": "graddefense", "slices": 4, "perturb_slices": 4, "noise": 0.0, "clip_norm": 0.01}


@pytest.mark.parametrize("config", [SEEDED["dpsgd-clip-only"], SEEDED["soteria"],
                                    {"kind": "stack", "defenses": [{"kind": "soteria"}, {"kind": "sign"}]},
                                    CLIP_ONLY_GRADDEFENSE],
                         ids=["dpsgd-clip-only", "soteria", "soteria+sign", "graddefense-clip-every-slice"])
def test_deterministic_defenses_row_by_row_over_a_chunk(lenet, data, config):
    """Several batches per chunk (Soteria: one ``column_masks`` pass for all): each row is that batch's
    client update."""
    x, y = data[0].view(3, 4, 1, 8, 8), data[1].view(3, 4)
    rows = TransmitSimulator(lenet, config, FedSGD(), chunk=2).updates(x, y)
    for i in range(3):
        torch.testing.assert_close(rows[i], _flat(simulate_client(lenet, x[i], y[i], config)), atol=1e-6, rtol=1e-5)


def test_soteria_on_batchnorm_in_train_mode_is_applied_batch_by_batch(data):
    model = set_model_state(ConvNetSmall((1, 8, 8), 10, width=2), "default", seed=1)
    x, y = data[0][:8].view(2, 4, 1, 8, 8), data[1][:8].view(2, 4)
    rows = TransmitSimulator(model, {"kind": "soteria"}, FedSGD()).updates(x, y)
    for i in range(2):
        torch.testing.assert_close(rows[i], _flat(simulate_client(model, x[i], y[i], {"kind": "soteria"})), atol=1e-6, rtol=1e-5)


def test_graddefense_starts_a_root_set_per_fedavg_client(lenet, data):
    """FedAvg clients run one by one, each on its own model object: a client's root set is its own inputs
    (grown over its steps), never the previous client's. (FedSGD clients share one sensitivity pass:
    ``GradDefense.root_sensitivities``; the clip-only case above checks it slice by slice.)"""
    sim = TransmitSimulator(lenet, CLIP_ONLY_GRADDEFENSE, FedAvg(batch_size=1, lr=0.05), seed=0)
    x, y = data[0].view(6, 2, 1, 8, 8), data[1].view(6, 2)
    rows = sim.updates(x, y)
    torch.testing.assert_close(sim.gradient.root_set, x[-1])
    for i in (0, 5):
        want = _flat(simulate_client(lenet, x[i], y[i], CLIP_ONLY_GRADDEFENSE, FedAvg(batch_size=1, lr=0.05)))
        torch.testing.assert_close(rows[i], want, atol=1e-6, rtol=1e-5)


def test_dp_noise_scale_and_clipping_norm(lenet, data):
    """Unseeded (as the red team runs it): the noise is fresh per row, of std multiplier * C / n per entry,
    and the noiseless part is the clipped sum (FedSGD, B=1: an update of norm min(||g||, C))."""
    x, y = data[0][:1].expand(64, 1, 1, 8, 8).clone(), data[1][:1].expand(64, 1).clone()
    clip = {"kind": "dpsgd", "noise_multiplier": 0.0, "max_grad_norm": 0.05}
    clean = TransmitSimulator(lenet, clip, FedSGD()).updates(x[:1], y[:1])[0]
    full = _flat(simulate_client(lenet, data[0][:1], data[1][:1]))
    assert abs(float(clean.norm()) - min(float(full.norm()), 0.05)) < 1e-6
    noisy = TransmitSimulator(lenet, {**clip, "noise_multiplier": 2.0, "seed": 1}, FedSGD()).updates(x, y)
    residual = noisy - clean
    assert abs(float(residual.std()) - 2.0 * 0.05) < 0.002 and abs(float(residual.mean())) < 0.002
    assert len({float(r[0]) for r in residual}) == 64  # a fresh draw per row
    client = _flat(simulate_client(lenet, data[0][:1], data[1][:1], {**clip, "noise_multiplier": 2.0, "seed": 1}))
    assert not any(torch.equal(r, client) for r in noisy)  # the client's seed is not the simulator's


def test_target_epsilon_resolves_the_clients_noise_multiplier(lenet, data):
    """A target epsilon becomes the noise multiplier Opacus picks for the client (``make_private_with_epsilon``
    at sample rate 1 / len(loader))."""
    config = {"kind": "dpsgd", "target_epsilon": 8.0, "epochs": 3, "max_grad_norm": 1.0}
    x, y = data[0][:4], data[1][:4]
    for protocol, batch in ((FedSGD(), 4), (FedAvg(batch_size=2), 2)):
        model = set_model_state(LeNetZhu((1, 8, 8), 10), "wide-init", seed=0)
        loader = DataLoader(TensorDataset(x, y), batch_size=batch)
        _, opt, _ = guardfl.protect(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, DPSGD(**{
            k: v for k, v in config.items() if k != "kind"}))
        want = opt.original_optimizer.noise_multiplier
        assert TransmitSimulator(lenet, config, protocol).noise_multiplier(4) == pytest.approx(want, rel=1e-9)


def test_poisson_fedavg_samples_at_the_clients_rate(lenet, data):
    """FedAvg with Poisson sampling: two steps of rate 1/2 over two samples, so a client without noise
    sends a zero update exactly when all four draws miss: probability 1/16."""
    config = {"kind": "dpsgd", "noise_multiplier": 0.0, "max_grad_norm": 1.0}
    n = 800
    x, y = data[0][:2][None].expand(n, 2, 1, 8, 8).clone(), data[1][:2][None].expand(n, 2).clone()
    rows = TransmitSimulator(lenet, config, FedAvg(batch_size=1, lr=0.1), seed=0).updates(x, y)
    zero = float((rows.abs().sum(1) == 0).float().mean())
    assert abs(zero - 1 / 16) < 4 * math.sqrt(1 / 16 * 15 / 16 / n)
    # a step with both samples: their clipped sum / the expected batch size 1 (twice a one-sample step)
    assert len({round(float(r.norm()), 4) for r in rows}) > 3


def test_poisson_fedavg_takes_the_noise_only_step_of_an_empty_batch(lenet, data):
    """An empty Poisson batch still steps (the client's round takes Opacus's noise-only step), so with noise
    no client sends a zero update, and a client whose every draw missed sends pure noise: lr * sigma * C /
    expected batch size per coordinate and step, two steps."""
    config = {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    n = 400
    x, y = data[0][:2][None].expand(n, 2, 1, 8, 8).clone(), data[1][:2][None].expand(n, 2).clone()
    rows = TransmitSimulator(lenet, config, FedAvg(batch_size=1, lr=0.1), seed=0).updates(x, y)
    assert bool((rows.abs().sum(1) > 0).all())
    # every row carries two noise draws of std 0.1 per coordinate: the rows' std is at least that of one
    assert float(rows.std(1).min()) > 0.1 * 0.9


@pytest.mark.parametrize("kind", ["mixup", "instahide"])
def test_encodings_are_fresh_within_their_bounds(lenet, data, kind):
    """The simulator's encoded batches (fresh draws per batch): soft labels from coefficients in
    (0, max_coeff] summing to 1 over k distinct images; InstaHide's sign flips (values in [-1, 1], both signs)."""
    sim = TransmitSimulator(lenet, {"kind": kind, "k": 3, "max_coeff": 0.65}, FedSGD())
    sim.num_classes = 10
    x = data[0][:6].view(2, 3, 1, 8, 8).repeat(20, 1, 1, 1, 1)
    y = torch.arange(6).view(2, 3).repeat(20, 1)  # distinct labels: the soft label holds the coefficients
    xe, ye = sim._encode(x, y)
    assert ye.shape == (40, 3, 10) and torch.allclose(ye.sum(-1), torch.ones(40, 3))
    assert float(ye.max()) <= 0.65 + 1e-6 and int((ye > 0).sum(-1).min()) == 3
    assert len({tuple(r.flatten().tolist()) for r in ye}) == 40  # fresh coefficients per batch
    if kind == "instahide":
        assert float(xe.min()) < 0 < float(xe.max()) and float(xe.abs().max()) <= 1
    else:
        assert float(xe.min()) >= 0
    rows = sim.updates(x[:4], y[:4])
    assert not torch.equal(rows[0], rows[2])  # the same batch, two draws


def _mixup_in_poisson_dpsgd(k: int, seed: int | None = None) -> dict:
    return {"kind": "stack", **({} if seed is None else {"seed": seed}),
            "defenses": [{"kind": "mixup", "k": k}, {"kind": "dpsgd", "noise_multiplier": 0.5, "max_grad_norm": 1.0}]}


def test_poisson_sampled_mixup_equals_the_client_when_it_transmits(lenet, data):
    """MixUp inside Poisson-sampled DP-SGD FedAvg batches: each step's sampled images are encoded within
    themselves, as the client's loader yields them. Seeds whose round the client refuses (a sampled batch of
    one image) are skipped: the simulator redraws those, which the next test checks."""
    protocol = FedAvg(epochs=2, batch_size=4, lr=0.05)
    x, y = data[0][:8], data[1][:8]
    compared = 0
    for seed in range(8):
        config = _mixup_in_poisson_dpsgd(2, seed)
        try:
            want = _flat(simulate_client(lenet, x, y, config, protocol))
        except ConfigError as e:
            assert "k=2" in str(e)
            continue
        sim = TransmitSimulator(lenet, config, protocol, seed=seed)
        torch.testing.assert_close(sim.updates(x[None], y[None])[0], want, atol=1e-6, rtol=1e-5)
        assert sim.refused_rounds == 0
        compared += 1
    assert compared >= 3


def test_poisson_sampled_mixup_redraws_the_rounds_the_client_refuses(lenet, data):
    """Batches of 4 sampled at rate 1/2, k = 2: a step draws one image with probability 1/4, so about two
    rounds in three are refused by the client; each is redrawn until the round completes."""
    sim = TransmitSimulator(lenet, _mixup_in_poisson_dpsgd(2), FedAvg(epochs=2, batch_size=2, lr=0.05), seed=0)
    x, y = data[0][:4].expand(30, 4, 1, 8, 8), data[1][:4].expand(30, 4)
    rows = sim.updates(x, y)
    assert rows.shape[0] == 30 and torch.isfinite(rows).all()
    assert 20 <= sim.refused_rounds <= 200  # ~64 expected (30 x 0.68 / 0.32)
    small = sim._encode_sampled(x[:3], y[:3], torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool))[2]
    assert small.tolist() == [True, False, False]  # one image: refused; none: the noise-only step; two: mixed


def test_a_client_that_would_almost_never_transmit_is_refused_in_one_line(lenet, data):
    """k = 5 with 4 images: every non-empty sampled batch is refused; only a round of empty batches completes."""
    sim = TransmitSimulator(lenet, _mixup_in_poisson_dpsgd(5), FedAvg(epochs=2, batch_size=2, lr=0.05), seed=0)
    with pytest.raises(ConfigError, match=r"^defense: mixup mixes k=5 .* almost never transmit"):
        sim.updates(data[0][None, :4], data[1][None, :4])


def test_refusals_name_the_field(lenet):
    bn = set_model_state(ConvNetSmall((1, 8, 8), 10, width=2), "default", seed=1)
    with pytest.raises(ConfigError, match="BatchNorm"):
        TransmitSimulator(bn, {"kind": "dpsgd", "noise_multiplier": 1.0}, FedSGD())


@pytest.mark.parametrize("protocol", [FedSGD(), FedAvg(batch_size=1, lr=0.1)], ids=["fedsgd", "fedavg"])
def test_dpsgd_on_a_causal_lm_equals_the_client(protocol):
    """Token ids and next-token labels: per-sample gradients of each sequence's own mean token loss."""
    from guardfl.redteam.modality.text.models import Transformer3, next_token_labels

    torch.manual_seed(0)
    lm = Transformer3(vocab_size=100, width=16, heads=2, ffn=32, layers=1, context=16)
    ids = torch.randint(0, 100, (2, 8))
    y = next_token_labels(ids)
    config = {"kind": "dpsgd", "noise_multiplier": 0.5, "max_grad_norm": 1.0, "seed": 3, **NO_POISSON}
    row = TransmitSimulator(lm, config, protocol, seed=3).updates(ids[None], y[None])[0]
    torch.testing.assert_close(row, _flat(simulate_client(lm, ids, y, config, protocol)), atol=1e-6, rtol=1e-5)
