"""Robbing the Fed: the imprint block, exact recovery from what the client sends, and its place in the
malicious-server lifecycle (``ServerAttack.interrogate`` with a ``ClientQuery``)."""

import math

import pytest
import torch

from guardfl.redteam import ThreatModel, simulate_client
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.attacks import NotApplicable, RobbingTheFed, Setting, get
from guardfl.redteam.attacks.malicious.robbing_the_fed import craft, cutoffs, recover
from guardfl.redteam.client.simulate import ClientQuery, FedAvg, FedSGD
from guardfl.redteam.modality.image.models import LeNetZhu

MALICIOUS = ThreatModel(server="malicious", labels="known")


def run(faces, defense=None, protocol=FedSGD(), n=64, threat=MALICIOUS, **budget):
    torch.manual_seed(0)
    model = LeNetZhu((1, 25, 25), 10)
    x, y = faces[:n], torch.arange(n) % 10
    setting = Setting.of(simulate_client(model, x, y, defense, protocol))
    client = ClientQuery(x, y, defense, protocol)
    rec = get("robbing_the_fed", seed=0, **budget).interrogate(client, setting, threat)
    per = metrics.evaluate(rec, x, y, data_range=(0, 1))["per_image"]
    return rec, client, [p["ssim"] for p in per]


def test_an_undefended_fedsgd_batch_of_64_comes_back_exactly(faces):
    rec, client, ssim = run(faces)
    exact = sum(s >= 0.95 for s in ssim)
    assert exact >= 40, ssim  # ~e^(-1/4) of the samples are alone in their bin at 4 bins per sample
    assert client.queries == 1 and rec.info["queries"] == 1
    assert type(rec.info["malicious_model"]).__name__ == "Imprinted"
    # most of them are the private face itself, up to the float32 cancellation of adjacent rows' sums (an
    # L2 error under 0.01 over 625 pixels); samples with a small gradient D_n lose more to it
    x = faces[:64]
    err = torch.cdist(rec.inputs.flatten(1), x.flatten(1)).min(1).values
    assert int((err < 1e-2).sum()) >= 25


def test_a_one_step_fedavg_delta_too_and_more_local_steps_degrade_it(faces):
    one = sum(s >= 0.95 for s in run(faces, protocol=FedAvg(epochs=1, batch_size=64, lr=0.01))[2])
    four = sum(s >= 0.95 for s in run(faces, protocol=FedAvg(epochs=1, batch_size=16, lr=0.01))[2])
    assert one >= 40 and four < one


@pytest.mark.parametrize("defense", [{"kind": "gradprune", "ratio": 0.9}, {"kind": "gaussian", "sigma": 0.01}])
def test_pruning_or_noise_on_the_update_stops_the_published_construction(faces, defense):
    assert max(run(faces, defense, pad=0, boost=1.0)[2]) < 0.95


def test_the_imprint_adapted_to_pruning_pads_the_layer_and_reads_faces_exactly_again(faces):
    """Dead rows (gradient 0) make the per-layer pruning keep every bin row: the server knows the ratio."""
    rec, _, ssim = run(faces, {"kind": "gradprune", "ratio": 0.9})
    assert rec.info["pad"] > 9 * rec.info["bins"] - 1 and sum(s >= 0.95 for s in ssim) >= 40


def test_the_imprint_adapted_to_noise_boosts_its_gradients_past_it(faces):
    rec, _, ssim = run(faces, {"kind": "gaussian", "sigma": 0.01})
    assert rec.info["boost"] == 1e5 and max(ssim) > 0.4


def test_an_unknown_defense_gets_the_published_construction(faces):
    rec, _, _ = run(faces, {"kind": "gradprune", "ratio": 0.9},
                    threat=ThreatModel(server="malicious", labels="known", defense="unknown"))
    assert rec.info["pad"] == 0 and rec.info["boost"] == 1.0


def test_padding_and_boost_read_the_defense_configuration():
    from guardfl.redteam.attacks.malicious.robbing_the_fed import boost_for, padding_for

    assert padding_for(None, 64) == 0 and padding_for({"kind": "sign"}, 64) == 0
    assert padding_for({"kind": "gradprune", "ratio": 0.9, "scope": "global"}, 64) == 0
    n = (64 + padding_for({"kind": "gradprune", "ratio": 0.99}, 64)) * 625  # the imprint layer's entries
    assert n - math.ceil(0.99 * (n - 1)) >= 64 * 625  # GradPrune's kept count covers every bin row's entries
    stack = {"kind": "stack", "defenses": [{"kind": "sign"}, {"kind": "outpost", "prune": 0.8}]}
    assert 40 <= padding_for(stack, 10) <= 42 and boost_for(stack) == 1e5 and boost_for({"kind": "dpsgd", "noise_multiplier": 1.0}) == 1.0


def test_recovery_divides_adjacent_bins_and_skips_empty_ones():
    torch.manual_seed(0)
    x = torch.rand(3, 1, 2, 2)
    s = x.flatten(1).mean(1)
    cuts = torch.tensor([-1.0, float(s.min()) + 1e-4, float(s.max()) - 1e-4, 0.999])
    weights = torch.tensor([0.5, -2.0, 1.5])  # each sample's D_n
    active = (s[None, :] > cuts[:, None]).double()  # bin x sample
    w = (active * weights.double()) @ x.flatten(1).double()
    b = active @ weights.double()
    images, found = recover(w, b, (1, 2, 2), 3, (0.0, 1.0), 1e-6)
    assert found == 3  # bins 0-2 hold one sample each, bin 3 none
    assert torch.cdist(images.flatten(1), x.flatten(1)).min(1).values.max() < 1e-5


def test_cutoffs_are_increasing_equal_mass_and_start_below_every_sample(faces):
    s = faces.flatten(1).mean(1)
    cuts = cutoffs(s, 8, (0.0, 1.0))
    assert cuts.numel() == 8 and bool((cuts[1:] > cuts[:-1]).all()) and float(cuts[0]) < 0
    counts = [int(((s > lo) & (s <= hi)).sum()) for lo, hi in zip(cuts, [*cuts[1:], torch.tensor(2.0)])]
    assert max(counts) - min(counts) <= 2  # equal mass on the attacker's data
    guess = cutoffs(None, 8, (0.0, 1.0))
    assert bool((guess[1:] > guess[:-1]).all())


def test_the_crafted_model_keeps_the_clients_model_and_its_outputs_close():
    torch.manual_seed(0)
    model = LeNetZhu((1, 25, 25), 10).eval()
    sent = craft(model, (1, 25, 25), cutoffs(None, 16, (0.0, 1.0)), 1e-3, 10.0, torch.Generator().manual_seed(0)).eval()
    x = torch.rand(4, 1, 25, 25)
    with torch.no_grad():
        assert (sent(x) - model(x)).abs().max() < 1e-2 * model(x).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(sent.model.state_dict().values(), model.state_dict().values()))


def test_it_needs_a_malicious_server_and_cannot_attack_an_honest_update(faces):
    model = LeNetZhu((1, 25, 25), 10)
    obs = simulate_client(model, faces[:2], torch.tensor([0, 1]))
    reason = RobbingTheFed.applicable(Setting.of(obs), ThreatModel())
    assert reason is not None and "threat.server: malicious" in reason
    with pytest.raises(NotApplicable, match="threat.server: malicious"):
        get("robbing_the_fed").interrogate(ClientQuery(faces[:2], torch.tensor([0, 1]), None, FedSGD()),
                                           Setting.of(obs), ThreatModel())
    with pytest.raises(NotApplicable, match="use interrogate"):
        get("robbing_the_fed").reconstruct(obs, MALICIOUS)


def test_budget_errors_name_the_field():
    from guardfl.errors import ConfigError

    with pytest.raises(ConfigError, match="robbing_the_fed.bins"):
        get("robbing_the_fed", bins=1)
