"""Robbing the Fed (Fowl et al., ICLR 2022): an imprint block in front of the model, and exact recovery.

The malicious server inserts, in front of the client's model, a block of two linear layers:

- ``imprint``: ``d -> k`` (``d`` the flattened input), every row the same measurement vector ``m`` (here
  the average brightness, ``m = 1/d``: the paper's simplest linear function), times a gain ``g``; biases
  ``-g * c_i`` for increasing cut-offs ``c_0 < ... < c_{k-1}``, then a ReLU. Neuron ``i`` fires for every
  sample whose measurement ``s = <m, x>`` exceeds ``c_i``.
- ``back``: ``k -> d``, added to the input (the rest of the model sees ``x`` plus a small perturbation, so
  the model stays useful), with identical columns: every neuron of a sample then receives the same
  gradient ``D_n`` from above.

So the gradient of row ``i`` is ``sum_{n: s_n > c_i} D_n x_n`` and its bias's ``sum_{n: s_n > c_i} D_n``.
Subtracting adjacent rows leaves the samples whose measurement falls in the bin ``(c_i, c_{i+1}]``; when
one sample is alone in its bin, (row difference) / (bias difference) is that sample, exactly (Fowl et
al., Eq. 3-4). A FedSGD gradient and a one-step FedAvg delta are recovered exactly; several local steps
move the imprint between steps (the recovery degrades, as the paper notes); defenses that prune, noise or
clip the update act on it as on any other.

Bins: ``bins`` (default four per sample of the update, so that a sample is alone in its bin with
probability about ``(1 - 1/k)^(B-1) ~ e^(-1/4)``) at equal-mass quantiles of the measurement on the
attacker's auxiliary data (``threat.aux``); without auxiliary data, of a Gaussian guess (mean the input
range's midpoint, standard deviation a quarter of its width), which fills bins less evenly. The first
cut-off lies below every possible measurement, so every sample fires at least one neuron.

Scales: the imprint's parameters are small (``gain`` 1e-3) and the back projection large (``back_scale``
10, spread over the bins), so that the update of the imprint is large RELATIVE to its parameters: a
FedAvg client sends ``w_end - w_start``, and an update below float32's resolution of ``w`` would vanish
in the subtraction. Their product keeps the perturbation of the input small (~5e-3 of the range).

Output: one candidate per bin whose bias difference is not negligible (``min_mass`` of the largest), the
``B`` with the largest bias differences when there are more (noise makes every bin non-empty), repeated
when there are fewer (``fill_batch``); clamped to the input range. ``info``: the number of
candidates, the number of bins, the crafted model (``malicious_model``) and the queries (one).
Labels are not recovered by the imprint; the attack returns the granted labels, or restores them from
the classifier's update when that is possible (at most one per class), else marks them unrestored.
"""

from __future__ import annotations

import copy
import math

import torch
from pydantic import Field
from torch import Tensor, nn

from guardfl.redteam.attacks.base import AttackConfig, Capabilities, Reconstruction, Setting, infer_labels
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.server import ServerAttack, fill_batch
from guardfl.redteam.client import ClientQuery
from guardfl.redteam.data import MAX_TENSOR_BYTES, gib, memory_bound
from guardfl.redteam.threat import ThreatModel

PREFIX = "imprint_block"


class ImprintBlock(nn.Module):
    """``x + back(relu(imprint(flatten(x))))`` with the shapes of ``x`` kept (see the module docstring)."""

    def __init__(self, input_shape: tuple[int, ...], bins: int) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        d = math.prod(self.input_shape)
        self.imprint = nn.Linear(d, bins)
        self.back = nn.Linear(bins, d)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.imprint(x.flatten(1)))
        return x + self.back(h).view(x.shape)


class Imprinted(nn.Module):
    """The model the malicious server sends: the imprint block, then the client's own model."""

    def __init__(self, block: ImprintBlock, model: nn.Module) -> None:
        super().__init__()
        self.imprint_block = block
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(self.imprint_block(x))


def cutoffs(measurements: Tensor | None, bins: int, input_range: tuple[float, float]) -> Tensor:
    """``bins`` increasing cut-offs of the brightness: equal-mass quantiles of ``measurements`` (the
    attacker's public data), else of a Gaussian guess; the first one below any possible brightness."""
    lo, hi = input_range
    q = torch.arange(1, bins, dtype=torch.float64) / bins
    if measurements is not None and measurements.numel() >= 2:
        inner = torch.quantile(measurements.double().flatten(), q)
    else:
        normal = torch.distributions.Normal(torch.tensor((lo + hi) / 2, dtype=torch.float64),
                                            torch.tensor((hi - lo) / 4, dtype=torch.float64))
        inner = normal.icdf(q)
    first = torch.tensor([lo - (hi - lo)], dtype=torch.float64)
    cuts = torch.cat([first, inner])
    # strictly increasing (ties in the data's quantiles would make an empty bin of width 0)
    return torch.cummax(cuts + torch.arange(bins, dtype=torch.float64) * 1e-9 * (hi - lo), 0).values


def craft(model: nn.Module, input_shape: tuple[int, ...], cuts: Tensor, gain: float, back_scale: float,
          gen: torch.Generator) -> Imprinted:
    """The imprinted model (a deep copy of ``model`` behind a fresh ``ImprintBlock``)."""
    bins = cuts.numel()
    block = ImprintBlock(input_shape, bins)
    d = block.imprint.in_features
    with torch.no_grad():
        block.imprint.weight.fill_(gain / d)  # every row: gain x the average brightness
        block.imprint.bias.copy_((-gain * cuts).to(block.imprint.bias.dtype))
        column = torch.randn(d, 1, generator=gen) * back_scale / bins
        block.back.weight.copy_(column.expand(d, bins))  # identical columns: one D_n per sample
        block.back.bias.zero_()
    return Imprinted(block, copy.deepcopy(model))


def recover(weight_update: Tensor, bias_update: Tensor, input_shape: tuple[int, ...], samples: int,
            input_range: tuple[float, float], min_mass: float) -> tuple[Tensor, int]:
    """The candidates of an imprint layer's update ``(k, d)`` / ``(k,)`` (bins in increasing cut-off
    order): ``samples`` images (see the module docstring) and how many bins held a candidate."""
    w, b = weight_update.double(), bias_update.double()
    dw = torch.cat([w[:-1] - w[1:], w[-1:]])
    db = torch.cat([b[:-1] - b[1:], b[-1:]])
    mass = db.abs()
    top = float(mass.max()) if mass.numel() else 0.0
    keep = torch.nonzero(mass > min_mass * top).flatten() if top > 0 else torch.zeros(0, dtype=torch.long)
    keep = keep[torch.argsort(mass[keep], descending=True)][:samples]
    images = (dw[keep] / db[keep, None]).float().clamp(*input_range).view(-1, *input_shape)
    return fill_batch(images, samples, input_range), int(keep.numel())


#: bytes per entry of the imprint block's two ``bins x d`` weights while the attack runs: float32 copies in
#: the crafted model, the client's copy, its gradient and the update (4 x 4 bytes per weight, two weights)
#: and the float64 row differences of ``recover`` (two arrays of 8 bytes, one weight)
BYTES_PER_ENTRY = 2 * 4 * 4 + 2 * 8
def memory_estimate(input_shape: tuple[int, ...], bins: int) -> int:
    """Bytes the imprint block needs for inputs of ``input_shape`` and ``bins`` bins (``BYTES_PER_ENTRY``)."""
    return math.prod(input_shape) * bins * BYTES_PER_ENTRY


class RobbingTheFedConfig(AttackConfig):
    bins: int | None = Field(default=None, ge=2, le=65536,
                             json_schema_extra={"allowed": "null (4 per sample of the update) or an integer in [2, 65536]"})
    gain: float = Field(default=1e-3, gt=0, json_schema_extra={"allowed": "> 0"})
    back_scale: float = Field(default=10.0, gt=0, json_schema_extra={"allowed": "> 0"})
    min_mass: float = Field(default=1e-6, ge=0, lt=1, json_schema_extra={"allowed": "in [0, 1)"})


@register
class RobbingTheFed(ServerAttack):
    """Fowl et al. 2022: imprint block, one query, analytic recovery of samples alone in their bin."""

    name = "robbing_the_fed"
    Config = RobbingTheFedConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd", "fedavg"}), server="malicious",
                                threat=frozenset({"labels"}))  # the imprint reads the aux data, never bn/defense/fedavg
    budgets = {"quick": {}, "paper": {}}
    paper_budget = "Fowl et al. 2022: analytic (one query); bins a few times the batch size"

    def refuses(self, setting: Setting) -> str | None:
        """The imprint block is ``bins x d`` twice (``d`` the flattened input): refused, before any work, when
        its estimated memory (``memory_estimate``) is past ``memory_bound``."""
        shape, bins = tuple(setting.input_shape), self.config.bins or 4 * setting.num_samples
        need, bound = memory_estimate(shape, bins), memory_bound()
        if need > bound:
            return (f"the imprint block for inputs {'x'.join(map(str, shape))} ({math.prod(shape)} values) and {bins} bins "
                    f"needs about {gib(need)}, past the bound of {gib(bound)} (half the memory, at most {gib(MAX_TENSOR_BYTES)}); "
                    "lower data.image_size (or model.input_shape), client.batch_size or budget.bins")
        return None

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        c = self.config
        shape, n = tuple(setting.input_shape), setting.num_samples
        bins = c.bins or 4 * n
        measurements = None
        if threat.aux is not None:
            measurements = threat.aux.images.flatten(1).mean(1)
        cuts = cutoffs(measurements, bins, setting.input_range)
        sent = craft(setting.model, shape, cuts, c.gain, c.back_scale, gen)
        observation = client(sent)
        w = observation.update[f"{PREFIX}.imprint.weight"]
        b = observation.update[f"{PREFIX}.imprint.bias"]
        images, found = recover(w, b, shape, n, setting.input_range, c.min_mass)
        knowledge = threat.knowledge(observation)
        if knowledge.labels is not None:
            labels, source = knowledge.labels, "known"
        elif n <= setting.num_classes:
            labels, source = infer_labels(observation), "inferred"
        else:
            labels, source = torch.zeros(n, dtype=torch.long), "not restored"
        return Reconstruction(images, labels.cpu(), 0.0, [], {
            "labels": source, "bins": bins, "candidates": found, "measurement": "brightness",
            "cutoffs": "aux quantiles" if measurements is not None else "gaussian guess", "malicious_model": sent})
