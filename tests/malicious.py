"""Malicious-server models built from the papers' descriptions, and benign models to hold them against.

Shared by tests/guardfl/test_inspect.py, the integration tests and bench/bench_inspect.py.

- ``with_imprint``: Robbing the Fed (Fowl et al. 2022): an imprint block in front of the user's model:
  ``Linear(d -> k)`` whose rows are all one measurement vector times a gain, biases ``-gain`` times
  increasing Gaussian quantiles (the bins), ReLU, then ``Linear(k -> d)`` back to the input's shape.
- ``class_fishing``: Wen et al. 2022 as breaching implements it (``cls_attack``): the classification
  layer's rows zeroed except the target's, and every other class's bias set to 1000.
- ``feature_fishing``: Wen et al.'s feature fishing (breaching ``feature_attack``): one weight left,
  on the target class and one feature, times a multiplier, and the target's bias the feature's
  threshold.
"""

from __future__ import annotations

import copy
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch
from torch import nn

CIFAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-train-5k.npz"
CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


# -- malicious modifications -----------------------------------------------------------------------------
def imprint_block(in_shape=(3, 32, 32), bins: int = 64, gain: float = 1e3, seed: int = 0) -> nn.Module:
    """Robbing the Fed's imprint block: bins of one linear measurement of the (normalised) input."""
    d = int(np.prod(in_shape))
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g)
    v /= v.norm()  # <v, x> of a normalised image ~ N(0, 1) across images
    quantiles = torch.tensor([NormalDist().inv_cdf((i + 1) / (bins + 1)) for i in range(bins)])
    first, second = nn.Linear(d, bins), nn.Linear(bins, d)
    with torch.no_grad():
        first.weight.copy_(gain * v.expand(bins, d))
        first.bias.copy_(-gain * quantiles)
        second.weight.copy_(v[:, None].expand(d, bins) / gain)  # passes the measurement back along v
        second.bias.zero_()
    return nn.Sequential(nn.Flatten(), first, nn.ReLU(), second, nn.Unflatten(1, in_shape))


def with_imprint(model: nn.Module, in_shape=(3, 32, 32), bins: int = 64, seed: int = 0) -> nn.Module:
    """The user's model with an imprint block inserted in front (as the server sends it)."""
    return nn.Sequential(imprint_block(in_shape, bins, seed=seed), copy.deepcopy(model))


def last_linear(model: nn.Module) -> nn.Linear:
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


def class_fishing(model: nn.Module, target: int = 0, keep_target_row: bool = False) -> nn.Module:
    """Class fishing: every classification row zeroed but the target's (breaching sets it to 0.5s;
    ``keep_target_row`` keeps the trained row), every other bias 1000."""
    fished = copy.deepcopy(model)
    head = last_linear(fished)
    with torch.no_grad():
        row = head.weight[target].clone() if keep_target_row else torch.full_like(head.weight[target], 0.5)
        head.weight.zero_()
        head.weight[target] = row
        bias = head.bias[target].clone()
        head.bias.fill_(1000.0)
        head.bias[target] = bias
    return fished


def feature_fishing(model: nn.Module, target: int = 0, feature: int = 0, value: float = 0.5,
                    multiplier: float = 1000.0) -> nn.Module:
    """Feature fishing: the target class looks at one feature only, amplified, thresholded at ``value``;
    the other classes' logits are 0."""
    fished = copy.deepcopy(model)
    head = last_linear(fished)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[target, feature] = multiplier
        head.bias.zero_()
        head.bias[target] = -value * multiplier
    return fished


# -- benign models -----------------------------------------------------------------------------------------
def small_cnn(seed: int = 0) -> nn.Module:
    from guardfl.redteam.modality.image.models import ConvNetSmall

    torch.manual_seed(seed)
    return ConvNetSmall()


def lenet(seed: int = 0, wide: bool = False) -> nn.Module:
    from guardfl.redteam.modality.image.models import LeNetZhu, wide_init_

    torch.manual_seed(seed)
    model = LeNetZhu()
    return wide_init_(model) if wide else model


def resnet18(seed: int = 0) -> nn.Module:
    from guardfl.redteam.modality.image.models import resnet18_cifar

    torch.manual_seed(seed)
    return resnet18_cifar()


def linear_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))


def cifar(n: int = 256, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` normalised CIFAR-10 images (N, 3, 32, 32) and labels from the shared 5k sample, in a fixed
    shuffled order (the file is sorted by class), from position ``offset`` of that order."""
    data = np.load(CIFAR)
    idx = np.random.default_rng(0).permutation(len(data["y"]))[offset:offset + n]
    x = torch.from_numpy(data["x"][idx]).permute(0, 3, 1, 2).float() / 255.0
    return (x - CIFAR_MEAN) / CIFAR_STD, torch.from_numpy(data["y"][idx]).long()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 2, lr: float = 0.05,
          batch_size: int = 32, seed: int = 0) -> nn.Module:
    """Plain SGD (momentum 0.9) on (x, y), in place; returns the model."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch_size):
            idx = order[i:i + batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def fedavg(global_model: nn.Module, x: torch.Tensor, y: torch.Tensor, clients: int = 4, rounds: int = 2,
           epochs: int = 1, lr: float = 0.05) -> list[nn.Module]:
    """FedAvg over ``clients`` equal IID shards of (x, y): the global model after each round."""
    shards = [(x[i::clients], y[i::clients]) for i in range(clients)]
    current = copy.deepcopy(global_model)
    history = []
    for rnd in range(rounds):
        states = [train(copy.deepcopy(current), xs, ys, epochs, lr, seed=rnd * clients + c).state_dict()
                  for c, (xs, ys) in enumerate(shards)]
        avg = {k: (torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype) if v.is_floating_point()
                   else states[0][k]) for k, v in current.state_dict().items()}
        current.load_state_dict(avg)
        history.append(copy.deepcopy(current))
    return history
