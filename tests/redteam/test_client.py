import copy

import pytest
import torch
import torch.nn.functional as F

from guardfl.defenses import GradPrune, SignCompression
from guardfl.redteam import FedAvg, FedSGD, simulate_client
from guardfl.redteam.models import ConvNetSmall


def test_fedsgd_transmits_the_defended_gradient(wide_lenet, faces):
    x, y = faces[:2], torch.tensor([1, 4])
    obs = simulate_client(wide_lenet, x, y, SignCompression(), FedSGD())
    F.cross_entropy(wide_lenet(x), y).backward()
    for name, p in wide_lenet.named_parameters():
        assert torch.equal(obs.update[name], p.grad.sign())
    assert obs.defense_config["kind"] == "sign" and obs.batch_size == 2


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
    from guardfl.defenses import DPSGD, InstaHide, Stack

    for d in (InstaHide(), Stack(GradPrune(0.5), DPSGD(noise_multiplier=1.0))):
        with pytest.raises(ValueError, match="simulates gradient defenses"):
            simulate_client(torch.nn.Linear(3, 2), torch.zeros(1, 3), torch.tensor([0]), d)


def test_model_state_is_explicit(tmp_path):
    from guardfl.redteam.models import LeNetZhu, set_model_state

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
