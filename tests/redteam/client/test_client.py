import copy

import pytest
import torch
import torch.nn.functional as F

from guardfl.defenses import GradPrune, SignCompression
from guardfl.redteam import FedAvg, FedSGD, simulate_client
from guardfl.redteam.modality.image.models import ConvNetSmall


def test_fedsgd_transmits_the_defended_gradient(wide_lenet, faces):
    x, y = faces[:2], torch.tensor([1, 4])
    obs = simulate_client(wide_lenet, x, y, SignCompression(), FedSGD())
    F.cross_entropy(wide_lenet(x), y).backward()
    for name, p in wide_lenet.named_parameters():
        assert torch.equal(obs.update[name], p.grad.sign())
    assert obs.defense_config.kind == "sign" and obs.batch_size == 2


def test_fedavg_without_defense_is_plain_sgd(wide_lenet, faces):
    x, y = faces[:4], torch.tensor([0, 1, 2, 3])
    proto = FedAvg(epochs=2, batch_size=2, lr=0.05, momentum=0.9, weight_decay=1e-3)
    obs = simulate_client(wide_lenet, x, y, None, proto)
    ref = copy.deepcopy(wide_lenet)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for _ in range(2):
        for i in (0, 2):
            opt.zero_grad()
            F.cross_entropy(ref(x[i : i + 2]), y[i : i + 2]).backward()
            opt.step()
    for (name, p0), p1 in zip(wide_lenet.named_parameters(), ref.parameters()):
        assert torch.equal(obs.update[name], p1.detach() - p0.detach())


def test_fedavg_update_carries_the_defense(wide_lenet, faces):
    obs = simulate_client(wide_lenet, faces[:1], torch.tensor([3]), GradPrune(0.9), FedAvg(lr=0.1))
    for name, delta in obs.update.items():
        n = delta.numel()
        assert int((delta != 0).sum()) <= n - (9 * n) // 10
    assert obs.side.defense_stats[0]["stages"][0]["kind"] == "gradprune"


def test_global_model_untouched_and_train_mode_bn(faces):
    torch.manual_seed(0)
    model = ConvNetSmall((1, 25, 25), 10)
    before = copy.deepcopy(model.state_dict())
    x, y = faces[:4], torch.tensor([0, 1, 2, 3])
    obs = simulate_client(model, x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    eval_obs = simulate_client(model, x, y, train_mode=False)
    assert not torch.equal(obs.update["fc.weight"], eval_obs.update["fc.weight"])  # BN mode matters
    m, v = obs.side.bn_batch_stats[0]
    assert torch.allclose(m, model.body[0](x).mean((0, 2, 3)), atol=1e-6)
    assert len(obs.released_bn_stats) == 2


def test_bad_inputs():
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        simulate_client(frozen, torch.zeros(1, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="same non-zero batch size"):
        simulate_client(torch.nn.Linear(3, 2), torch.zeros(2, 3), torch.tensor([0]))
    with pytest.raises(ValueError, match="FedAvg.lr"):
        FedAvg(lr=0)
    from guardfl.defenses import DPSGD, InstaHide
    from guardfl.errors import ConfigError

    with pytest.raises(ConfigError, match="instahide.k"):  # k larger than the batch
        simulate_client(torch.nn.Linear(3, 2), torch.zeros(1, 3), torch.tensor([0]), InstaHide(k=4))
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="DP-SGD cannot train this model"):
        simulate_client(bn, torch.zeros(2, 3), torch.tensor([0, 1]), DPSGD(noise_multiplier=1.0))


def test_model_state_is_explicit(tmp_path):
    from guardfl.redteam.modality.image.models import LeNetZhu, set_model_state

    a = set_model_state(LeNetZhu((1, 25, 25)), "default", seed=3)
    b = set_model_state(LeNetZhu((1, 25, 25)), "default", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    wide = set_model_state(LeNetZhu((1, 25, 25)), "wide-init", seed=3)
    assert float(wide.fc.weight.detach().abs().max()) > 0.4 > float(a.fc.weight.detach().abs().max())
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": {f"_module.{k}": v for k, v in wide.state_dict().items()}}, path)
    c = set_model_state(LeNetZhu((1, 25, 25)), path)
    assert torch.equal(c.fc.weight, wide.fc.weight)
    with pytest.raises(ValueError, match="neither"):
        set_model_state(LeNetZhu((1, 25, 25)), "nonexistent.pt")


# -- DP-SGD and input encodings go through guardfl.protect ---------------------------------------------------
def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _flat(obs):
    return torch.cat([v.reshape(-1) for v in obs.update.values()])


def test_dpsgd_fedsgd_is_clipped_mean_plus_noise_of_exactly_the_batch():
    from guardfl.defenses import DPSGD

    model, x, y = _tiny(), torch.rand(4, 3, 2, 2), torch.tensor([0, 1, 2, 0])
    c = 0.01
    quiet = simulate_client(model, x, y, DPSGD(noise_multiplier=0.0, max_grad_norm=c))
    # reference: per-sample gradients clipped to c, averaged over the 4 samples of THIS batch
    ref = []
    for i in range(4):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        ref.append(g * min(1.0, c / (float(g.norm()) + 1e-6)))
    assert torch.allclose(_flat(quiet), torch.stack(ref).mean(0), atol=1e-7)
    sigma = 3.0
    noisy = simulate_client(model, x, y, DPSGD(noise_multiplier=sigma, max_grad_norm=c, seed=1))
    noise = _flat(noisy) - _flat(quiet)
    assert abs(float(noise.std()) / (sigma * c / 4) - 1) < 0.15  # std = sigma * C / batch size
    again = simulate_client(model, x, y, DPSGD(noise_multiplier=sigma, max_grad_norm=c, seed=1))
    assert torch.equal(_flat(noisy), _flat(again))  # the noise is the defense's seeded generator


def test_dpsgd_stack_applies_gradient_defense_after_the_noise():
    from guardfl.defenses import DPSGD, Stack

    model, x, y = _tiny(), torch.rand(4, 3, 2, 2), torch.tensor([0, 1, 2, 0])
    obs = simulate_client(model, x, y, Stack(DPSGD(noise_multiplier=1.0, seed=2), GradPrune(0.75)))
    for v in obs.update.values():  # pruning per layer after Opacus: 75% zeros in every layer
        assert abs(float((v == 0).float().mean()) - 0.75) <= 1.0 / v.numel() + 1e-9


def test_encoded_client_trains_on_encodings_with_soft_labels():
    from guardfl.defenses import InstaHide, MixUp

    model, x, y = _tiny(), torch.rand(6, 3, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    for d in (MixUp(k=3, seed=4), InstaHide(k=3, seed=4)):
        obs = simulate_client(model, x, y, d)
        (enc, soft), = obs.side.trained
        assert enc.shape == x.shape and soft.shape == (6, 3)
        assert not torch.allclose(enc, x)
        # what leaves the client is the gradient on the encodings it trained on
        model.zero_grad()
        (-(soft * torch.log_softmax(model(enc), -1)).sum(-1).mean()).backward()
        ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert torch.allclose(_flat(obs), ref, atol=1e-6)
        assert torch.equal(obs.side.training_labels(), soft)
        assert torch.equal(obs.side.labels, y)  # the private labels stay for the metrics


def test_encoded_fedavg_draws_fresh_encodings_every_step():
    from guardfl.defenses import MixUp

    model, x, y = _tiny(), torch.rand(4, 3, 2, 2), torch.tensor([0, 1, 2, 0])
    obs = simulate_client(model, x, y, MixUp(k=2), FedAvg(epochs=2, batch_size=2, lr=0.1))
    assert len(obs.side.trained) == 4
    assert not torch.allclose(obs.side.trained[0][0], obs.side.trained[2][0])  # same samples, new mix


def test_an_eval_mode_client_cannot_run_dpsgd():
    """Opacus computes per-sample gradients in train mode only: the pair is refused in the config (before any
    work) and by the client round itself, instead of silently training in train mode."""
    from guardfl.config import validate
    from guardfl.defenses import DPSGD
    from guardfl.errors import ConfigError
    from guardfl.redteam.config import RedTeamConfig

    stack = {"kind": "stack", "defenses": [{"kind": "dpsgd", "noise_multiplier": 1.0}, {"kind": "gradprune", "ratio": 0.5}]}
    with pytest.raises(ConfigError, match="client.train_mode"):
        validate(RedTeamConfig, {"client": {"train_mode": False}, "defense": stack}, prefix="redteam")
    assert not validate(RedTeamConfig, {"client": {"train_mode": False}, "defense": {"kind": "gradprune", "ratio": 0.5}},
                        prefix="redteam").client.train_mode
    with pytest.raises(ConfigError, match="train_mode"):
        simulate_client(_tiny(), torch.rand(2, 3, 2, 2), torch.tensor([0, 1]), DPSGD(noise_multiplier=1.0), train_mode=False)
