"""The labels an attack holds fixed: granted by the threat model, or restored from the output layer's update."""

from __future__ import annotations

from torch import Tensor

from guardfl.redteam.client.simulate import FedAvg, Observation
from guardfl.redteam.threat import Knowledge


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

