"""Fishing for user data (Wen et al., ICML 2022), class fishing, with the client in train mode.

A malicious server changes only the parameters of the classification layer (the architecture stays the
one the client expects) so that, in the client's gradient, one target class's samples are all that
remain, however large the batch:

1. Query 0: the honest model; its update gives the server the batch's labels (Wen et al. and Wang et al.
   2024, Sec. VII: "the Fishing attack requires querying the client for labels initially"; here they are
   granted by ``threat.labels: known``, which this attack requires). The target class ``c`` is the
   rarest class of the batch (``target_class`` to choose it).
2. Query 1: the fishing model: every row of the last linear layer zeroed except row ``c``, every bias 0
   except ``b_c = -beta``. Then ``p_c ~ 0`` for every sample, so the gradient reaching the features is
   ``(p_c - y_c) W_c``: zero for every sample outside class ``c`` and ``-W_c`` for each sample of it. Every
   layer's gradient but the classifier's other rows is the (mean-scaled) gradient of the class-``c``
   samples alone.
3. The isolated part of the update (``Observation.matched``: the other rows masked out) is attacked by
   Inverting Gradients on ``m`` images of label ``c``, ``m`` the class's count; the result is returned
   for those samples (the rest of the batch is not attacked: ``fill_batch`` repeats the result).

The client trains as deployed: train mode, so BatchNorm normalises the target sample with the WHOLE
batch's statistics while the attacker's replica normalises its guess with its own (Wang et al. 2024
found Fishing's published strength depends on running the client in eval mode; ``client.train_mode``
gives that comparison). One sample of the class (``m = 1``) is the case class fishing is for.

Not implemented (yet): feature fishing (Wen et al.'s multi-round binary search on a feature threshold,
for a target class with several samples in the batch): with ``m > 1`` this attack inverts the ``m``
samples jointly from the isolated gradient, weaker than feature fishing, and says so in ``info``.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from pydantic import Field
from torch import nn

from guardfl.redteam.attacks.base import Capabilities, OptimisationConfig, Reconstruction, Setting
from guardfl.redteam.attacks.registry import get, register
from guardfl.redteam.attacks.server import ServerAttack, fill_batch
from guardfl.redteam.client import ClientQuery, Observation, SideKnowledge
from guardfl.redteam.threat import ThreatModel


def classifier(model: nn.Module, num_classes: int) -> tuple[str, nn.Linear] | None:
    """(name, module) of the model's last ``nn.Linear`` with ``num_classes`` outputs, None if none."""
    found = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == num_classes:
            found = (name, module)
    return found


def fishing_model(model: nn.Module, num_classes: int, target: int, beta: float) -> nn.Module:
    """The class-fishing model: ``model`` with its classifier's rows other than ``target`` zeroed and the
    target's bias at ``-beta`` (see the module docstring)."""
    sent = copy.deepcopy(model)
    _, layer = classifier(sent, num_classes)
    with torch.no_grad():
        keep = layer.weight[target].clone()
        layer.weight.zero_()
        layer.weight[target] = keep
        if layer.bias is not None:
            layer.bias.zero_()
            layer.bias[target] = -beta
    return sent


def isolated_view(observation: Observation, layer_name: str, target: int, count: int) -> Observation:
    """The part of ``observation`` that only the target class's ``count`` samples produced: the
    classifier's other rows masked out and zeroed, ``count`` samples of label ``target``."""
    matched, update = {}, {}
    for name, value in observation.update.items():
        mask = torch.ones_like(value, dtype=torch.bool)
        if name in (f"{layer_name}.weight", f"{layer_name}.bias"):
            mask.zero_()
            mask[target] = True
        matched[name], update[name] = mask, value * mask
    labels = torch.full((count,), target, dtype=torch.long)
    side = SideKnowledge(labels=labels)
    return replace(observation, update=update, num_samples=count, side=side, released_bn_stats=[], matched=matched)


class FishingConfig(OptimisationConfig):
    iterations: int = Field(default=2000, ge=1, json_schema_extra={"allowed": "an integer >= 1"})
    restarts: int = Field(default=4, ge=1, json_schema_extra={"allowed": "an integer >= 1"})
    lr: float = Field(default=0.1, gt=0, json_schema_extra={"allowed": "> 0"})
    tv: float = Field(default=1e-2, ge=0, json_schema_extra={"allowed": ">= 0"})
    beta: float = Field(default=50.0, gt=0, json_schema_extra={"allowed": "> 0"})
    target_class: int | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null (the batch's rarest class) or >= 0"})


@register
class Fishing(ServerAttack):
    """Wen et al. 2022, class fishing: isolate one class's gradient, then Inverting Gradients on it."""

    name = "fishing"
    Config = FishingConfig
    capabilities = Capabilities(protocols=frozenset({"fedsgd"}), server="malicious")
    budgets = {"quick": {"iterations": 1000, "restarts": 4}, "paper": {"iterations": 24000, "restarts": 4}}
    paper_budget = ("Wen et al. 2022: class fishing, one query after the label query; the isolated gradient "
                    "inverted as in Geiping et al. 2020 (24,000 iterations)")

    @classmethod
    def applicable(cls, setting: Setting, threat: ThreatModel | None = None) -> str | None:
        reason = super().applicable(setting, threat)
        if reason is not None:
            return reason
        threat = threat or ThreatModel()
        if threat.labels != "known":
            return "needs the batch's labels (the server queries them first); threat.labels: known"
        if classifier(setting.model, setting.num_classes) is None:
            return f"needs a final nn.Linear with {setting.num_classes} outputs (the classifier it modifies)"
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
        layer_name, _ = classifier(setting.model, setting.num_classes)
        sent = fishing_model(setting.model, setting.num_classes, target, c.beta)
        observation = client(sent)  # query 1
        view = isolated_view(observation, layer_name, target, m)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        inner = get("inverting_gradients", iterations=c.iterations, restarts=c.restarts, lr=c.lr, tv=c.tv,
                    seed=seed, device=str(device), progress=c.progress)
        found = inner.reconstruct(view, ThreatModel(labels="known", bn="none", defense=threat.defense,
                                                    fedavg=threat.fedavg))
        images = fill_batch(found.inputs.cpu(), setting.num_samples, setting.input_range)
        out_labels = torch.full((setting.num_samples,), target, dtype=torch.long)
        return Reconstruction(images, out_labels, found.objective, found.restart_objectives, {
            "target_class": target, "target_samples": m, "labels": "known",
            "strategy": "class fishing" if m == 1 else f"class fishing on {m} samples (feature fishing not implemented)",
            "client_mode": "train" if setting.train_mode else "eval", "malicious_model": sent})
