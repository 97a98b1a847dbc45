"""Threshold bins: the honest first layer made affine on the batch, the batch binned by the classifier over
queries (ours, 2026-11-28; adaptive to ``inspect_model``'s support-based isolation count and leak limit).

Every isolation test in ``guardfl.inspect`` (the pairs, the groups, the leak limit's count) reads which samples
*fire* a unit: a unit that fires for one sample, or a pair of units whose supports differ by one, reads it.
This construction gives no unit such a support. The server keeps the honest first layer's weights and
raises each unit's bias until it fires for every auxiliary image (the lowest pre-activation plus three
standard deviations), so on the client's batch every unit fires for every sample: the first layer is an
affine map ``h = W x + b`` and its update is ``sum_n g_n x_n^T`` with ``g_n = W2^T delta_n``, no sample
alone anywhere. Then the classifier does the binning, across queries of the same batch (FedSGD on a batch
the client sends each round, the threat fishing's feature search already assumes):

* the classifier is the honest one times ``gain`` (rows of comparable norm: no zeroed row, the honest
  biases: no bias gap), and the target row (class 0) gets ``slope * (a - t c)``: ``a`` a random unit
  direction of the hidden units, ``c = b / |b|^2`` (so ``<c, h> ~ 1`` for every sample: the threshold ``t``
  lives in the weights, never in a bias);
* a sample's target probability switches from ~0 to ~1 where ``t`` passes its switch point
  ``(logit_0 without t - logsumexp of the other logits) / (slope <c, h>)``: a step of width ``1/slope``;
* query ``k`` sends threshold ``t_k`` (the auxiliary switch points' quantiles, ``queries - 1`` bins of equal
  auxiliary mass); in two consecutive queries only the samples whose switch point lies between the two
  thresholds change their ``delta_n``, so the difference of the two updates of the first layer holds those
  samples alone, and with one of them unit ``j``'s weight difference over its bias difference is ``x_n``
  exactly, whatever the coefficients.

Every bin's reading is returned (one per bin; ``queries - 1`` defaults to the batch size), single-sample
or not: the attacker cannot tell them apart reliably here (the units' readings of a two-sample bin can
agree closely when one sample's coefficients dominate, and the float32 difference of two updates blurs a
single one's), and the certificate's one-to-one matching counts each reading once.

Not applicable: a first layer that does not read the whole flattened input, a normalisation between it
and its ReLU (it couples the units or the batch), a layer reading the units that is not the classifier,
FedAvg (the bins are differences of single gradients), no auxiliary data. Not adapted to a defense: a
pruning's zeros or fresh noise in each query land in the differences (noise repeated in every query
would cancel there: a client must not reuse a seed across rounds; docs/malicious-server.md section 17).
"""

from __future__ import annotations

import copy

import torch
from pydantic import Field
from torch import Tensor, nn

from guardfl.redteam.attacks.base import AttackConfig, Capabilities, Reconstruction
from guardfl.redteam.attacks.dense import trap_layers
from guardfl.redteam.attacks.malicious.fishing import classifier
from guardfl.redteam.attacks.malicious.server import ServerAttack, fill_batch, server_labels
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.client.simulate import ClientQuery
from guardfl.redteam.threat import ThreatModel

#: the bias lift: the lowest auxiliary pre-activation of a unit is raised by this many standard deviations
LIFT_STDS = 3.0


class ThresholdBinsConfig(AttackConfig):
    #: models sent (thresholds): ``queries - 1`` bins; None: one bin per sample of the batch (+1)
    queries: int | None = Field(default=None, ge=3, le=1000, json_schema_extra={"allowed": "null or an integer in [3, 1000]"})
    #: the honest classifier's scale (its rows keep comparable norms, none zeroed)
    gain: float = Field(default=1000.0, gt=0, le=1e6, json_schema_extra={"allowed": "a number in (0, 1e6]"})
    #: the target logit's slope along the projection (its step is 1/slope wide)
    slope: float = Field(default=2000.0, gt=0, le=1e7, json_schema_extra={"allowed": "a number in (0, 1e7]"})


def lifted(first: nn.Linear, aux: Tensor) -> Tensor:
    """The first layer's biases raised so that every unit fires on every auxiliary image, with a margin of
    ``LIFT_STDS`` standard deviations of its pre-activation (units that already do keep theirs plus it)."""
    pre = aux.flatten(1).double() @ first.weight.detach().double().T + first.bias.detach().double()
    return first.bias.detach().double() + (-pre.min(0).values).clamp(min=0) + LIFT_STDS * pre.std(0)


def switch_points(hidden: Tensor, second: nn.Linear, a: Tensor, c: Tensor, gain: float, slope: float) -> Tensor:
    """Each hidden vector's threshold at which the target logit (class 0) overtakes the others' log-sum-exp."""
    w, b = second.weight.detach().double(), second.bias.detach().double()
    others = (gain * hidden @ w[1:].T + b[1:]).logsumexp(1)
    base = gain * hidden @ w[0] + b[0] + slope * (hidden @ a)
    return (base - others) / (slope * (hidden @ c))


def binned_model(model: nn.Module, first_name: str, second_name: str, bias: Tensor, a: Tensor, c: Tensor,
                 t: float, gain: float, slope: float) -> nn.Module:
    """The model sent for threshold ``t``: the honest weights, the lifted biases, the scaled classifier with
    the target row's threshold in its weights."""
    sent = copy.deepcopy(model)
    first, second = sent.get_submodule(first_name), sent.get_submodule(second_name)
    with torch.no_grad():
        first.bias.copy_(bias.to(first.bias.dtype))
        w = gain * second.weight.double()
        w[0] += slope * (a - t * c)
        second.weight.copy_(w.to(second.weight.dtype))
    return sent


def read_bin(dw: Tensor, db: Tensor) -> Tensor | None:
    """The image a bin's update difference holds: the unit with the largest bias difference, its weight
    difference over it (``x_n`` exactly when one sample switched); None for an empty bin."""
    if not torch.isfinite(db).all() or not torch.isfinite(dw).all():
        return None
    j = int(db.abs().argmax())
    return None if db[j] == 0 else dw[j] / db[j]


def _aux_images(threat: ThreatModel) -> Tensor:
    """The attacker's auxiliary images (its out-of-distribution ones when it has no others)."""
    aux = threat.aux
    if aux is None:
        return torch.empty(0)
    return aux.images if len(aux.images) or aux.ood is None else aux.ood


@register
class ThresholdBins(ServerAttack):
    """The honest first layer lifted to fire for every sample; the classifier bins the batch over queries."""

    name = "threshold_bins"
    Config = ThresholdBinsConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), server="malicious", needs_aux=True,
                                threat=frozenset({"labels"}))
    budgets = {"quick": {}, "paper": {}}
    paper_budget = "analytic (ours): one query per threshold, queries - 1 bins"

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        found = trap_layers(setting.model, tuple(setting.input_shape))
        if isinstance(found, str):
            return found
        if found.norm is not None:
            return (f"the first layer's units go through {type(found.norm).__name__}: the affine first layer needs them "
                    "straight into the ReLU")
        head = classifier(setting.model, setting.num_classes)
        if head is None or head[0] != found.second_name:
            return "the layer reading the first layer's units must be the classifier (a one-hidden-layer MLP)"
        if setting.num_classes < 2:
            return "needs two or more classes (the target logit against the others)"
        if threat.aux is not None and len(_aux_images(threat)) < 2:
            return "needs 2 or more auxiliary images (the lift and the thresholds are their statistics)"
        return None

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        c_ = self.config
        layers = trap_layers(setting.model, tuple(setting.input_shape))
        aux = _aux_images(threat)
        first, second = layers.first, layers.second
        bias = lifted(first, aux)
        c = bias / bias.pow(2).sum()
        a = torch.randn(first.out_features, generator=gen, dtype=torch.float64)
        a /= a.norm()
        hidden = aux.flatten(1).double() @ first.weight.detach().double().T + bias
        points = switch_points(hidden, second, a, c, c_.gain, c_.slope)
        queries = c_.queries or setting.num_samples + 1
        inner = torch.quantile(points, torch.linspace(0, 1, queries, dtype=torch.float64)[1:-1])
        span = float(points.max() - points.min()) or 1.0
        thresholds = torch.cat([points.min()[None] - span, inner, points.max()[None] + span])
        updates, sent = [], None
        for t in thresholds.tolist():
            sent = binned_model(setting.model, layers.first_name, layers.second_name, bias, a, c, t, c_.gain, c_.slope)
            obs = client(sent)
            updates.append((obs.update[f"{layers.first_name}.weight"].double(), obs.update[f"{layers.first_name}.bias"].double()))
        lo, hi = setting.input_range
        images, empty = [], 0
        for (w0, b0), (w1, b1) in zip(updates[:-1], updates[1:]):
            image = read_bin(w1 - w0, b1 - b0)
            if image is None:
                empty += 1
                continue
            images.append(image.float().clamp(lo, hi).reshape(setting.input_shape))
        found = torch.stack(images) if images else torch.empty(0, *setting.input_shape)
        labels, source = server_labels(obs, setting, threat)
        return Reconstruction(fill_batch(found, setting.num_samples, setting.input_range), labels.cpu(), 0.0, [], {
            "labels": source, "bins": queries - 1, "empty_bins": empty, "candidates": len(images),
            "layer": layers.first_name, "gain": c_.gain, "slope": c_.slope, "malicious_model": sent})
