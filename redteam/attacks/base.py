"""The one small interface of every attack, its budget config, and shared helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from guardfl.config import StrictModel, validate
from guardfl.redteam.client import FedAvg, Observation
from guardfl.redteam.threat import Knowledge, ThreatModel


@dataclass
class Reconstruction:
    """An attack's answer: ``inputs`` with the shape and value range of the client's inputs, ``labels``.

    ``objective``: the attack's own final objective for the returned guess (how the winner among restarts
    was chosen: never with the ground truth). ``restart_objectives``: that value for every restart.
    """

    inputs: Tensor
    labels: Tensor
    objective: float
    restart_objectives: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class AttackConfig(StrictModel):
    """Budget fields every attack has."""

    iterations: int = Field(default=1000, ge=1, json_schema_extra={"allowed": "an integer >= 1"})
    restarts: int = Field(default=1, ge=1, json_schema_extra={"allowed": "an integer >= 1"})
    seed: int | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null (OS entropy) or >= 0"})
    device: str = Field(default="auto", json_schema_extra={"allowed": "'auto', 'cpu', 'cuda' or 'cuda:N'"})
    progress: bool = False


class Attack:
    """Base class: ``reconstruct(observation, threat) -> Reconstruction``."""

    name: ClassVar[str]
    Config: ClassVar[type[AttackConfig]]

    def __init__(self, **budget: Any) -> None:
        self.config = validate(self.Config, budget, prefix=self.name)

    def reconstruct(self, observation: Observation, threat: ThreatModel | None = None) -> Reconstruction:
        threat = threat or ThreatModel()
        knowledge = threat.knowledge(observation)
        self.check(observation, knowledge)
        device = resolve_device(self.config.device)
        gen = torch.Generator(device="cpu").manual_seed(
            self.config.seed if self.config.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        )
        return self._reconstruct(observation.to(device), knowledge, device, gen)

    def check(self, observation: Observation, knowledge: Knowledge) -> None:
        """Refuse settings the attack cannot handle (subclasses add theirs)."""

    def _reconstruct(self, observation: Observation, knowledge: Knowledge, device: torch.device, gen: torch.Generator) -> Reconstruction:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.model_dump(exclude_defaults=True)})"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available here; use 'auto' or 'cpu'")
    return device


def random_inputs(shape: tuple[int, ...], bounds: tuple[float, float], gen: torch.Generator, device: torch.device) -> Tensor:
    lo, hi = bounds
    return (lo + (hi - lo) * torch.rand(shape, generator=gen)).to(device)


def last_linear(observation: Observation) -> tuple[str, str | None]:
    """Names of the output layer's weight (K x F) and bias (K) in the update."""
    k = observation.num_classes
    weights = [n for n, t in observation.update.items() if t.dim() == 2 and t.shape[0] == k]
    if not weights:
        raise ValueError("labels='inferred' needs a final linear layer with one row per class")
    w = weights[-1]
    bias = w[: -len("weight")] + "bias" if w.endswith("weight") else None
    return w, bias if bias in observation.update else None


def infer_labels(observation: Observation) -> Tensor:
    """Restore labels from the output layer's update.

    One sample: iDLG (Zhao et al. 2020): the true class is the only one whose bias gradient (or the sum of
    its weight-gradient row, for non-negative features) is negative. A batch: Yin et al. 2021, the B
    classes with the most negative minimum over the weight-gradient row (assumes distinct labels; Huang
    et al. 2021 show it fails when labels repeat, which is why the threat model can grant labels).
    FedAvg deltas point against the gradient, so their sign is flipped first.
    """
    w_name, b_name = last_linear(observation)
    flip = -1.0 if isinstance(observation.protocol, FedAvg) else 1.0
    gw = flip * observation.update[w_name]
    n = observation.num_samples
    if n == 1:
        score = flip * observation.update[b_name] if b_name is not None else gw.sum(1)
        return score.argmin().reshape(1)
    order = gw.min(1).values.argsort()
    return order.repeat(-(-n // order.numel()))[:n]  # cycle the order to n labels


def labels_for(observation: Observation, knowledge: Knowledge) -> tuple[Tensor, str]:
    if knowledge.labels is not None:
        return knowledge.labels, "known"
    return infer_labels(observation).to(observation.update[next(iter(observation.update))].device), "inferred"


def progress_bar(enabled: bool, total: int, name: str):
    """A tqdm bar for an attack's inner loop, or None when progress is off."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, leave=False)
