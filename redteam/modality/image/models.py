"""Built-in victim models of the papers, and the model-state initialisations the threat model names."""

from __future__ import annotations

import contextlib
import math
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
        fork = torch.random.fork_rng() if seed is not None else contextlib.nullcontext()
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
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a text file, a pickle with code (weights_only refuses it), a truncated file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"model.state: {path} is not a PyTorch checkpoint of tensors ({first[:160]})") from None
    if isinstance(loaded, dict) and ("state_dict" in loaded or "model" in loaded):
        loaded = loaded.get("state_dict", loaded.get("model"))
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"model.state: {path} holds {type(loaded).__name__}, not a state dict of tensors")
    loaded = {k.removeprefix("_module."): v for k, v in loaded.items()}  # Opacus GradSampleModule keys
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    if missing or unexpected:
        raise ValueError(f"model.state: checkpoint {path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model


class FC2(nn.Module):
    """FC-2 of the Cocktail Party Attack paper (Kariyappa et al. 2023): flatten, a 256-wide ReLU hidden
    layer, a linear output."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__()
        size = 1
        for d in in_shape:
            size *= d
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class FC2BN(nn.Module):
    """FC-2 with batch normalisation: flatten, ``Linear(d, hidden)``, ``BatchNorm1d(hidden)``, ReLU, a linear
    output. The normalised MLP of tabular and small-image FL: in train mode every hidden unit's gradient
    mixes the whole batch (the setting in which Wang and Li 2025, "Hear No Evil", expect malicious-server
    constructions to fail; ``trap_weights`` adapts to it)."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__()
        size = math.prod(in_shape)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(size, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class FC2GN(FC2BN):
    """``fc2bn`` as ``guardfl.dp_compatible`` makes it for DP-SGD (Opacus's fix: ``GroupNorm(min(32, hidden),
    hidden)`` in BatchNorm's place; the same state-dict keys): per-sample normalisation, no batch coupling."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__(in_shape, num_classes, hidden)
        self.net[2] = nn.GroupNorm(min(32, hidden), hidden)


class FC2LN(FC2BN):
    """FC-2 with layer normalisation: ``LayerNorm(hidden)`` in BatchNorm's place (the normalisation of
    transformer MLP blocks; per sample, over the hidden units; Opacus trains it as it is)."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__(in_shape, num_classes, hidden)
        self.net[2] = nn.LayerNorm(hidden)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32x32 images (He et al. 2016, Sec. 4.2): 3 stages of 3 basic blocks, 16/32/64 channels."""

    def __init__(self, in_shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_shape[0], 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def vgg16(in_shape: tuple[int, int, int] = (3, 224, 224), num_classes: int = 1000) -> nn.Module:
    """torchvision's VGG-16 (the Cocktail Party Attack paper's CNN), dropout off (identity) so the client's
    update is deterministic given its batch. ``classifier[0]`` (25,088 -> 4,096) is the linear layer CPA
    unmixes. Weights: PyTorch's default initialisation; pretrained weights are not downloaded here: give
    a checkpoint as ``model.state`` (e.g. torchvision's ImageNet state dict saved with ``torch.save``)."""
    import torchvision

    model = torchvision.models.vgg16(num_classes=num_classes)
    if in_shape[0] != 3:
        model.features[0] = nn.Conv2d(in_shape[0], 64, 3, padding=1)
    for i, layer in enumerate(model.classifier):
        if isinstance(layer, nn.Dropout):
            model.classifier[i] = nn.Identity()
    return model


MODELS.update({"fc2": FC2, "fc2bn": FC2BN, "fc2gn": FC2GN, "fc2ln": FC2LN, "resnet20": ResNet20, "vgg16": vgg16})


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int, vocab_size: int | None = None) -> nn.Module:
    """A built-in model by name, or ``module:callable`` (the user's factory, called as
    ``factory(in_shape=..., num_classes=...)`` when it accepts those, else with no arguments; a text
    model's factory also gets ``vocab_size`` when it accepts it). Built-in text models
    (``textmodels.TEXT_MODELS``) take the tokenizer's ``vocab_size``."""
    from guardfl.redteam.modality.text.models import TEXT_MODELS

    if name in TEXT_MODELS:
        if vocab_size is None:
            raise ValueError(f"model.name: {name} is a text model; it needs a tokenizer's vocabulary (data.tokenizer)")
        return TEXT_MODELS[name](vocab_size, num_classes)
    if name in MODELS:
        return MODELS[name](in_shape, num_classes)
    if ":" not in name:
        raise ValueError(f"model.name: unknown model {name!r}; allowed: {', '.join(sorted(MODELS))} or 'module:callable'")
    import inspect

    from guardfl.redteam.runtime.userref import UserCodeError, calling, model_factory

    factory = model_factory(name, "model.name")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {k: v for k, v in (("in_shape", in_shape), ("num_classes", num_classes), ("vocab_size", vocab_size))
              if k in params and v is not None}
    with calling("model.name", f"calling {name!r}"):
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise UserCodeError(f"model.name: {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
