"""The setting of an attack: what is fixed across the private batches of one certification.

``Setting`` (the global model, protocol, batch geometry and defense configuration, with the fingerprint a
prepared state is keyed by), ``setting_mismatch`` (whether two observations are of one setting),
``on_device`` (observations of one setting sharing one model copy) and ``first_linear`` (the layer an
analytic attack reads).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from guardfl.defenses import DefenseConfig, parse_config
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation
from guardfl.redteam.modality.registry import DEFAULT as DEFAULT_MODALITY
from guardfl.redteam.threat import Knowledge, unseeded


@dataclass(frozen=True)
class Setting:
    """What is fixed across the private batches of one certification: the public context of an
    observation without the update itself (the global model, the protocol, the batch geometry, and the
    defense's configuration as transmitted with the client's description)."""

    model: nn.Module
    protocol: FedSGD | FedAvg
    num_samples: int
    input_shape: tuple[int, ...]
    num_classes: int
    input_range: tuple[float, float]
    #: parsed (None: no defense); a dict given here is parsed once
    defense_config: DefenseConfig | None
    train_mode: bool = True
    modality: str = DEFAULT_MODALITY

    def __post_init__(self) -> None:
        if self.defense_config is not None:
            object.__setattr__(self, "defense_config", parse_config(self.defense_config))

    @classmethod
    def of(cls, observation: Observation) -> "Setting":
        return cls(observation.model, observation.protocol, observation.num_samples, tuple(observation.input_shape),
                   observation.num_classes, tuple(observation.input_range), observation.defense_config,
                   getattr(observation, "train_mode", True), getattr(observation, "modality", DEFAULT_MODALITY))

    @property
    def param_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    @cached_property
    def fingerprint(self) -> dict[str, Any]:
        """Everything of the setting a prepared state depends on, as JSON-able data (model weights hashed
        once per Setting: a certification builds one Setting and prepares every attack with it)."""
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in self.model.state_dict().items()}, buf)
        return {
            "model": type(self.model).__qualname__,
            "weights": hashlib.sha256(buf.getvalue()).hexdigest(),
            "protocol": repr(self.protocol),
            "num_samples": self.num_samples,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "input_range": list(self.input_range),
            "defense": self.defense_config.model_dump(mode="json") if self.defense_config is not None else None,
            "train_mode": self.train_mode,
            **({"modality": self.modality} if self.modality != DEFAULT_MODALITY else {}),
        }


def setting_mismatch(a: Observation, b: Observation) -> str | None:
    """Why ``b`` is not an observation of ``a``'s setting (``Setting``), or None when it is. Compared
    directly, no hashing (cheap for 60 observations of an 11M-parameter model): the protocol, batch
    geometry, input range, defense configuration and train mode, the model's class and its weights and
    buffers by value, the updated layers and their shapes. The defense configurations are compared
    without their ``seed``s: the defense's randomness is never the attacker's to use (``known_defense``
    reads no seed), so clients whose defenses differ only in their seed are one setting to an attack."""
    if a is b:
        return None
    fields = {
        "protocol": (a.protocol, b.protocol),
        "num_samples": (a.num_samples, b.num_samples),
        "input_shape": (tuple(a.input_shape), tuple(b.input_shape)),
        "num_classes": (a.num_classes, b.num_classes),
        "input_range": (tuple(a.input_range), tuple(b.input_range)),
        "defense_config": (unseeded(a.defense_config), unseeded(b.defense_config)),
        "train_mode": (getattr(a, "train_mode", True), getattr(b, "train_mode", True)),
        "modality": (getattr(a, "modality", DEFAULT_MODALITY), getattr(b, "modality", DEFAULT_MODALITY)),
        "model class": (type(a.model), type(b.model)),
        "updated layers": ([(k, tuple(v.shape)) for k, v in a.update.items()],
                           [(k, tuple(v.shape)) for k, v in b.update.items()]),
    }
    for name, (x, y) in fields.items():
        if x != y:
            return f"its {name} differs"
    if a.model is not b.model:
        sa, sb = a.model.state_dict(), b.model.state_dict()
        if list(sa) != list(sb) or any(sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k].to(sa[k].device)) for k in sa):
            return "its model's weights or buffers differ"
    return None


def on_device(observations: list[Observation], knowledges: list[Knowledge], device: torch.device,
              ) -> tuple[list[Observation], list[Knowledge]]:
    """Observations of one setting and their knowledge moved to ``device``, the observations sharing one
    copy of the global model (for an attack that batches samples: S deep copies would be wasted)."""
    first = observations[0].to(device)
    moved = [first] + [o.to(device, model=first.model) for o in observations[1:]]
    return moved, [k.to(device) for k in knowledges]


def first_linear(model: nn.Module, names: list[str], layer: str | None = None) -> tuple[str, nn.Linear] | None:
    """(weight name, module) of a model's first ``nn.Linear`` whose weight is among ``names`` (or the one
    named ``layer``); None when there is none."""
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and f"{mod_name}.weight" in names:
            weight = f"{mod_name}.weight" if mod_name else "weight"
            if layer is None or layer == weight:
                return weight, module
    return None

