"""Exclusively activated neurons: what an honest-but-curious server reads from the honest model's own first
layer, with no model of its own making (``server: honest``).

A unit of a first ``nn.Linear`` on the flattened input, straight into a ReLU, that fires for one sample
of the batch alone holds that sample exactly in its update: row ``G_i / g_i`` of the weight's update over
the bias's (Phong et al. 2017, the single-sample identity; Fowl et al. 2022 note it for batches; Pan et
al. 2022, "Exploring the Security Boundary of Data Reconstruction via Neuron Exclusivity Analysis", build
their attack on such units; their paper is not in this offline library, so this attack follows the idea,
not their algorithm, and the checking and peeling below are ours). On uncentred inputs (images in
[0, 1]) the honest FC-2 at its default initialisation has 7-21 such units on a batch of 64 faces
(``docs/research/malicious-server.md`` section 13); ``inspect_model``'s isolation check counts the same units as the
architecture's own leak, which it has to allow.

Steps (``maths``: ``exclusive``):

1. Candidates: ``G_i / g_i`` for every unit whose bias entry is not negligible (``min_mass`` of the largest),
   kept when (nearly) all of it lies in the input range.
2. Checked without the ground truth (FedSGD, where the update is one gradient of the batch mean): each
   candidate runs through the model the server sent, alone, with the label unit i's column of the next
   layer's update shows (that column is ``h_i (p - onehot(y)) / B`` for a unit one sample fires: the
   label's entry is its most negative; among the batch's labels when ``labels: known``, every class
   otherwise), and its own share of unit i's bias gradient and of that column are compared with the
   update: both within ``rtol`` (relative), the candidate is a sample, with that label (a mix of samples,
   a weighted mean of several images, matches neither; the bias alone, one number, once accepted a mix by
   chance against Soteria's pruned layer, the column adds one equation per class).
3. Peeled: a checked sample's share of the whole layer's update, ``D x^T`` and ``D``, is subtracted, so a
   unit that fired for it and one other sample now holds the other alone; steps 1-3 repeat until a round
   checks nothing new (at most ``rounds``).
4. The rest of the batch: the unchecked candidates of what is left (in range first, then by bias mass,
   the largest first: under noise the largest have the best ratio of signal to noise), then copies
   (``fill_batch``). Their labels are the remaining ones of ``labels_for``.

Adapted to the defense's configuration (``threat.defense: known``): a known pruning (GradPrune, Outpost's
prune) leaves candidates with missing entries, each bounded by the smallest entry kept (``exclusive.
pruned_bounds``), filled from their neighbours within that bound (``exclusive.inpaint``). Noise, sign
compression, DP-SGD's clipping and noise: the checks fail (nothing is claimed as exact) and the candidates
are ranked by bias mass. FedAvg: the update is several steps' sum, so no candidate can be checked against
one gradient; unit-exclusive candidates are still exact when the unit fired for one sample in every
step, and are returned unchecked.

Not applicable (with the reason): models whose first parameterised layer is not an ``nn.Linear`` on the
whole flattened input with a bias, or whose units go through a normalisation before the ReLU (BatchNorm,
LayerNorm, GroupNorm mix every sample's or every unit's gradient into each unit: no unit is exclusive),
and models with BatchNorm anywhere in train mode (the samples' gradients are coupled, so a candidate's
own share cannot be computed alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from guardfl.redteam.attacks.analytic import exclusive
from guardfl.redteam.attacks.base import DECODING_THREAT, Attack, AttackConfig, Capabilities, NotApplicable, Reconstruction
from guardfl.redteam.attacks.known_defense import known_defense
from guardfl.redteam.attacks.labels import labels_for
from guardfl.redteam.attacks.malicious.server import fill_batch
from guardfl.redteam.attacks.dense import TrapLayers, trap_layers
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.simulate import FedSGD, Observation, bn_layers
from guardfl.redteam.threat import Knowledge, ThreatModel

#: two candidates within this share of the input range of each other (largest absolute difference) are one
#: sample: units that hold the same sample alone give it with different rounding (a wide layer's units
#: with small bias gradients: up to ~1e-4 apart), and peeling it twice would corrupt the rest
SAME = 1e-3

#: candidates run through the model this many at a time
CHUNK = 2048


class ExclusiveNeuronsConfig(AttackConfig):
    rtol: float = Field(default=1e-3, gt=0, lt=1, json_schema_extra={"allowed": "a number in (0, 1)"})
    min_mass: float = Field(default=1e-4, ge=0, lt=1, json_schema_extra={"allowed": "a number in [0, 1)"})
    rounds: int = Field(default=64, ge=0, le=10_000, json_schema_extra={"allowed": "an integer in [0, 10000]"})
    range_slack: float = Field(default=0.05, ge=0, le=1, json_schema_extra={"allowed": "a number in [0, 1] (of the input range's width)"})


def first_dense(model: nn.Module, input_shape: tuple[int, ...], names: list[str]) -> TrapLayers | str:
    """The first linear layer (going straight into a ReLU) whose weight and bias are updated, or why not."""
    layers = trap_layers(model, input_shape)
    if isinstance(layers, str):
        return layers.replace("a dense-layer construction needs", "reading exclusive units needs")
    if layers.norm is not None:
        return (f"the first layer's units go through {type(layers.norm).__name__} before the ReLU, which mixes every "
                "sample's (or unit's) gradient into each unit: no unit is exclusive to one sample")
    if layers.first.bias is None:
        return f"the first layer {layers.first_name} has no bias (the reading divides by the bias's update)"
    for name in (f"{layers.first_name}.weight", f"{layers.first_name}.bias", f"{layers.second_name}.weight"):
        if name not in names:
            return f"{name} is not among the updated parameters (the reading needs the first layer's and the checks the next one's)"
    return layers


def shares(model: nn.Module, layers: TrapLayers, x: Tensor, labels: Tensor, batch: int,
           train_mode: bool) -> tuple[Tensor, Tensor, Tensor]:
    """What every candidate ``x`` (k, *input_shape) with its label (k,) would add to a batch-mean loss's
    gradient over ``batch`` samples, alone: the derivative of ``cross_entropy(model(x_j), labels_j) /
    batch`` with respect to the first layer's output (k, units: its share of the first bias's gradient)
    and the second layer's output (k, units2), and the first layer's units after the ReLU, the second
    layer's input (k, units): its share of the second weight's gradient is their outer product."""
    outs: list[tuple[Tensor, Tensor, Tensor]] = []
    seen: dict[str, Tensor] = {}

    def first_out(_m, _i, o):
        seen["z1"] = o

    def second_io(_m, i, o):
        seen["h"], seen["z2"] = i[0], o

    handles = [layers.first.register_forward_hook(first_out), layers.second.register_forward_hook(second_io)]
    was = model.training
    model.train(train_mode)
    try:
        for start in range(0, x.shape[0], CHUNK):
            seen.clear()
            with torch.enable_grad():
                logits = model(x[start:start + CHUNK])
                loss = F.cross_entropy(logits, labels[start:start + CHUNK], reduction="sum") / batch
                dz1, dz2 = torch.autograd.grad(loss, [seen["z1"], seen["z2"]])
            outs.append((dz1.detach(), dz2.detach(), seen["h"].detach()))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was)
    return tuple(torch.cat([o[j] for o in outs]).flatten(1) for j in range(3))  # type: ignore[return-value]


@dataclass
class Peeled:
    """What ``read_checked`` found: the checked samples (k, d) (float64, flattened) and their labels, the
    rounds it took, and the first layer's update with their shares removed (weight, bias)."""

    samples: Tensor
    labels: list[int]
    rounds: int
    weight: Tensor
    bias: Tensor


def read_checked(observation: Observation, layers: TrapLayers, choices: Tensor, rtol: float, min_mass: float,
                 rounds: int) -> Peeled:
    """Steps 1-3 of the module docstring on ``observation``'s update of ``layers`` (the first linear layer,
    straight into a ReLU, and the one reading its units): the samples that units hold alone, checked
    against ``observation.model`` with the labels ``choices`` (a FedSGD update only: a FedAvg update is
    returned as it is), peeled, repeated at most ``rounds`` times. The model may be the honest one or one
    a server made: a server attack that hosts its construction there reads the same way."""
    shape, n = tuple(observation.input_shape), observation.num_samples
    lo, hi = observation.input_range
    width = hi - lo
    weight = observation.update[f"{layers.first_name}.weight"].double()
    bias = observation.update[f"{layers.first_name}.bias"].double()
    second = observation.update[f"{layers.second_name}.weight"].double()
    dtype = next(observation.model.parameters()).dtype
    scale = float(bias.abs().max()) if bias.numel() else 0.0
    found = weight.new_zeros((0, weight.shape[1]))
    found_labels: list[int] = []
    done = 0
    if not isinstance(observation.protocol, FedSGD) or scale <= 0:
        return Peeled(found, found_labels, done, weight, bias)
    for done in range(1, rounds + 1):
        rows, cands = exclusive.ratios(weight, bias, min_mass, scale)
        keep = exclusive.in_range(cands, (lo, hi), 1e-3) >= 0.999
        rows, cands = rows[keep], cands[keep]
        new = exclusive.distinct(cands, SAME * width, found)
        rows, cands = rows[new], cands[new]
        if not rows.numel():
            break
        # the sample's label is the class whose entry of the unit's column is the most negative (the column of
        # a unit one sample fires is h * (p - onehot(y)) / B): one run per candidate, not one per class
        allowed = second[choices][:, rows]  # (L, k)
        labels = choices[allowed.argmin(0)]
        d1, d2, h = (t.double() for t in shares(observation.model, layers, cands.to(dtype).view(-1, *shape), labels,
                                                 observation.batch_size, observation.train_mode))
        at = torch.arange(rows.numel(), device=rows.device)
        err = exclusive.disagreement(d1[at, rows, None], bias[rows, None])  # (k,): the unit's bias share
        column = d2 * h[at, rows][:, None]  # (k, units2): the unit's column of the second weight
        err = torch.maximum(err, exclusive.disagreement(column, second[:, rows].T))
        ok = torch.nonzero(err <= rtol).flatten()
        ok = ok[torch.argsort(bias[rows[ok]].abs(), descending=True)]  # of two units holding one sample, the larger
        ok = ok[exclusive.distinct(cands[ok], SAME * width)][:n - found.shape[0]]  # reads it with less rounding
        if not ok.numel():
            break
        weight, bias = exclusive.peel(weight, bias, d1[ok], cands[ok])
        second, _ = exclusive.peel(second, second.new_zeros(second.shape[0]), d2[ok], h[ok])
        found = torch.cat([found, cands[ok]])
        found_labels += labels[ok].tolist()
        if found.shape[0] >= n:
            break
    return Peeled(found, found_labels, done, weight, bias)


@register
class ExclusiveNeurons(Attack):
    """Reads the samples that units of the honest first linear layer hold alone (checked, then peeled)."""

    name = "exclusive_neurons"
    Config = ExclusiveNeuronsConfig
    capabilities = Capabilities(threat=frozenset({"labels", "defense"}) | DECODING_THREAT)
    budgets = {"quick": {}, "paper": {}}
    paper_budget = ("analytic (no iterations): Phong et al. 2017's single-sample identity on every unit of the first "
                    "linear layer; candidates checked against the model and peeled (ours)")

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        found = first_dense(setting.model, setting.input_shape, setting.param_names)
        if isinstance(found, str):
            return found
        if setting.train_mode and bn_layers(setting.model):
            return "the model has BatchNorm in train mode: the samples' gradients are coupled, so no candidate's share is its own"
        return None

    def check(self, observation: Observation, knowledge: Knowledge) -> None:
        layers = first_dense(observation.model, observation.input_shape, list(observation.update))
        if isinstance(layers, str):
            raise NotApplicable(f"{self.name}: {layers}")
        for name in (f"{layers.first_name}.weight", f"{layers.first_name}.bias", f"{layers.second_name}.weight"):
            if not bool(torch.isfinite(observation.update[name]).all()):
                raise NotApplicable(f"{self.name}: the update of {name} holds non-finite values")

    # -- one observation -------------------------------------------------------------------------------
    def _reconstruct(self, observation: Observation, knowledge: Knowledge, device: torch.device, gen: torch.Generator) -> Reconstruction:
        c = self.config
        layers = first_dense(observation.model, observation.input_shape, list(observation.update))
        assert not isinstance(layers, str)
        shape, n = tuple(observation.input_shape), observation.num_samples
        lo, hi = observation.input_range
        given, source = labels_for(observation, knowledge)
        hard = given if not given.is_floating_point() else given.argmax(-1) if given.dim() == 2 else given.long()
        choices = torch.unique(hard) if source == "known" else torch.arange(observation.num_classes, device=device)
        peeled = read_checked(observation, layers, choices, c.rtol, c.min_mass, c.rounds)
        found, found_labels, rounds = peeled.samples, peeled.labels, peeled.rounds
        weight, bias = peeled.weight, peeled.bias
        checked = found.shape[0]

        rest = self._unchecked(weight, bias, found, knowledge, observation, n - checked)
        images = torch.cat([found[:n], rest]).float().clamp(lo, hi).view(-1, *shape)
        images = fill_batch(images.cpu(), n, (lo, hi))
        labels = _labels(found_labels[:n], hard.cpu(), n)
        info = {"checked": checked, "unchecked": int(rest.shape[0]), "rounds": rounds, "label_source": source,
                "layer": layers.first_name}
        return Reconstruction(images, labels, float(n - checked), [float(n - checked)], info)

    def _unchecked(self, weight: Tensor, bias: Tensor, found: Tensor, knowledge: Knowledge, observation: Observation,
                   wanted: int) -> Tensor:
        """Up to ``wanted`` candidates of what is left of the update (not checked): pruning's missing
        entries filled within their bounds (known pruning), those (nearly) in range first, then by bias
        mass."""
        c = self.config
        if wanted <= 0:
            return weight.new_zeros((0, weight.shape[1]))
        lo, hi = observation.input_range
        rows, cands = exclusive.ratios(weight, bias, c.min_mass)
        if not rows.numel():
            return cands
        if known_defense(knowledge.defense_config).pruned:
            cands = self._filled(weight, bias, rows, cands, observation)
        mass = bias[rows].abs()
        fraction = exclusive.in_range(cands, (lo, hi), c.range_slack)
        order = sorted(range(rows.numel()), key=lambda j: (-(float(fraction[j]) >= 0.9), -float(mass[j])))
        cands = cands[order].clamp(lo, hi)
        picked = exclusive.distinct(cands, 1e-3 * (hi - lo), found.clamp(lo, hi) if found.numel() else None)
        return cands[picked[:wanted]]

    def _filled(self, weight: Tensor, bias: Tensor, rows: Tensor, cands: Tensor, observation: Observation) -> Tensor:
        """Candidates of a pruned update with their pruned (zero) entries inpainted within their bounds."""
        nonzero = weight[weight != 0].abs()
        if not nonzero.numel():
            return cands
        threshold = float(nonzero.min())
        shape = tuple(observation.input_shape)
        out = cands.clone()
        for j, r in enumerate(rows.tolist()):
            missing, low, high = exclusive.pruned_bounds(weight[r], float(bias[r]), threshold, observation.input_range)
            image = out[j].view(shape)
            out[j] = exclusive.inpaint(image, missing.view(shape), low.view(shape), high.view(shape)).flatten()
        return out


def _labels(found: list[int], given: Tensor, n: int) -> Tensor:
    """The checked samples' labels, then the given (known or inferred) labels not used by them, in order."""
    rest = given.tolist()
    for label in found:
        if label in rest:
            rest.remove(label)
    return torch.tensor((found + rest)[:n] + [rest[-1] if rest else 0] * max(0, n - len(found) - len(rest)), dtype=torch.long)
