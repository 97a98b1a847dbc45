"""Built-in victim models of the papers, and the model-state initialisations the threat model names."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

import torch
from torch import nn


class LeNetZhu(nn.Module):
    """The LeNet of Zhu et al. 2019 (DLG): three 5x5 convs with 12 channels and sigmoid activations
    (strides 2, 2, 1), then one linear layer. Sigmoid keeps it twice differentiable everywhere."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10) -> None:
        super().__init__()
        c = in_shape[0]
        self.body = nn.Sequential(
            nn.Conv2d(c, 12, 5, padding=2, stride=2), nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=2), nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=1), nn.Sigmoid(),
        )
        with torch.no_grad():
            features = self.body(torch.zeros(1, *in_shape)).numel()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))


class ConvNetSmall(nn.Module):
    """A small ReLU ConvNet with BatchNorm (for BN threat models at low cost)."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        c = in_shape[0]
        self.body = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.fc = nn.Linear(2 * width * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).flatten(1))


def resnet18_cifar(in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10) -> nn.Module:
    """torchvision ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool), as in Huang et al. 2021."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_shape[0], 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[..., nn.Module]] = {
    "lenet": LeNetZhu,
    "convnet": ConvNetSmall,
    "resnet18": resnet18_cifar,
}


def wide_init_(model: nn.Module, bound: float = 0.5) -> nn.Module:
    """The U(-0.5, 0.5) initialisation of DLG-era code (Zhu et al. 2019). A WORST CASE for privacy:
    Wang et al. 2024 (Sec. III) show that this wide distribution makes gradients far more revealing
    than PyTorch's default initialisation; use it to stress a defense, not to model a deployment."""
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-bound, bound)
    return model


def set_model_state(
    model: nn.Module, state: Literal["default", "wide-init"] | str | Path = "default", *, seed: int | None = None
) -> nn.Module:
    """Put ``model`` in an explicit state, in place: ``"default"`` (PyTorch's own initialisation, the
    realistic start of training), ``"wide-init"`` (U(-0.5, 0.5): the DLG-era WORST CASE), or the path of
    a checkpoint (a state dict, or a dict with ``"state_dict"`` / ``"model"``). ``seed`` makes the
    initialisation reproducible without touching the global RNG."""
    if state in ("default", "wide-init"):
        fork = torch.random.fork_rng() if seed is not None else _nullcontext()
        with fork:
            if seed is not None:
                torch.manual_seed(seed)
            for module in model.modules():
                if hasattr(module, "reset_parameters") and module is not model:
                    module.reset_parameters()
            if state == "wide-init":
                wide_init_(model)
        return model
    path = Path(state)
    if not path.is_file():
        raise ValueError(f"model state: {state!r} is neither 'default', 'wide-init' nor an existing checkpoint file")
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, dict) and ("state_dict" in loaded or "model" in loaded):
        loaded = loaded.get("state_dict", loaded.get("model"))
    loaded = {k.removeprefix("_module."): v for k, v in loaded.items()}  # Opacus GradSampleModule keys
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
