"""One client loop (issue 35): the red team's ``simulate_client`` and the user's ``local_update`` run the same
round (``guardfl.integrations.round.client_round``), so for every defense kind in the registry and both
protocols the update a certificate judges is bit for bit the update a deployed client sends."""

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from guardfl.defenses import (DPSGD, GaussianNoise, GradDefense, GradPrune, Identity, InstaHide, LaplaceNoise, MixUp,
                              Outpost, SignCompression, Soteria, Stack)
from guardfl.defenses.registry import available
from guardfl.errors import ConfigError
from guardfl.integrations.round import FedAvg, FedSGD, client_round, round_defense
from guardfl.integrations.torch import ClientState, local_update
from guardfl.redteam import simulate_client

PUBLIC = torch.rand(5, 1, 4, 4, generator=torch.Generator().manual_seed(11))  # Inter-InstaHide's public images
FEDAVG = FedAvg(epochs=2, batch_size=2, lr=0.05, momentum=0.9, weight_decay=1e-3)

#: one or more configurations per registered kind (seeded: the same seed gives the same draws on both paths)
DEFENSES = {
    "identity": [lambda s: Identity()],
    "gradprune": [lambda s: GradPrune(0.5, seed=s)],
    "sign": [lambda s: SignCompression(seed=s)],
    "gaussian": [lambda s: GaussianNoise(0.01, seed=s)],
    "laplace": [lambda s: LaplaceNoise(0.01, seed=s)],
    "outpost": [lambda s: Outpost(beta=0.5, seed=s)],
    "soteria": [lambda s: Soteria(0.5, seed=s)],
    "graddefense": [lambda s: GradDefense(slices=4, perturb_slices=2, root_size=4, seed=s)],
    "dpsgd": [lambda s: DPSGD(noise_multiplier=1.0, max_grad_norm=0.5, seed=s),
              lambda s: DPSGD(noise_multiplier=0.5, max_grad_norm=1.0, poisson_sampling=False, seed=s)],
    "mixup": [lambda s: MixUp(k=2, seed=s)],
    "instahide": [lambda s: InstaHide(k=2, seed=s),
                  lambda s: InstaHide(k=3, mode="inter", public=PUBLIC, seed=s)],
    "stack": [lambda s: Stack(GradPrune(0.5), GaussianNoise(0.01), seed=s),
              lambda s: Stack(DPSGD(noise_multiplier=1.0, max_grad_norm=0.5), GradPrune(0.5), seed=s),
              lambda s: Stack(MixUp(k=2), Outpost(beta=0.5), seed=s)],
}
CASES = [(kind, i) for kind, makers in DEFENSES.items() for i in range(len(makers))]


def test_every_registered_kind_is_covered():
    assert set(DEFENSES) == set(available())


def net(bn: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(1, 3, 3), *([torch.nn.BatchNorm2d(3)] if bn else []), torch.nn.ReLU(), torch.nn.Flatten(),
              torch.nn.Linear(12, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)]
    return torch.nn.Sequential(*layers)


def both(model, x, y, defense, protocol, seed):
    """(simulate_client's update, local_update's) from the same model, data, defense and global RNG state."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes (secure RNG, backward hooks, alpha range)
        torch.manual_seed(seed)  # Opacus's Poisson sampler draws from the global RNG, on both paths
        observed = simulate_client(model, x, y, defense, protocol).update
        torch.manual_seed(seed)
        client = copy.deepcopy(model)
        if isinstance(protocol, FedSGD):
            loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
            # any lr: the gradient is taken before the step
            sent = local_update(client, loader, lambda p: torch.optim.SGD(p, lr=0.3), defense, state=ClientState()).gradient
        else:
            loader = DataLoader(TensorDataset(x, y), batch_size=protocol.batch_size)
            make = lambda p: torch.optim.SGD(p, lr=protocol.lr, momentum=protocol.momentum,  # noqa: E731
                                             weight_decay=protocol.weight_decay)
            sent = local_update(client, loader, make, defense, epochs=protocol.epochs, state=ClientState()).delta
    return observed, sent


@pytest.mark.parametrize("protocol", [FedSGD(), FEDAVG], ids=["fedsgd", "fedavg"])
@pytest.mark.parametrize("kind,i", CASES, ids=[f"{k}{i or ''}" for k, i in CASES])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), pairs=st.integers(1, 3), bn=st.booleans())
def test_simulate_client_sends_what_local_update_sends_bit_for_bit(kind, i, protocol, seed, pairs, bn):
    defense = DEFENSES[kind][i](seed)
    dp = "dp" in defense.stages
    bn = bn and not dp  # Opacus refuses BatchNorm (both paths: see below)
    n = 2 * pairs  # whole mini-batches of 2: the intra-batch encodings need k = 2 images per batch
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    model = net(bn)
    observed, sent = both(model, x, y, defense, protocol, seed)
    assert sent is not None and set(observed) <= set(sent)
    assert set(observed) == {name for name, _ in model.named_parameters()}
    for name, value in observed.items():
        assert torch.equal(value, sent[name]), name
    assert any(v.abs().sum() > 0 for v in observed.values())


def test_both_paths_refuse_dp_on_batchnorm_and_dp_in_eval_mode():
    x, y = torch.rand(4, 1, 4, 4), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ConfigError, match="DP-SGD cannot train this model"):
        simulate_client(net(True), x, y, DPSGD(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="DP-SGD cannot train this model"):
        local_update(net(True), DataLoader(TensorDataset(x, y), batch_size=4), lambda p: torch.optim.SGD(p, lr=0.1),
                     DPSGD(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="train_mode"):
        simulate_client(net(False), x, y, DPSGD(noise_multiplier=1.0), train_mode=False)


def test_round_defense_keeps_inter_instahide_public_images_and_a_stacks_members():
    d = InstaHide(k=3, mode="inter", public=PUBLIC, seed=4)
    fresh = round_defense(Stack(d, seed=1), 2)
    (member,) = fresh.members
    assert member is not d and member._public_tensor is PUBLIC
    x = torch.rand(2, 1, 4, 4)
    a = round_defense(d, 0).encode(x, torch.tensor([0, 1]), 3)
    b = round_defense(d, 0).encode(x, torch.tensor([0, 1]), 3)
    assert torch.equal(a[0], b[0])  # round 0 of a seeded defense starts from its seed
    assert not torch.equal(a[0], round_defense(d, 1).encode(x, torch.tensor([0, 1]), 3)[0])


def test_a_poisson_batch_left_empty_still_takes_its_noise_only_step():
    """Under DP-SGD a Poisson-sampled round can draw an empty batch; the client still steps (noise only, and
    the accountant counts it), as Opacus does: every step of the round moves the weights."""
    torch.manual_seed(0)
    model = net(False)
    x, y = torch.rand(8, 1, 4, 4), torch.randint(0, 3, (8,))
    loader = DataLoader(TensorDataset(x, y), batch_size=1)  # sample rate 1/8: empty batches are likely
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = client_round(model, loader, lambda p: torch.optim.SGD(p, lr=0.1),
                              DPSGD(noise_multiplier=1.0, max_grad_norm=0.5, seed=0), record=True)
    sizes = [len(bx) for bx, _ in result.batches]
    assert result.steps == 8 and 0 in sizes and result.examples == sum(sizes)


class HalfPrune(GradPrune):
    """A user's subclass (its own ``_apply_``): each round's fresh defense must be one of these, not the
    registry's GradPrune."""

    def _apply_(self, grads, ctx):
        for g in grads:
            g.mul_(0.5)
        return super()._apply_(grads, ctx)


def test_round_defense_keeps_a_users_subclass_alone_and_in_a_stack():
    assert type(round_defense(HalfPrune(0.5), 3)) is HalfPrune
    (member, _) = round_defense(Stack(HalfPrune(0.5), GaussianNoise(0.01), seed=2), 1).members
    assert type(member) is HalfPrune
    model, x, y = net(False), torch.rand(2, 1, 4, 4), torch.tensor([0, 1])
    plain, halved = simulate_client(model, x, y, GradPrune(0.5)).update, simulate_client(model, x, y, HalfPrune(0.5)).update
    assert all(torch.equal(halved[k], plain[k] * 0.5) for k in plain)
