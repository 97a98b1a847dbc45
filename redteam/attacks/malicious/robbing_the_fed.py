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

Adapted to the defense it knows (``threat.defense: known``, the default; the attacker knows the
defense's configuration, never its randomness): ``pad: auto`` adds rows that never fire, so that a
per-layer pruning (GradPrune, Outpost's) keeps every bin row (their gradient is 0; the pruning keeps a
share of the layer); ``boost: auto`` makes the imprint's gradients 1e5 times larger at the same input
perturbation (gain down, back projection up), so that noise of a fixed scale, or Outpost's noise scaled
by the layer's weight variance, is small beside them. Both are our adaptations, not Fowl et al.'s.

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
from typing import Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from guardfl.defenses import DefenseConfig
from guardfl.redteam.attacks.base import DECODING_THREAT, AttackConfig, Capabilities, Reconstruction
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.malicious.server import (Denoise, Repeats, ServerAttack, defense_known, fill_batch,
                                                    pruning_stages, query_averaged, repeats_for, repeats_line, server_labels)
from guardfl.redteam.client.simulate import ClientQuery
from guardfl.redteam.modality.image.data import MAX_TENSOR_BYTES, gib, memory_bound
from guardfl.redteam.threat import ThreatModel, defense_kinds

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
          gen: torch.Generator, pad: int = 0) -> Imprinted:
    """The imprinted model (a deep copy of ``model`` behind a fresh ``ImprintBlock``): ``cuts.numel()``
    bins, then ``pad`` rows that never fire (zero weights, bias -1: their gradient is exactly 0)."""
    bins = cuts.numel()
    block = ImprintBlock(input_shape, bins + pad)
    d = block.imprint.in_features
    with torch.no_grad():
        block.imprint.weight.zero_()
        block.imprint.weight[:bins] = gain / d  # every bin row: gain x the average brightness
        block.imprint.bias.fill_(-1.0)
        block.imprint.bias[:bins] = (-gain * cuts).to(block.imprint.bias.dtype)
        column = torch.randn(d, 1, generator=gen) * back_scale / bins
        block.back.weight.zero_()
        block.back.weight[:, :bins] = column.expand(d, bins)  # identical columns: one D_n per sample
        block.back.bias.zero_()
    return Imprinted(block, copy.deepcopy(model))


def padding_for(defense_config: DefenseConfig | dict | None, bins: int) -> int:
    """Dead rows that make a per-layer pruning of the imprint layer keep every bin row: the pruning keeps
    ``n - ceil(ratio (n - 1))`` of the layer's ``n`` entries, the largest; with ``bins / (1 - ratio)`` rows
    in all, that is at least the bins' entries, and the dead rows' gradient is exactly 0 (the server knows
    the defense's configuration). The largest per-layer ratio of the defense's GradPrune / Outpost stages;
    0 without one (a global GradPrune is not padded against)."""
    ratio = max((r for r, scope in pruning_stages(defense_config) if scope == "layer"), default=0.0)
    if ratio <= 0.0:
        return 0
    return int(math.ceil(bins / (1.0 - ratio))) - bins + 1


#: the boost "auto" uses against a known noise defense (see ``RobbingTheFedConfig.boost``)
NOISE_BOOST = 1e5


def boost_for(defense_config: DefenseConfig | dict | None) -> float:
    """``NOISE_BOOST`` when the defense adds noise whose scale does not follow the gradient's (Gaussian,
    Laplace, Outpost), else 1 (pruning, sign, DP-SGD's per-sample clipping: a larger gradient buys
    nothing there)."""
    kinds = {leaf.kind for leaf in defense_kinds(defense_config)}
    return NOISE_BOOST if kinds & {"gaussian", "laplace", "outpost"} else 1.0


def bin_differences(weight_update: Tensor, bias_update: Tensor) -> tuple[Tensor, Tensor]:
    """Each bin's share of an imprint layer's update ``(k, d)`` / ``(k,)`` (rows in increasing cut-off
    order): adjacent rows' differences, the last row as it is (float64)."""
    w, b = weight_update.double(), bias_update.double()
    return torch.cat([w[:-1] - w[1:], w[-1:]]), torch.cat([b[:-1] - b[1:], b[-1:]])


def recover(weight_update: Tensor, bias_update: Tensor, input_shape: tuple[int, ...], samples: int,
            input_range: tuple[float, float], min_mass: float) -> tuple[Tensor, int]:
    """The candidates of an imprint layer's update ``(k, d)`` / ``(k,)`` (bins in increasing cut-off
    order): ``samples`` images (see the module docstring) and how many bins held a candidate."""
    return candidates(*bin_differences(weight_update, bias_update), input_shape, samples, input_range, min_mass)


def candidates(dw: Tensor, db: Tensor, input_shape: tuple[int, ...], samples: int, input_range: tuple[float, float],
               min_mass: float) -> tuple[Tensor, int]:
    """``samples`` images from bins' updates ``dw`` / ``db``: one per bin whose bias difference is at least
    ``min_mass`` of the largest, the largest first, ``fill_batch`` when fewer; and how many there were."""
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
    #: rows that never fire added to the imprint layer, so that a per-layer pruning keeps every bin row:
    #: "auto" sizes them from the defense's configuration (``padding_for``; none when threat.defense is
    #: unknown), 0 adds none
    pad: Literal["auto"] | int = Field(default="auto", json_schema_extra={"allowed": "'auto' or an integer in [0, 1000000]"})

    #: the imprint's gradients made this many times larger (``back_scale`` x boost, ``gain`` / boost: the
    #: same perturbation of the input), so that noise of a fixed scale (Gaussian, Laplace) or scaled by the
    #: layer's own weights (Outpost's risk, Var(w), which a tiny gain makes tiny) is small beside them:
    #: "auto" is 1e5 against a known noise defense, else 1
    boost: Literal["auto"] | float = Field(default="auto", json_schema_extra={"allowed": "'auto' or a number in [1, 1e8]"})
    #: the imprint sent this many times and the updates averaged (``server.query_averaged``); "auto": 16
    #: against a known defense that draws fresh noise, else 1
    repeats: Repeats = "auto"
    denoise: Denoise = "auto"  # the filter of its reads (``server.Denoise``)

    @field_validator("boost")
    @classmethod
    def _boost(cls, value):
        if value != "auto" and not (isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value <= 1e8):
            raise ValueError(f"expected 'auto' or a number in [1, 1e8] (got {value!r})")
        return value

    @field_validator("pad")
    @classmethod
    def _pad(cls, value):
        if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1_000_000):
            raise ValueError(f"expected 'auto' or an integer in [0, 1000000] (got {value!r})")
        return value


@register
class RobbingTheFed(ServerAttack):
    """Fowl et al. 2022: imprint block, one query, analytic recovery of samples alone in their bin."""

    name = "robbing_the_fed"
    Config = RobbingTheFedConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd", "fedavg"}), server="malicious",
                                threat=frozenset({"labels", "defense"}) | DECODING_THREAT)  # aux data; the defense sizes pad: auto; never bn/fedavg
    budgets = {"quick": {}, "paper": {}}
    paper_budget = "Fowl et al. 2022: analytic (one query); bins a few times the batch size"

    def refuses(self, setting: Setting) -> str | None:
        """The imprint block is ``bins x d`` twice (``d`` the flattened input): refused, before any work, when
        its estimated memory (``memory_estimate``) is past ``memory_bound``."""
        shape, bins = tuple(setting.input_shape), self.config.bins or 4 * setting.num_samples
        rows = bins + (padding_for(setting.defense_config, bins) if self.config.pad == "auto" else self.config.pad)
        need, bound = memory_estimate(shape, rows), memory_bound()
        if need > bound:
            return (f"the imprint block for inputs {'x'.join(map(str, shape))} ({math.prod(shape)} values) and {rows} rows "
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
        known = threat.defense == "known"
        pad = (padding_for(setting.defense_config, bins) if known else 0) if c.pad == "auto" else c.pad
        boost = (boost_for(setting.defense_config) if known else 1.0) if c.boost == "auto" else float(c.boost)
        sent = craft(setting.model, shape, cuts, c.gain / boost, c.back_scale * boost, gen, pad)
        repeats = repeats_for(defense_known(setting, threat), c.repeats, client.max_rounds)
        observation, answered = query_averaged(client, sent, repeats)
        w = observation.update[f"{PREFIX}.imprint.weight"]
        b = observation.update[f"{PREFIX}.imprint.bias"]
        images, found = recover(w[:bins], b[:bins], shape, n, setting.input_range, c.min_mass)
        labels, source = server_labels(observation, setting, threat)
        return Reconstruction(images, labels.cpu(), 0.0, [], {
            "labels": source, "bins": bins, "pad": pad, "boost": boost, "candidates": found, "measurement": "brightness",
            "repeats": repeats_line(repeats, defense_known(setting, threat), answered, client.max_rounds),
            "cutoffs": "aux quantiles" if measurements is not None else "gaussian guess", "malicious_model": sent})
