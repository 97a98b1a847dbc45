"""Deep Leakage from Gradients (Zhu et al. 2019) and its label-restoring variant iDLG (Zhao et al. 2020).

DLG: L2 distance between the simulated and the observed update, optimised with L-BFGS over the inputs and,
when the labels are not granted, jointly over soft labels (softmax of free logits), as in the paper.
iDLG: restore the label analytically from the output layer (one sample), then DLG with that label.

Deviations: the L2 distance is divided by ||observed||^2 (same minimiser, but a tiny update, such as a
FedAvg delta at lr 0.01, no longer falls under L-BFGS's tolerances and ends the attack at once); L-BFGS
runs with a strong-Wolfe line search; the original used none and often diverges to
NaN, which would make the attack look weaker than it is. Restarts run one after another (L-BFGS couples
all coordinates, so batching restarts would change the maths); the winner is the lowest L2 distance.

iDLG given the label it restores IS DLG given that label: same seed, same initial inputs and logits (both
drawn either way), same objective. When a plan grants DLG the labels and iDLG restores the granted one,
the certificate reuses DLG's run for iDLG and says so (``Capabilities.same_run_as``, ``redteam.repeats``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from guardfl.redteam.attacks.base import (
    DECODING_THREAT, GRADIENT_THREAT, Attack, OptimisationConfig, Capabilities, Reconstruction,
)
from guardfl.redteam.attacks.compute import progress_bar, random_inputs
from guardfl.redteam.attacks.labels import labels_for
from guardfl.redteam.attacks.optimisation.engine import ObjectiveWeights, Replica
from guardfl.redteam.attacks.registry import register


class DLGConfig(OptimisationConfig):
    iterations: int = Field(default=300, ge=1, le=1_000_000, json_schema_extra={"allowed": "an integer in [1, 1000000]"})
    lr: float = Field(default=1.0, gt=0, json_schema_extra={"allowed": "> 0"})
    history: int = Field(default=100, ge=1, le=10_000, json_schema_extra={"allowed": "an integer in [1, 10000]"})


@register
class DLG(Attack):
    """Zhu et al. 2019: L2 gradient matching with L-BFGS, labels optimised jointly unless known."""

    name = "dlg"
    Config = DLGConfig
    capabilities = Capabilities(threat=GRADIENT_THREAT | DECODING_THREAT)
    restore_labels = False
    budgets = {"quick": {"iterations": 300}, "paper": {"iterations": 6000}}
    paper_budget = ("Zhu et al. 2019: 300 L-BFGS steps of up to 20 iterations each, i.e. up to 6,000 L-BFGS "
                    "iterations (here one L-BFGS call of that many iterations, the history kept throughout)")

    @classmethod
    def fixed_labels(cls, observation, knowledge):
        """Granted labels, or (iDLG) the restored ones; None when DLG optimises soft labels jointly. The
        one rule ``_reconstruct`` follows, so a planner comparing them compares what the attacks run with."""
        if knowledge.labels is not None or cls.restore_labels:
            return labels_for(observation, knowledge)
        return None

    def _reconstruct(self, observation, knowledge, device, gen) -> Reconstruction:
        c = self.config
        replica = Replica(observation, knowledge, ObjectiveWeights(distance="l2"), device)
        n, k = observation.num_samples, observation.num_classes
        fixed = self.fixed_labels(observation, knowledge)
        labels, source = fixed if fixed is not None else (None, "joint")
        joint = fixed is None
        results = []
        bar = progress_bar(c.progress, c.iterations * c.restarts, self.name)
        for _ in range(c.restarts):
            x = random_inputs((n, *observation.input_shape), observation.input_range, gen, device).requires_grad_(True)
            logits = torch.randn(n, k, generator=gen).to(device).requires_grad_(True)
            variables = [x, logits] if joint else [x]
            opt = torch.optim.LBFGS(
                variables, lr=c.lr, max_iter=c.iterations, history_size=c.history,
                line_search_fn="strong_wolfe", tolerance_grad=1e-12, tolerance_change=1e-16,
            )

            def closure():
                opt.zero_grad()
                loss = replica.objective(x, logits.softmax(-1) if joint else labels)
                loss.backward()
                if bar is not None:
                    bar.update(1)
                return loss

            opt.step(closure)
            with torch.no_grad():
                y = logits.softmax(-1) if joint else labels
                value = replica.objective(x.detach(), y)
            value = float(value) if torch.isfinite(value) else float("inf")
            results.append((value, x.detach().clamp(*observation.input_range), logits.detach().argmax(-1) if joint else labels))
        if bar is not None:
            bar.close()
        best = min(range(len(results)), key=lambda i: results[i][0])
        value, inputs, out_labels = results[best]
        return Reconstruction(inputs, out_labels, value, [r[0] for r in results], {"labels": source, "winner": best})


@register
class IDLG(DLG):
    """Zhao et al. 2020: the label from the output layer's gradient (one sample), then DLG."""

    name = "idlg"
    restore_labels = True

    # given the label it restores, iDLG runs DLG's computation: when DLG is granted that very label (same
    # budget, seed and threat otherwise), the planner runs it once (``redteam.repeats``)
    capabilities = Capabilities(max_samples_inferred_labels=1, threat=GRADIENT_THREAT | DECODING_THREAT,
                                same_run_as="dlg")
    default_threat = {"labels": "inferred"}  # label restoration is the point of iDLG
    paper_budget = "Zhao et al. 2020: DLG's budget (300 L-BFGS steps of up to 20 iterations)"
