"""The model and the data shared by the example's server and sites (offline, CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 10


class Net(nn.Module):
    """A small CNN for 3x16x16 inputs (3.6k parameters), the Flower example's. ``seed`` fixes the initial
    weights: NVFlare's server persistor builds the initial global model from this class and its arguments."""

    def __init__(self, num_classes: int = NUM_CLASSES, seed: int | None = 0) -> None:
        super().__init__()
        self.num_classes, self.seed = num_classes, seed
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
            self.fc = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def synthetic(n: int, seed: int, *, template_seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of 10 classes: a fixed smooth random pattern per class, plus noise (the same class
    patterns at every site and the server)."""
    g = torch.Generator().manual_seed(template_seed)
    templates = F.interpolate(torch.rand(NUM_CLASSES, 3, 4, 4, generator=g), size=16, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return (templates[labels] + 0.25 * torch.randn(n, 3, 16, 16, generator=g)).clamp(0, 1), labels


def lenet(num_classes: int = NUM_CLASSES) -> nn.Module:
    """The LeNet of Zhu et al. 2019 (sigmoid, strided convs) for 3x16x16 inputs: the gradient-inversion
    benchmark, used by the red team's certificate (configs/nvflare-example.yaml)."""
    from guardfl.redteam.modality.image.models import LeNetZhu

    return LeNetZhu((3, 16, 16), num_classes)


def make_model(name: str) -> nn.Module:
    if name == "cnn":
        return Net()
    if name == "lenet":
        return lenet()
    raise ValueError(f"model: {name!r}; allowed: cnn, lenet")


def faces() -> tuple[torch.Tensor, torch.Tensor]:
    """The 100 LFW faces shipped with scikit-image, as 3x16x16 images; labels i % 10 (the subset has no
    identities: for the red team's reconstructions, not for accuracy)."""
    from guardfl.redteam.modality.image.data import lfw_faces

    x, y = lfw_faces(NUM_CLASSES)
    x = F.interpolate(x, size=16, mode="bilinear", align_corners=False).clamp(0, 1)
    return x.expand(-1, 3, -1, -1).contiguous(), y


def site_index(site_name: str) -> int:
    """``site-3`` -> 2 (the simulator names its sites site-1, site-2, ...)."""
    try:
        return int(site_name.rsplit("-", 1)[1]) - 1
    except (IndexError, ValueError):
        raise ValueError(f"site name: expected site-N, got {site_name!r}") from None


def site_loader(index: int, samples: int, batch_size: int = 16, seed: int = 0, dataset: str = "synthetic") -> DataLoader:
    """Site ``index``'s private samples (disjoint across sites): ``synthetic`` or ``faces``."""
    if dataset == "synthetic":
        data = TensorDataset(*synthetic(samples, seed=seed * 1000 + index + 1))
    elif dataset == "faces":
        x, y = faces()
        lo = index * samples
        if lo + samples > len(x):
            raise ValueError(f"samples: site {index + 1} needs faces {lo}..{lo + samples - 1}; there are {len(x)}")
        data = TensorDataset(x[lo : lo + samples], y[lo : lo + samples])
    else:
        raise ValueError(f"dataset: {dataset!r}; allowed: synthetic, faces")
    return DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed * 7919 + index))


def test_data(n: int = 500, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic(n, seed=10_000_000 + seed)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())
