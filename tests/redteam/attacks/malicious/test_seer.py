"""SEER (Garov et al. 2024) at the scale of a dense first layer: where it applies, the gate that fails a
SEER that learned nothing, and the trained model passing the client's inspection while its update decodes to
the batch's brightest image."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from guardfl.errors import ConfigError
from guardfl.redteam.attacks import AttackFailed, NotApplicable, Setting, get
from guardfl.redteam.attacks.malicious.seer_adapt import rescale, surrogate
from guardfl.redteam.attacks.malicious.seer_training import Decoder, property_scores
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import ClientQuery, FedAvg, FedSGD
from guardfl.redteam.modality.image import metrics
from guardfl.redteam.modality.image.models import FC2, FC2BN, FC2GN, FC2LN, ConvNetSmall
from guardfl.redteam.threat import ThreatModel

CIFAR = Path(__file__).resolve().parents[4].parent / "shared/data/cifar10-train-5k.npz"


def threat(n=200, shape=(3, 32, 32)):
    g = torch.Generator().manual_seed(0)
    return ThreatModel(server="malicious", labels="known", aux=AuxData(torch.rand(n, *shape, generator=g), torch.arange(n) % 10))


def setting(model, n=8, shape=(3, 32, 32), protocol=FedSGD(), train_mode=True, defense=None):
    return Setting(model, protocol, n, shape, 10, (0.0, 1.0), defense, train_mode=train_mode)


@pytest.mark.parametrize("model, protocol, train_mode, why", [
    (FC2(), FedSGD(), True, "needs BatchNorm"),
    (FC2LN(), FedSGD(), True, "needs BatchNorm"),
    (FC2GN(), FedSGD(), True, "needs BatchNorm"),  # fc2bn as DP-SGD trains it (dp_compatible)
    (ConvNetSmall(), FedSGD(), True, "first dense layer"),
    (FC2BN(), FedSGD(), False, "eval mode"),
    (FC2BN(), FedAvg(), True, "fedsgd clients only"),
])
def test_it_says_where_it_does_not_apply(model, protocol, train_mode, why):
    reason = get("seer").applicable(setting(model, protocol=protocol, train_mode=train_mode), threat())
    assert reason is not None and why in reason, reason


def test_it_needs_the_malicious_threat_enough_aux_data_and_colour_for_a_colour_property():
    assert "malicious" in get("seer").applicable(setting(FC2BN()), ThreatModel(aux=threat().aux))
    assert "at least 40 auxiliary images" in get("seer").applicable(setting(FC2BN()), threat(n=20))
    assert get("seer").applicable(setting(FC2BN()), threat()) is None
    grey = setting(FC2BN((1, 25, 25)), shape=(1, 25, 25))
    assert "3-channel" in get("seer", prop="red").refuses(grey)
    assert get("seer", prop="dark").refuses(grey) is None


def test_a_seer_that_learned_nothing_fails_the_run_instead_of_certifying():
    torch.manual_seed(0)
    with pytest.raises(AttackFailed, match="bounds nothing for a batch of 8"):
        get("seer", seed=0, steps=2).prepare(setting(FC2BN()), threat())


def test_the_property_and_the_decoders_scale_and_sign():
    x = torch.zeros(3, 3, 2, 2)
    x[1] += 0.9
    x[2, 0] += 1.0
    assert int(property_scores(x, "bright").argmax()) == 1 and int(property_scores(x, "dark").argmin()) == 1
    assert int(property_scores(x, "red").argmax()) == 2
    g = torch.Generator().manual_seed(0)
    decoder = Decoder.init(5, 2, torch.zeros(3, 2, 2), g)
    decoder.weight.data.normal_(generator=g)
    gradient = torch.randn(5, 12, generator=g)
    # the reconstruction reads the gradient up to its scale and sign (a sample's coefficient, set by its label)
    assert torch.allclose(decoder(gradient), decoder(-3.0 * gradient), atol=1e-5)


@pytest.fixture(scope="module")
def trained():
    """SEER prepared on 4,000 CIFAR-10 images of the shared sample (a seeded permutation: the sample is
    ordered by class, and the attacker's images and the clients' must hold the same classes); the clients'
    batches come from the other 1,000."""
    if not CIFAR.is_file():
        pytest.skip("the CIFAR-10 sample of ../shared/data is not beside this clone")
    d = np.load(CIFAR)
    order = torch.randperm(5000, generator=torch.Generator().manual_seed(0))
    x_all = (torch.tensor(d["x"]).permute(0, 3, 1, 2).float() / 255)[order]
    y_all = torch.tensor(d["y"]).long()[order]
    aux = ThreatModel(server="malicious", labels="known", aux=AuxData(x_all[:4000], y_all[:4000]))
    torch.manual_seed(0)
    model = FC2BN()
    attack = get("seer", seed=0, steps=600, checkpoints=2, adapt_steps=150)
    state = attack.prepare(setting(model), aux)

    def batch(s):
        pick = 4000 + torch.randperm(1000, generator=torch.Generator().manual_seed(s))[:8]
        return x_all[pick], y_all[pick]

    return attack, state, model, aux, batch


def test_the_trained_model_passes_the_inspection_and_its_update_decodes_to_the_brightest_image(trained):
    attack, state, model, aux, batch = trained
    assert state["held_out"]["ssim"] > state["held_out"]["ssim_batch_mean"] + 0.1  # the gate, on held-out aux
    got, guess = [], []
    for s in range(4):
        x, y = batch(s)
        client = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model, disaggregation=True)
        rec = attack.interrogate(client, setting(model), aux)
        assert client.refused == 0 and "refused" not in rec.info  # every check guardfl ships passes it
        brightest = int(x.mean((1, 2, 3)).argmax())
        got.append(metrics.ssim(rec.inputs[0], x[brightest], 1.0))
        guess.append(metrics.ssim(x.mean(0), x[brightest], 1.0))
    assert sum(got) / 4 > sum(guess) / 4 + 0.1, (got, guess)
    assert type(rec.info["malicious_model"]) is FC2BN
    # against an inspecting client the server sends the checkpoint its shadows of the client pass (both do here)
    assert rec.info["evasion"].startswith("2 of 2 checkpoints passed") and rec.info["checkpoint"] in (300, 600)
    assert rec.info["boost"].startswith("none (1)") and rec.info["defense_adapted"].startswith("not adapted: no client defense")


def test_the_rescaled_model_computes_the_same_and_its_first_layer_gradient_is_k_times_larger():
    torch.manual_seed(1)
    model, x, y = FC2BN(), torch.rand(64, 3, 32, 32), torch.arange(64) % 10
    boosted = rescale(model, "net.1", "net.2", 3.0)  # BatchNorm's eps (1e-5) stays small beside a unit's variance / 9
    for train in (True, False):
        model.train(train), boosted.train(train)
        assert torch.allclose(model(x), boosted(x), rtol=1e-2, atol=1e-2)
    model.train(), boosted.train()
    grads = [torch.autograd.grad(F.cross_entropy(m(x), y), m.net[1].weight)[0] for m in (model, boosted)]
    assert float((grads[1] - 3.0 * grads[0]).norm() / (3.0 * grads[0]).norm()) < 0.02
    assert torch.allclose(boosted.net[1].weight.detach() * 3.0, model.net[1].weight.detach())


@pytest.mark.parametrize("defense, known, boost", [
    ({"kind": "gaussian", "sigma": 0.01}, "known", "against gaussian"),
    ({"kind": "sign"}, "known", "none (1): no known defense whose noise"),
    ({"kind": "gaussian", "sigma": 0.01}, "unknown", "none (1): the client's defense is unknown"),
])
def test_against_a_known_defense_the_decoder_is_fitted_to_it_and_fixed_noise_is_boosted_away(trained, defense, known, boost):
    attack, state, model, aux, batch = trained
    threat = ThreatModel(server="malicious", labels="known", defense=known, aux=aux.aux)
    x, y = batch(0)
    client = ClientQuery(x, y, defense, FedSGD(), inspect=True, reference=model, disaggregation=True)
    rec = attack.interrogate(client, setting(model, defense=defense), threat)
    assert client.refused == 0 and boost in rec.info["boost"]
    adapted = rec.info["defense_adapted"]
    if known == "unknown":
        assert adapted.startswith("not adapted: the defense is unknown")
        return
    # measured on the server's own held-out images through the simulated defense, never the client's batch
    before, after = adapted["held_out_before"]["ssim"], adapted["held_out_after"]["ssim"]
    assert max(before, after) > adapted["held_out_after"]["ssim_batch_mean"], adapted
    assert adapted["kept"] == "fitted" if after >= before else adapted["kept"].startswith("jointly trained")


@pytest.mark.parametrize("boost", [0.5, 1e5, True, "x"])
def test_a_bad_boost_is_one_line_naming_the_field_and_its_range(boost):
    with pytest.raises(ConfigError, match=r"seer\.boost.*'auto' or a number in \[1, 10000\]") as err:
        get("seer", boost=boost)
    assert "\n" not in str(err.value)


def test_the_training_stand_ins_for_a_defense_follow_it_forward_and_pass_a_gradient_back():
    g = torch.randn(16, 50, requires_grad=True)
    prune, name = surrogate({"kind": "gradprune", "ratio": 0.9})
    out = prune(g)
    assert int((out != 0).sum()) == 800 - 720 and "gradprune 0.9" in name  # prune_count: ceil(0.9 * 799)
    assert torch.equal(out != 0, g.abs() >= g.abs().flatten().kthvalue(721).values)
    out.sum().backward()
    assert torch.equal(g.grad != 0, out != 0)  # the kept entries carry the gradient
    sign, name = surrogate({"kind": "stack", "defenses": [{"kind": "sign"}]})
    h = torch.randn(5, requires_grad=True)
    assert torch.equal(sign(h), torch.sign(h)) and "straight-through" in name
    sign(h).sum().backward()
    assert torch.equal(h.grad, torch.ones(5))
    assert surrogate({"kind": "gaussian", "sigma": 0.1}) is None and surrogate(None) is None
    # clipped noise: the gradient brought to the clip's norm (differentiably), then the defense's std of noise
    clipped, name = surrogate({"kind": "laplace", "scale": 0.05, "clip": 2.0})
    big = torch.full((400, 100), 1.0, requires_grad=True)  # norm 200, past the clip
    out = clipped(big)
    assert "clipped to 2" in name and abs(float((out.detach() - 2.0 / 200).std()) - 0.05 * 2 ** 0.5) < 0.005
    out.sum().backward()
    assert big.grad is not None and float(big.grad.abs().max()) < 1e-3  # the norm's scale is what it follows
    small = torch.full((10,), 0.01)
    noiseless, _ = surrogate({"kind": "gaussian", "sigma": 1e-9, "clip": 2.0})
    assert torch.allclose(noiseless(small), small, atol=1e-6)  # under the clip: untouched but for the noise


def test_one_preparation_serves_every_defense_unless_the_training_goes_through_one():
    model, t = FC2BN(), threat()
    prune = {"kind": "gradprune", "ratio": 0.9}
    clean, through = get("seer"), get("seer", through=True)
    assert clean.preparation_key(setting(model, defense=prune), t) == clean.preparation_key(setting(model), t)
    assert through.preparation_key(setting(model, defense=prune), t) != through.preparation_key(setting(model), t)
    noise = {"kind": "gaussian", "sigma": 0.01}  # no stand-in for noise (the boost answers it): the clean training
    assert through.preparation_key(setting(model, defense=noise), t) == through.preparation_key(setting(model), t)
    clipped = {"kind": "gaussian", "sigma": 0.01, "clip": 1.0}  # a clip the boost cannot pass: trained through
    assert through.preparation_key(setting(model, defense=clipped), t) != through.preparation_key(setting(model), t)
