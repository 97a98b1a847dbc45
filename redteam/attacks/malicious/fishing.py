"""Fishing for user data (Wen et al., ICML 2022): class fishing and feature fishing, client in train mode.

A malicious server changes only the parameters of the classification layer (the architecture stays the
one the client expects) so that, in the client's gradient, one sample is all that remains, however large
the batch:

1. Query 0: the honest model; its update gives the server the batch's labels (Wen et al. and Wang et al.
   2024, Sec. VII: "the Fishing attack requires querying the client for labels initially"; here they are
   granted by ``threat.labels: known``, which this attack requires). The target class ``c`` is the
   rarest class of the batch (``target_class`` to choose it).
2. Class fishing (the target class has one sample, or ``strategy: class``): the classifier's rows are all
   zeroed except ``c``'s, biases 0 except ``b_c = -beta``. Then ``p_c ~ 0`` for every sample, so the
   gradient reaching the features is ``(p_c - y_c) W_c``: zero outside class ``c``, ``-W_c`` inside. Every
   layer's gradient but the classifier's other rows is the class-``c`` sample's alone (one query).
3. Feature fishing (several samples of the class, ``strategy: auto`` or ``feature``): the classifier's only
   weight is ``alpha`` on one feature ``j`` of row ``c``, bias ``-alpha t``: ``p_c ~ 1`` for samples whose
   feature exceeds ``t``, ``~ 0`` below. The target bias's gradient tells the server how many samples
   lie above ``t``; it searches ``t`` (doubling, then bisection; ``max_queries``) until exactly one
   sample lies between two thresholds. The difference of those two updates is that one sample's: the
   gradient of its target logit ``d z_c / d theta``, which the attack matches as a cross-entropy
   gradient with the zero-sum labels ``e_d - e_c`` (``band_view``). This is our reading of Wen et al.'s
   multi-query feature fishing (binary search on a feature threshold); the isolated sample is the one
   with the largest feature ``j`` (any class). When no pair of thresholds isolates one sample within
   ``max_queries`` (features equal to within ``1/alpha``, as on a fresh sigmoid LeNet, or a defense
   blurring the counts), the attack fishes the class instead and says why in ``info``.
4. The isolated part of the update (``Observation.matched``: the classifier rows that mix every sample
   masked out) is inverted by Inverting Gradients; the result stands for that sample
   (``fill_batch`` repeats it to the batch size for matching).

The client trains as deployed: train mode, so BatchNorm normalises the target sample with the WHOLE
batch's statistics while the attacker's replica normalises its guess with its own (Wang et al. 2024
found Fishing's published strength depends on running the client in eval mode; ``client.train_mode``
gives that comparison). FedSGD only, as Wang et al. note of the method.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from guardfl.redteam.attacks.base import Capabilities, OptimisationConfig, Reconstruction
from guardfl.redteam.attacks.setting import Setting
from guardfl.redteam.attacks.registry import get, register
from guardfl.redteam.attacks.malicious.evade_columns import calibration_batch, least_passing
from guardfl.redteam.attacks.malicious.server import (Denoise, Repeats, ServerAttack, defense_known, fill_batch, query_averaged,
                                                    repeats_for, repeats_line)
from guardfl.redteam.client.simulate import ClientQuery, Observation, SideKnowledge
from guardfl.redteam.threat import ThreatModel


def classifier(model: nn.Module, num_classes: int) -> tuple[str, nn.Linear] | None:
    """(name, module) of the model's last ``nn.Linear`` with ``num_classes`` outputs, None if none."""
    found = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == num_classes:
            found = (name, module)
    return found


#: disguised class fishing (``disguise: true``): the other rows are scaled by this (3x the share under
#: which ``inspect_model`` calls a row zeroed) and the biases lie ``DISGUISE_GAP`` logits apart (its
#: bias-gap threshold): an adaptive server that has read ``guardfl/inspect.py``
DISGUISE_SCALE = 3e-3
DISGUISE_GAP = 20.0
#: the other rows' scales tried in turn against a client that inspects with a batch: the least that passes
#: its shared-columns check (at 3e-3 every feature's gradient runs through the target class alone, so every
#: unit's coefficient per sample is parallel to every other's; ``evade_columns``)
DISGUISE_SCALES = (3e-3, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3)


def fishing_model(model: nn.Module, num_classes: int, target: int, beta: float, disguise: bool = False,
                  scale: float = DISGUISE_SCALE) -> nn.Module:
    """The class-fishing model: ``model`` with its classifier's rows other than ``target`` zeroed and the
    target's bias at ``-beta`` (see the module docstring). ``disguise``: the other rows scaled by
    ``scale`` instead of zeroed and the biases ``DISGUISE_GAP`` apart (target ``-gap/2``, the
    others ``+gap/2``), so that no zeroed row and no bias gap shows; the other classes' samples then send a
    small share of the gradient too."""
    sent = copy.deepcopy(model)
    _, layer = classifier(sent, num_classes)
    with torch.no_grad():
        keep = layer.weight[target].clone()
        if disguise:
            layer.weight.mul_(scale)
        else:
            layer.weight.zero_()
        layer.weight[target] = keep
        if layer.bias is not None:
            layer.bias.fill_(DISGUISE_GAP / 2 if disguise else 0.0)
            layer.bias[target] = -DISGUISE_GAP / 2 if disguise else -beta
    return sent


def target_row_masks(update: dict[str, torch.Tensor], layer_name: str, target: int) -> dict[str, torch.Tensor]:
    """Every coordinate of ``update`` except the classifier's rows other than ``target`` (which mix every
    sample of the batch): what a fishing view matches."""
    masks = {}
    for name, value in update.items():
        mask = torch.ones_like(value, dtype=torch.bool)
        if name in (f"{layer_name}.weight", f"{layer_name}.bias"):
            mask.zero_()
            mask[target] = True
        masks[name] = mask
    return masks


def isolated_view(observation: Observation, layer_name: str, target: int, count: int) -> Observation:
    """The part of ``observation`` that only the target class's ``count`` samples produced: the
    classifier's other rows masked out and zeroed, ``count`` samples of label ``target``."""
    matched = target_row_masks(observation.update, layer_name, target)
    update = {name: value * matched[name] for name, value in observation.update.items()}
    labels = torch.full((count,), target, dtype=torch.long)
    side = SideKnowledge(labels=labels)
    return replace(observation, update=update, num_samples=count, side=side, released_bn_stats=[], matched=matched)


def feature_fishing_model(model: nn.Module, num_classes: int, target: int, feature: int, alpha: float,
                          threshold: float) -> nn.Module:
    """The feature-fishing model for one threshold: the classifier's only non-zero row is ``target``'s,
    ``alpha`` on feature ``feature``, bias ``-alpha * threshold``: the target's probability is ~1 for the
    samples whose feature exceeds the threshold and ~0 for the others."""
    sent = copy.deepcopy(model)
    _, layer = classifier(sent, num_classes)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[target, feature] = alpha
        if layer.bias is not None:
            layer.bias.zero_()
            layer.bias[target] = -alpha * threshold
    return sent


def band_view(upper: Observation, lower: Observation, layer_name: str, target: int, num_classes: int) -> Observation:
    """What one sample alone produced: ``upper`` (threshold below it) minus ``lower`` (threshold above it),
    the update of every sample outside the band cancelling. That difference is the gradient of the
    sample's target logit (``d z_c / d theta``): a cross-entropy gradient with the labels ``e_d - e_c``
    (zero sum, so the softmax term vanishes; ``d`` another class, whose logit is constant 0), matched on
    every layer and the classifier's target row (the other rows carry ``-f / (K-1)``, not ``-f``)."""
    matched = target_row_masks(upper.update, layer_name, target)
    update = {name: (value - lower.update[name]) * matched[name] for name, value in upper.update.items()}
    other = (target + 1) % num_classes
    labels = torch.zeros(1, num_classes)
    labels[0, other], labels[0, target] = 1.0, -1.0
    return replace(upper, update=update, num_samples=1, side=SideKnowledge(labels=labels), released_bn_stats=[],
                   matched=matched)


class _OutOfQueries(Exception):
    """The feature-fishing search spent ``max_queries``."""


class FishingConfig(OptimisationConfig):
    iterations: int = Field(default=2000, ge=1, le=1_000_000, json_schema_extra={"allowed": "an integer in [1, 1000000]"})
    restarts: int = Field(default=4, ge=1, le=64, json_schema_extra={"allowed": "an integer in [1, 64]"})
    lr: float = Field(default=0.1, gt=0, json_schema_extra={"allowed": "> 0"})
    tv: float = Field(default=1e-2, ge=0, json_schema_extra={"allowed": ">= 0"})
    beta: float = Field(default=50.0, gt=0, json_schema_extra={"allowed": "> 0"})
    target_class: int | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null (the batch's rarest class) or >= 0"})
    strategy: Literal["auto", "class", "feature"] = Field(
        default="auto", json_schema_extra={"allowed": "'auto' (class fishing when the target class has one sample, "
                                                      "else feature fishing), 'class' or 'feature'"})
    # steep: two samples' features may differ by 1e-5 (sigmoid features of a fresh LeNet), and the count the
    # server reads is only an integer when every sample's target probability is saturated at 0 or 1
    alpha: float = Field(default=1e6, gt=0, json_schema_extra={"allowed": "> 0"})
    feature: int | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null (drawn from the seed) or >= 0"})
    max_queries: int = Field(default=48, ge=4, le=1000, json_schema_extra={"allowed": "an integer in [4, 1000]"})
    #: class fishing's model sent this many times and the updates averaged (``server.query_averaged``);
    #: "auto": 16 against a known defense that draws fresh noise, else 1 (feature fishing's queries: once each)
    repeats: Repeats = "auto"
    denoise: Denoise = "auto"  # the filter of its reads (``server.Denoise``)
    #: class fishing disguised against inspect_model's classifier checks (no zeroed rows, no bias gap; see
    #: ``fishing_model``); class fishing only (feature fishing's one-weight classifier cannot be disguised)
    disguise: bool = False

    @model_validator(mode="after")
    def _used_by_strategy(self) -> "FishingConfig":
        """Class fishing never reads the feature-fishing options: set with ``strategy: class`` they are
        refused, not ignored."""
        if self.disguise and self.strategy != "class":
            raise ValueError("disguise: true disguises class fishing only (feature fishing's classifier keeps one weight); "
                             "set strategy: class")
        if self.strategy == "class":
            if self.disguise and "beta" in self.model_fields_set:
                raise ValueError(f"beta: {self.beta!r}, but disguise: true sets the biases {DISGUISE_GAP:g} logits apart "
                                 "(a larger beta is the bias gap the disguise hides): remove beta, or disguise: false")
            unused = [f for f in ("feature", "alpha", "max_queries") if f in self.model_fields_set]
            if unused:
                raise ValueError(f"{unused[0]}: {getattr(self, unused[0])!r} is a feature-fishing option, but strategy is "
                               "'class' (class fishing never reads it): remove it, or use strategy 'auto' or 'feature'")
        return self


@register
class Fishing(ServerAttack):
    """Wen et al. 2022, class fishing: isolate one class's gradient, then Inverting Gradients on it."""

    name = "fishing"
    one_round_reads = False  # a label query, then its target (class) or a bisection (feature): rounds combined
    Config = FishingConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), server="malicious",
                                threat=frozenset({"labels", "defense", "fedavg"}))  # its inner IG runs with bn: none
    budgets = {"quick": {"iterations": 1000, "restarts": 4}, "paper": {"iterations": 24000, "restarts": 4}}
    paper_budget = ("Wen et al. 2022: class fishing, one query after the label query; the isolated gradient "
                    "inverted as in Geiping et al. 2020 (24,000 iterations)")

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        if threat.labels != "known":
            return "needs the batch's labels (the server queries them first); threat.labels: known"
        if classifier(setting.model, setting.num_classes) is None:
            return f"needs a final nn.Linear with {setting.num_classes} outputs (the classifier it modifies)"
        return None

    def refuses(self, setting: Setting) -> str | None:
        c = self.config
        if c.target_class is not None and c.target_class >= setting.num_classes:
            return f"budget.target_class: {c.target_class}; allowed: [0, {setting.num_classes - 1}] (model.num_classes)"
        found = classifier(setting.model, setting.num_classes)
        if c.feature is not None and found is not None and c.feature >= found[1].in_features:
            return (f"budget.feature: {c.feature}; allowed: [0, {found[1].in_features - 1}] (the inputs of the classifier "
                    f"{found[0]})")
        return None

    def _interrogate(self, client: ClientQuery, setting: Setting, threat: ThreatModel, device: torch.device,
                     gen: torch.Generator) -> Reconstruction:
        c = self.config
        labels = threat.knowledge(client(setting.model)).labels  # query 0: the labels
        if labels.dim() > 1:
            raise ValueError("fishing: the client trains on soft (mixed) labels; class fishing needs hard labels")
        counts = torch.bincount(labels.cpu(), minlength=setting.num_classes)
        if c.target_class is not None:
            if c.target_class >= setting.num_classes:
                raise ValueError(f"fishing.target_class: {c.target_class}; allowed: [0, {setting.num_classes - 1}]")
            target = c.target_class
            if counts[target] == 0:
                raise ValueError(f"fishing.target_class: class {target} has no sample in this batch (not applicable)")
        else:
            present = torch.nonzero(counts).flatten()
            target = int(present[counts[present].argmin()])
        m = int(counts[target])
        layer_name, layer = classifier(setting.model, setting.num_classes)
        feature_fishing = c.strategy == "feature" or (c.strategy == "auto" and m > 1)
        fished = None
        if feature_fishing:
            feature = c.feature if c.feature is not None else int(torch.randint(0, layer.in_features, (1,), generator=gen))
            if feature >= layer.in_features:
                raise ValueError(f"fishing.feature: {feature}; allowed: [0, {layer.in_features - 1}] (the classifier's inputs)")
            fished = self._feature_fish(client, setting, layer_name, target, m, feature)
        if fished is not None and not isinstance(fished, str):
            view, sent, info = fished
        else:  # class fishing (also the fallback when feature fishing could not isolate one sample)
            sent, scale = self._class_model(client, setting, threat, target)
            known = defense_known(setting, threat)
            repeats = repeats_for(known, c.repeats, client.max_rounds)
            observation, answered = query_averaged(client, sent, repeats)  # query 1 (and its repeats)
            view = isolated_view(observation, layer_name, target, m)
            info = {"strategy": ("disguised " if c.disguise else "") + ("class fishing" if m == 1 else
                                                                       f"class fishing on the class's {m} samples jointly")}
            info["repeats"] = repeats_line(repeats, known, answered, client.max_rounds)
            if scale:
                info["other_rows_scale"] = scale
            if isinstance(fished, str):
                info["feature_fishing"] = fished
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        inner = get("inverting_gradients", iterations=c.iterations, restarts=c.restarts, lr=c.lr, tv=c.tv,
                    seed=seed, device=str(device), progress=c.progress)
        found = inner.reconstruct(view, ThreatModel(labels="known", bn="none", defense=threat.defense,
                                                    fedavg=threat.fedavg))
        images = fill_batch(found.inputs.cpu(), setting.num_samples, setting.input_range)
        out_labels = torch.full((setting.num_samples,), target, dtype=torch.long)
        return Reconstruction(images, out_labels, found.objective, found.restart_objectives, {
            "target_class": target, "target_samples": int(counts[target]), "labels": "known", **info,
            "client_mode": "train" if setting.train_mode else "eval", "malicious_model": sent})

    def _class_model(self, client: ClientQuery, setting: Setting, threat: ThreatModel, target: int) -> tuple[nn.Module, str]:
        """The class-fishing model, and (disguised) the certificate's line on the other rows' scale: against
        a client that inspects, the least of ``DISGUISE_SCALES`` that passes its shared-columns check on the
        server's own batch (``evade_columns``)."""
        c = self.config
        build = lambda scale: fishing_model(setting.model, setting.num_classes, target, c.beta, c.disguise, scale)  # noqa: E731
        if not c.disguise:
            return build(DISGUISE_SCALE), ""
        if not getattr(client, "inspect", False):
            return build(DISGUISE_SCALE), f"{DISGUISE_SCALE:g} (the client does not inspect)"
        x, y, what = calibration_batch(threat.aux, setting)
        sent, _, line = least_passing(build, lambda model: model, DISGUISE_SCALES, None, x, y, what)
        return sent, line

    def _feature_fish(self, client: ClientQuery, setting: Setting, layer_name: str, target: int, m: int,
                      feature: int) -> tuple[Observation, nn.Module, dict] | str:
        """Wen et al.'s feature fishing as a search over thresholds: a query with threshold ``t`` tells the
        server how many samples have feature > t (its target-bias gradient is ``(above - m) / B``); it
        narrows ``t`` until one sample lies between two thresholds, whose updates' difference is that
        sample's alone (``band_view``). Returns the view, the last model sent and what it did; or, when
        no pair of thresholds isolates one sample within ``max_queries`` (features equal to within
        ``1/alpha``, or a defense blurring the counts), why not: the caller then fishes the class."""
        c = self.config
        n, k = setting.num_samples, setting.num_classes
        asked: dict[float, tuple[int, float, Observation]] = {}

        def above(t: float) -> int:
            if t not in asked:
                if client.queries - 1 >= c.max_queries:  # query 0 (the labels) is not counted
                    raise _OutOfQueries
                obs = client(feature_fishing_model(setting.model, k, target, feature, c.alpha, t))
                raw = n * float(obs.update[f"{layer_name}.bias"][target]) + m
                asked[t] = (round(raw), raw, obs)
            return asked[t][0]

        try:
            lo, hi = -1.0, 1.0
            while above(hi) > 0:
                lo, hi = hi, hi * 4
            while above(lo) == 0:
                lo *= 4
            while above(lo) > 1:  # invariant: above(lo) >= 1 > 0 == above(hi)
                mid = (lo + hi) / 2
                if above(mid) >= 1:
                    lo = mid
                else:
                    hi = mid
        except _OutOfQueries:
            return (f"no threshold of feature {feature} isolated one sample within max_queries={c.max_queries} "
                    "(samples with equal features cannot be separated)")
        if abs(asked[lo][1] - 1) > 0.05 or abs(asked[hi][1]) > 0.05:
            return (f"feature {feature} does not separate the samples at alpha={c.alpha:g} (counts "
                    f"{asked[lo][1]:.2f} and {asked[hi][1]:.2f} are not whole: features closer than 1/alpha)")
        view = band_view(asked[lo][2], asked[hi][2], layer_name, target, k)
        sent = feature_fishing_model(setting.model, k, target, feature, c.alpha, hi)
        return view, sent, {"strategy": "feature fishing", "feature": feature, "band": [lo, hi]}

