"""``server``: what every malicious attack shares; here the repeated query, the server's answer to a defense
that draws fresh noise in every round."""
import pytest
import torch

from guardfl.redteam.attacks import Setting, get
from guardfl.errors import ConfigError
from guardfl.redteam.attacks.malicious.server import (AUTO_REPEATS, MAX_REPEATS, averaged_defense, encodes_inputs, query_averaged,
                                                      repeats_for, repeats_line)
from guardfl.redteam.client.simulate import ClientQuery, FedSGD, ModelRefused
from guardfl.redteam.modality.image.models import FC2
from guardfl.redteam.threat import ThreatModel
from tests import malicious as M

SHAPE = (3, 8, 8)


def client(defense):
    g = torch.Generator().manual_seed(0)
    return ClientQuery(torch.rand(16, *SHAPE, generator=g), torch.arange(16) % 10, defense, FedSGD())


def test_auto_repeats_only_against_fresh_noise_the_server_knows():
    assert repeats_for({"kind": "gaussian", "sigma": 0.1, "clip": 1.0}, "auto") == AUTO_REPEATS
    assert repeats_for({"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.9}, {"kind": "laplace", "scale": 0.1}]},
                       "auto") == AUTO_REPEATS
    assert repeats_for({"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}, "auto") == AUTO_REPEATS
    assert repeats_for({"kind": "gradprune", "ratio": 0.9}, "auto") == 1 and repeats_for({"kind": "sign"}, "auto") == 1
    assert repeats_for(None, "auto") == 1 and repeats_for(None, 7) == 7  # unknown defense: only what is asked
    assert repeats_line(1, {"kind": "sign"}).startswith("1 (no fresh noise") and "4 times smaller" in repeats_line(16, None)
    assert repeats_line(1, {"kind": "gaussian", "sigma": 0.1}).startswith("1 (set by repeats; the defense draws fresh noise")
    assert repeats_line(16, None, 5).endswith("16 asked, the client refused round 6")


def test_an_encoding_at_any_depth_of_a_stack_is_collected_not_averaged():
    mixup = {"kind": "mixup", "k": 2}
    noisy = {"kind": "stack", "defenses": [{"kind": "stack", "defenses": [mixup]}, {"kind": "gaussian", "sigma": 0.1}]}
    assert encodes_inputs(mixup) and encodes_inputs({"kind": "instahide", "k": 2}) and encodes_inputs(noisy)
    assert not encodes_inputs({"kind": "gaussian", "sigma": 0.1}) and not encodes_inputs(None)
    assert repeats_for(noisy, "auto") == 1 and repeats_line(1, noisy).startswith("1 (the client encodes its inputs")


def test_the_average_of_repeated_rounds_keeps_the_gradient_and_shrinks_the_noise_by_the_root():
    torch.manual_seed(0)
    model = FC2(SHAPE)
    clean = client(None)(model).update
    sigma = 0.05
    noisy = client({"kind": "gaussian", "sigma": sigma})
    one, answered_one = query_averaged(noisy, model, 1)
    many, answered = query_averaged(noisy, model, 64)
    one, many = one.update, many.update
    assert noisy.queries == 65 and (answered_one, answered) == (1, 64)  # each repeat is a round the client answers
    for name in clean:
        err_one = float((one[name] - clean[name]).std())
        err_many = float((many[name] - clean[name]).std())
        if clean[name].numel() >= 500:
            assert err_one == pytest.approx(sigma, rel=0.1) and err_many == pytest.approx(sigma / 8, rel=0.15), name
        assert many[name].dtype == clean[name].dtype and many[name].shape == clean[name].shape


def test_the_traps_and_the_imprint_are_sent_again_against_known_noise_and_say_so():
    torch.manual_seed(0)
    model = FC2(SHAPE)
    setting = Setting(model, FedSGD(), 16, SHAPE, 10, (0.0, 1.0), {"kind": "gaussian", "sigma": 0.01, "clip": 1.0})
    noisy = client({"kind": "gaussian", "sigma": 0.01, "clip": 1.0})
    rec = get("trap_weights", seed=0, repeats=4).interrogate(noisy, setting, ThreatModel(server="malicious", labels="known"))
    assert noisy.queries == 4 and rec.info["repeats"].startswith("4 (the same model sent 4 times")
    imprint = client({"kind": "laplace", "scale": 0.01})
    rec = get("robbing_the_fed", seed=0, repeats=3).interrogate(imprint, setting, ThreatModel(server="malicious", labels="known"))
    assert imprint.queries == 3 and rec.info["repeats"].startswith("3 (the same model sent 3 times")
    unknown = client({"kind": "gaussian", "sigma": 0.01})
    rec = get("trap_weights", seed=0).interrogate(unknown, setting, ThreatModel(server="malicious", labels="known", defense="unknown"))
    assert unknown.queries == 1 and rec.info["repeats"].startswith("1 (no fresh noise")


@pytest.mark.parametrize("attack", ["trap_weights", "seer", "robbing_the_fed", "fishing", "threshold_bins"])
@pytest.mark.parametrize("bad", [0, 1025, 2.5, True, "many"])
def test_a_bad_repeats_is_one_line_naming_the_field(attack, bad):
    with pytest.raises(Exception) as info:
        get(attack, repeats=bad)
    assert "repeats" in str(info.value) and "[1, 1024]" in str(info.value)


def test_class_fishing_sends_its_model_again_against_known_noise():
    torch.manual_seed(0)
    model = FC2(SHAPE)
    defense = {"kind": "gaussian", "sigma": 0.01}
    noisy = client(defense)
    setting = Setting(model, FedSGD(), 16, SHAPE, 10, (0.0, 1.0), defense)
    rec = get("fishing", seed=0, strategy="class", iterations=2, restarts=1, repeats=5).interrogate(
        noisy, setting, ThreatModel(server="malicious", labels="known"))
    assert noisy.queries == 1 + 5 and rec.info["repeats"].startswith("5 (the same model sent 5 times")  # the labels, then 5


class Refusing(ClientQuery):
    """A client whose inspection answers ``rounds`` rounds of a batch and refuses the rest (a leak history's
    ``max_rounds``)."""

    def __init__(self, rounds, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = rounds

    def __call__(self, model):
        if self.queries >= self.rounds:
            self.queries += 1
            self.refused += 1
            raise ModelRefused(["leak history: this batch answered its rounds"])
        return super().__call__(model)


def test_a_client_that_stops_answering_leaves_the_server_the_rounds_it_already_holds():
    torch.manual_seed(0)
    model = FC2(SHAPE)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, *SHAPE, generator=g), torch.arange(16) % 10
    clean = ClientQuery(x, y, None, FedSGD())(model).update
    limited = Refusing(5, x, y, {"kind": "gaussian", "sigma": 0.05}, FedSGD())
    averaged, answered = query_averaged(limited, model, 16)
    assert answered == 5 and limited.queries == 6  # the sixth was refused, the five kept
    big = max(clean, key=lambda name: clean[name].numel())
    assert float((averaged.update[big] - clean[big]).std()) == pytest.approx(0.05 / 5 ** 0.5, rel=0.15)
    with pytest.raises(ModelRefused):  # refused from the first round: nothing was sent, the run is refused
        query_averaged(Refusing(0, x, y, None, FedSGD()), model, 16)


def test_a_refused_trap_says_what_was_asked_not_what_was_averaged():
    torch.manual_seed(0)
    model = FC2(SHAPE)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, *SHAPE, generator=g), torch.arange(16) % 10
    defense = {"kind": "gaussian", "sigma": 0.01}
    setting = Setting(model, FedSGD(), 16, SHAPE, 10, (0.0, 1.0), defense)
    rec = get("trap_weights", seed=0).interrogate(Refusing(0, x, y, defense, FedSGD()), setting,
                                                  ThreatModel(server="malicious", labels="known"))
    assert rec.info["refused"].startswith("leak history")  # a refused run, on record
    assert rec.info["repeats"] == f"{AUTO_REPEATS} asked; the client refused the first round and sent nothing"


def test_the_clients_round_budget_refuses_past_it_and_a_refused_model_spends_none():
    torch.manual_seed(0)
    model = FC2(SHAPE)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, *SHAPE, generator=g), torch.arange(16) % 10
    budgeted = ClientQuery(x, y, {"kind": "gaussian", "sigma": 0.05}, FedSGD(), max_rounds=3)
    averaged, answered = query_averaged(budgeted, model, 16)
    assert answered == 3 and budgeted.queries == 4 and budgeted.budget_refused == 1 and budgeted.refused == 0
    with pytest.raises(ModelRefused, match="round budget refused the model: client.max_rounds: this client has answered 3"):
        budgeted(model)
    inspecting = ClientQuery(x, y, None, FedSGD(), inspect=True, reference=model, max_rounds=1)
    with pytest.raises(ModelRefused) as refused:
        inspecting(M.class_fishing(model, target=2))
    assert refused.value.by == "inspection" and inspecting.answered == 0
    inspecting(model)  # the budget's one round is still there
    assert inspecting.answered == 1


@pytest.mark.parametrize("bad", [0, 2.5, True])
def test_a_bad_round_budget_is_one_line_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"^client.max_rounds: expected None or an integer in \[1, "):
        ClientQuery(torch.rand(2, *SHAPE), torch.arange(2), None, FedSGD(), max_rounds=bad)


def test_auto_repeats_spend_the_whole_round_budget_against_fresh_noise():
    noise = {"kind": "gaussian", "sigma": 0.01, "clip": 1.0}
    assert repeats_for(noise, "auto", 40) == 40 and repeats_for(noise, "auto", 1) == 1
    assert repeats_for(noise, "auto", 10 ** 6) == MAX_REPEATS and repeats_for({"kind": "sign"}, "auto", 40) == 1
    assert repeats_for(noise, 7, 40) == 7  # a number is what the attack asks; the client's budget refuses past it
    torch.manual_seed(0)
    model = FC2(SHAPE)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, *SHAPE, generator=g), torch.arange(16) % 10
    setting = Setting(model, FedSGD(), 16, SHAPE, 10, (0.0, 1.0), noise)
    budgeted = ClientQuery(x, y, noise, FedSGD(), max_rounds=6)
    rec = get("trap_weights", seed=0).interrogate(budgeted, setting, ThreatModel(server="malicious", labels="known"))
    assert budgeted.queries == 6 and budgeted.budget_refused == 0
    assert rec.info["repeats"].startswith("6 (the same model sent 6 times")


def test_the_server_simulates_averaged_rounds_as_noise_divided_by_their_root():
    stack = {"kind": "stack", "defenses": [{"kind": "gradprune", "ratio": 0.9}, {"kind": "gaussian", "sigma": 0.08, "clip": 1.0},
                                           {"kind": "laplace", "scale": 0.4}]}
    leaves = averaged_defense(stack, 16).leaves()
    assert leaves[0].ratio == 0.9 and leaves[1].sigma == pytest.approx(0.02) and leaves[1].clip == 1.0
    assert leaves[2].scale == pytest.approx(0.1)
    assert averaged_defense(stack, 1).leaves()[1].sigma == 0.08 and averaged_defense(None, 16) is None
    dp = {"kind": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    assert averaged_defense(dp, 16).leaves()[0].noise_multiplier == 1.0  # simulated at one round's: a floor
    # exact for Gaussian noise: the average of 16 clipped noisy updates has the simulated sigma
    torch.manual_seed(0)
    model = FC2(SHAPE)
    clean = client(None)(model).update
    noise = {"kind": "gaussian", "sigma": 0.08}
    averaged, _ = query_averaged(client(noise), model, 16)
    big = max(clean, key=lambda name: clean[name].numel())
    assert float((averaged.update[big] - clean[big]).std()) == pytest.approx(averaged_defense(noise, 16).leaves()[0].sigma,
                                                                             rel=0.1)


def test_noisy_reads_are_filtered_as_calibrated_on_the_attackers_own_images():
    """Single-row traps through Gaussian noise 0.01 clipped to 0.1, 16 rounds averaged (FC-2, 64 faces): the
    raw reads peak near SSIM 0.35, the filtered ones past 0.5 (2026-11-29). The filter is chosen per read
    from its estimated noise, calibrated on the auxiliary faces (never the client's)."""
    from scipy.optimize import linear_sum_assignment

    from guardfl.redteam.modality.image.data import load
    from guardfl.redteam.modality.image.metrics import ssim_matrix

    x, y = load("lfw-faces")
    shape, defense = (1, 25, 25), {"kind": "gaussian", "sigma": 0.01, "clip": 0.1}
    torch.manual_seed(0)
    setting = Setting(FC2(shape), FedSGD(), 64, shape, 10, (0.0, 1.0), defense)
    threat = ThreatModel(server="malicious", labels="known", aux=(x[64:], y[64:]))
    best = {}
    for mode in ("off", "auto"):
        query = ClientQuery(x[:64], y[:64], {**defense, "seed": 3}, FedSGD())
        rec = get("trap_weights", seed=0, chains=8, rows=1, repeats=16, denoise=mode).interrogate(query, setting, threat)
        s = ssim_matrix(rec.inputs, x[:64], 1.0)
        rows, cols = linear_sum_assignment(-s)
        best[mode] = float(s[rows, cols].max())
        assert rec.info["denoised"].startswith("off (set by denoise)" if mode == "off" else "gaussian")
    assert best["off"] < 0.4 < best["auto"], best
    # a known defense that draws no fresh noise: nothing white to filter, the reads as they are
    sign = Setting(FC2(shape), FedSGD(), 64, shape, 10, (0.0, 1.0), {"kind": "sign"})
    rec = get("trap_weights", seed=0, chains=8, rows=1).interrogate(ClientQuery(x[:64], y[:64], {"kind": "sign"}, FedSGD()), sign, threat)
    assert rec.info["denoised"] == "off (auto: the defense the server knows draws no fresh noise)"


@pytest.mark.parametrize("attack", ["trap_weights", "robbing_the_fed", "fishing", "threshold_bins"])
def test_a_bad_denoise_is_one_line_naming_the_field(attack):
    with pytest.raises(Exception) as info:
        get(attack, denoise="maybe")
    assert "denoise" in str(info.value) and "'auto', 'on' or 'off'" in str(info.value)
