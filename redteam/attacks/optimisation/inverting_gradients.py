"""Inverting Gradients (Geiping et al. 2020), "csDLG" in the Outpost paper.

Cosine distance between the simulated and the observed update plus total variation, Adam on the signed
gradient, the box constraint of the input range (projection after each step), learning rate x0.1 at 3/8,
5/8 and 7/8 of the iterations. Labels are granted or restored (iDLG / Yin et al.). Restarts run batched
(``torch.func.vmap``); the winner is the restart with the lowest objective.

With a known defense the objective adapts (Wu et al. 2023, app. A): cosine only over the non-zero
coordinates of a pruned update, a sign-matching loss (or tanh surrogate) against sign compression, TV on
|x| against InstaHide. With ``bn > 0`` and a threat that grants BatchNorm statistics, the BN prior joins.

Several private samples of one setting (``reconstruct_many``) run as one batched optimisation over
samples x restarts (measured on LeNet 25x25 under Outpost, one thread: 3.8x cheaper per sample at 16
samples than one call each; ``bench/bench_sample_batching.py``); see the class docstring for what is exact.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from guardfl.redteam.attacks.base import (
    DECODING_THREAT, GRADIENT_THREAT, Attack, OptimisationConfig, Capabilities, Reconstruction,
)
from guardfl.redteam.attacks.compute import progress_bar, random_inputs
from guardfl.redteam.attacks.labels import labels_for
from guardfl.redteam.attacks.setting import on_device
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica, restarts_vmapped
from guardfl.redteam.attacks.optimisation.optimiser import evaluate_batched, optimise_batched
from guardfl.redteam.attacks.optimisation.targets import observation_target, stack_targets, target_of
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.client.simulate import bn_layers


class InvertingGradientsConfig(OptimisationConfig):
    iterations: int = Field(default=2000, ge=1, le=1_000_000, json_schema_extra={"allowed": "an integer in [1, 1000000]"})
    restarts: int = Field(default=4, ge=1, le=64, json_schema_extra={"allowed": "an integer in [1, 64]"})
    lr: float = Field(default=0.1, gt=0, json_schema_extra={"allowed": "> 0"})
    tv: float = Field(default=1e-2, ge=0, json_schema_extra={"allowed": ">= 0"})
    bn: float = Field(default=0.0, ge=0, json_schema_extra={"allowed": ">= 0"})
    group: float = Field(default=0.0, ge=0, json_schema_extra={"allowed": ">= 0"})
    group_every: int = Field(default=0, ge=0, le=1_000_000, json_schema_extra={"allowed": "an integer in [0, 1000000]"})

    @model_validator(mode="after")
    def _group_used(self) -> "InvertingGradientsConfig":
        if self.group > 0 and self.group_every == 0:
            raise ValueError(f"group: {self.group:g} weighs group consistency, which runs only with group_every >= 1 "
                             "(it is 0): set group_every, or remove group")
        return self


@register
class InvertingGradients(Attack):
    """Geiping et al. 2020: cosine + TV, signed Adam, box constraint, step decay; restarts batched.

    ``reconstruct_many`` batches samples too: S private samples x R restarts in one ``optimise_batched``
    (vmapped over samples, then restarts), one replica of the client for the chunk and each sample's own
    target (its update, mask, BatchNorm statistics, labels), initial guesses from its own generator, its
    own group-consistency anchor and its own winner. A sample's result is the one its own call gives, up
    to float32 reduction order. Loops instead (one call per sample, exact): a chunk of one; BatchNorm
    knowledge ``proxy`` on a model with BatchNorm (each sample's released running statistics are written
    into the replica's model, so the samples do not share one replica); a large model on a CPU
    (``restarts_vmapped`` False: batching samples would save little there and hold S times the autograd
    graphs in memory; each sample's restarts are still vmapped when its replica factors the cosine,
    ``Replica.vmap_restarts``).
    """

    name = "inverting_gradients"
    Config = InvertingGradientsConfig
    capabilities = Capabilities(max_samples_inferred_labels="classes", batches_samples=True,
                                threat=GRADIENT_THREAT | DECODING_THREAT)
    budgets = {"quick": {"iterations": 1000, "restarts": 4}, "paper": {"iterations": 24000, "restarts": 4}}
    paper_budget = ("Geiping et al. 2020: 24,000 Adam iterations (lr 0.1, x0.1 at 3/8, 5/8, 7/8); Huang et al. "
                    "2021 use 10,000. Restarts: 4 (guardfl's choice; the papers report single or best-of trials)")

    @classmethod
    def ignored_options(cls, budget, threat) -> str | None:
        bn = budget.get("bn")
        if isinstance(bn, (int, float)) and bn > 0 and threat.bn not in ("exact", "infer"):
            return (f"budget.bn: {bn:g} weighs a BatchNorm prior, but threat.bn is {threat.bn!r} (no statistics for a "
                    "prior: it is never used); set threat.bn: exact or infer, or remove budget.bn")
        return None

    def _weights(self) -> ObjectiveWeights:
        c = self.config
        return ObjectiveWeights("cosine", tv=c.tv, bn=c.bn, group=c.group if c.group_every else 0.0)

    def _initial(self, observation, gen, device):
        """The R initial guesses ``(R, n, ...)`` of one sample, from its generator."""
        shape = (self.config.restarts, observation.num_samples, *observation.input_shape)
        return random_inputs(shape, observation.input_range, gen, device)

    def _optimise(self, objective, x0, observation, replica, targets=None):
        c = self.config
        bar = progress_bar(c.progress, c.iterations, self.name)
        x = optimise_batched(
            objective, x0, iterations=c.iterations, lr=c.lr, bounds=observation.input_range,
            group_every=c.group_every, progress=bar.update if bar else None,
            vmap_restarts=replica.vmap_restarts, targets=targets,
        )
        if bar:
            bar.close()
        return x

    def _reconstruct(self, observation, knowledge, device, gen) -> Reconstruction:
        labels, source = labels_for(observation, knowledge)
        replica = Replica(observation, knowledge, self._weights(), device)

        def objective(x, anchor):
            return replica.objective(x, labels, anchor)

        x = self._optimise(objective, self._initial(observation, gen, device), observation, replica)
        return self._choose(objective, x, labels, source)

    def _reconstruct_many(self, observations, knowledges, device, gens) -> list[Reconstruction]:
        proxy = knowledges[0].bn_mode == "proxy" and bn_layers(observations[0].model)
        large = not restarts_vmapped(observations[0].model, device)
        if len(observations) == 1 or proxy or large:
            return super()._reconstruct_many(observations, knowledges, device, gens)
        observations, knowledges = on_device(observations, knowledges, device)
        replica = Replica(observations[0], knowledges[0], self._weights(), device)
        labelled = [labels_for(o, k) for o, k in zip(observations, knowledges)]
        targets = stack_targets([{**observation_target(o, k, replica.pruned, device), "labels": labels}
                                 for o, k, (labels, _) in zip(observations, knowledges, labelled)])
        if targets is None:  # not one setting after all (cannot happen for checked observations): the loop
            return [self._reconstruct(o, k, device, g) for o, k, g in zip(observations, knowledges, gens)]

        def objective(x, anchor, target):
            return replica.objective(x, target["labels"], anchor, target)

        x0 = torch.stack([self._initial(o, g, device) for o, g in zip(observations, gens)])
        x = self._optimise(objective, x0, observations[0], replica, targets)
        out = []
        for s, (labels, source) in enumerate(labelled):
            target = target_of(targets, s)
            out.append(self._choose(lambda xi, a, t=target: objective(xi, a, t), x[s], labels, source))
        return out

    def _choose(self, objective, x, labels, source) -> Reconstruction:
        """The restart with the lowest objective (never the ground truth); ``x`` is one sample's ``(R, n, ...)``."""
        scores = evaluate_batched(objective, x).cpu()
        best = int(scores.argmin())
        return Reconstruction(x[best], labels, float(scores[best]), scores.tolist(), {"labels": source, "winner": best})
