"""The model, the data and the settings shared by the example's ServerApp and ClientApp."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 10


@dataclass(frozen=True)
class Settings:
    """Run settings. ``flwr run`` takes them from ``[tool.flwr.app.config]`` (keys with dashes);
    ``run.py`` passes them directly."""

    num_server_rounds: int = 3
    local_epochs: int = 1
    lr: float = 0.02
    batch_size: int = 16
    samples_per_client: int = 128
    num_partitions: int = 4
    #: the optimizer-level guardfl defense: a kind, YAML text or a .yaml path ("" = none)
    defense: str = "kind: sign"
    #: GradPrune ratio of the update-level mod (0 = no mod)
    update_prune: float = 0.9
    #: "cnn" (Net, the default) or "lenet" (the LeNet of Zhu et al. 2019, the gradient-inversion benchmark)
    model: str = "cnn"
    #: "synthetic" (offline), "faces" (LFW subset shipped with scikit-image, offline) or "cifar10"
    #: (downloads into data-root when download is true)
    dataset: str = "synthetic"
    data_root: str = "data"
    download: bool = False
    seed: int = 0
    #: where the ServerApp writes results.json ("" = nowhere)
    out_dir: str = ""

    def defense_config(self) -> dict | str | None:
        """The defense setting as ``guardfl.defenses.from_config`` takes it (a bare kind is allowed)."""
        text = self.defense.strip()
        if not text:
            return None
        if ":" not in text and not text.endswith((".yaml", ".yml")):
            return {"kind": text}
        return text

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], base: "Settings | None" = None) -> "Settings":
        base = base or cls()
        known = {f.name for f in fields(cls)}
        updates = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in known:
                updates[name] = type(getattr(base, name))(value)
        return replace(base, **updates)


class Net(nn.Module):
    """A small CNN for 3x16x16 inputs (3.6k parameters)."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def lenet(num_classes: int = NUM_CLASSES) -> nn.Module:
    """The LeNet of Zhu et al. 2019 (sigmoid, strided convs) for 3x16x16 inputs."""
    from guardfl.redteam.modality.image.models import LeNetZhu

    return LeNetZhu((3, 16, 16), num_classes)


def make_model(settings: "Settings") -> nn.Module:
    if settings.model == "cnn":
        return Net()
    if settings.model == "lenet":
        return lenet()
    raise ValueError(f"model: {settings.model!r}; allowed: cnn, lenet")


def faces() -> tuple[torch.Tensor, torch.Tensor]:
    """The 100 LFW faces shipped with scikit-image, as 3x16x16 images; labels i % 10 (the subset has no
    identities)."""
    from guardfl.redteam.modality.image.data import lfw_faces

    x, y = lfw_faces(NUM_CLASSES)
    x = F.interpolate(x, size=16, mode="bilinear", align_corners=False).clamp(0, 1)
    return x.expand(-1, 3, -1, -1).contiguous(), y


def synthetic(n: int, seed: int, *, template_seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images of 10 classes: each class is a fixed smooth random pattern, plus noise. Learnable in a
    few rounds, offline, and the same class patterns for every client and the server."""
    g = torch.Generator().manual_seed(template_seed)
    templates = F.interpolate(torch.rand(NUM_CLASSES, 3, 4, 4, generator=g), size=16, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    images = (templates[labels] + 0.25 * torch.randn(n, 3, 16, 16, generator=g)).clamp(0, 1)
    return images, labels


def cifar10(settings: Settings, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torchvision import datasets

    try:
        ds = datasets.CIFAR10(settings.data_root, train=train, download=settings.download)
    except RuntimeError as err:
        raise RuntimeError(f"CIFAR-10 not found under {settings.data_root!r}; set download = true ({err})") from None
    images = torch.as_tensor(ds.data).permute(0, 3, 1, 2).float().div(255)
    return F.interpolate(images, size=16, mode="bilinear", align_corners=False), torch.as_tensor(ds.targets)


def client_data(settings: Settings, partition_id: int) -> TensorDataset:
    """Client ``partition_id``'s private samples (disjoint across partitions)."""
    if not 0 <= partition_id < settings.num_partitions:
        raise ValueError(f"partition-id: must be in [0, {settings.num_partitions}) (got {partition_id})")
    n = settings.samples_per_client
    if settings.dataset == "synthetic":
        return TensorDataset(*synthetic(n, seed=settings.seed * 1000 + partition_id + 1))
    if settings.dataset in ("cifar10", "faces"):
        x, y = cifar10(settings, train=True) if settings.dataset == "cifar10" else faces()
        lo = partition_id * n
        if lo + n > len(x):
            raise ValueError(f"samples-per-client: {settings.num_partitions} partitions of {n} need {settings.num_partitions * n} "
                             f"images; {settings.dataset} has {len(x)}")
        return TensorDataset(x[lo : lo + n], y[lo : lo + n])
    raise ValueError(f"dataset: {settings.dataset!r}; allowed: synthetic, faces, cifar10")


def client_loader(settings: Settings, partition_id: int) -> DataLoader:
    g = torch.Generator().manual_seed(settings.seed * 7919 + partition_id)
    return DataLoader(client_data(settings, partition_id), batch_size=settings.batch_size, shuffle=True, generator=g)


def test_data(settings: Settings, n: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    if settings.dataset == "cifar10":
        x, y = cifar10(settings, train=False)
        return x[:n], y[:n]
    if settings.dataset == "faces":
        x, y = faces()
        return x[-n:], y[-n:]
    return synthetic(n, seed=10_000_000 + settings.seed)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    logits = model(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
