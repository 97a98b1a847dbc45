"""The threat model: what the attacker (an honest-but-curious server, or an eavesdropper) knows.

Always known: the global model (architecture and weights) and what the client transmitted. Optionally:
the private labels, BatchNorm statistics (the four settings of Huang et al. 2021, Sec. 3), the defense's
configuration (never its randomness), and the FedAvg local hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from torch import Tensor

from guardfl.config import StrictModel
from guardfl.redteam.client import FedAvg, FedSGD, Observation, bn_layers


class ThreatModel(StrictModel):
    """What the attacker knows.

    labels: ``known`` (granted the private labels) or ``inferred`` (restored from the update: iDLG for one
        sample, Yin et al. 2021 for a batch; DLG optimises them jointly).
    bn: ``exact`` (the private batch's BatchNorm statistics, prior of Yin et al./Huang et al.), ``infer``
        (the running statistics the client releases, used as the prior), ``proxy`` (the released running
        statistics used to normalise, no prior), ``none`` (no BatchNorm knowledge: batch statistics of the
        attacker's own guess, no prior).
    defense: ``known`` (the configuration, so the attack can use a defense-aware objective) or ``unknown``.
    fedavg: ``known`` (epochs, batch size, lr, momentum, weight decay: the attacker unrolls the local
        steps) or ``unknown`` (treat the delta as one gradient step: cosine matching is scale-free).
    """

    labels: Literal["known", "inferred"] = Field(default="inferred", json_schema_extra={"allowed": "'known' or 'inferred'"})
    bn: Literal["exact", "proxy", "infer", "none"] = Field(
        default="none", json_schema_extra={"allowed": "'exact', 'proxy', 'infer' or 'none'"}
    )
    defense: Literal["known", "unknown"] = Field(default="known", json_schema_extra={"allowed": "'known' or 'unknown'"})
    fedavg: Literal["known", "unknown"] = Field(default="known", json_schema_extra={"allowed": "'known' or 'unknown'"})

    def knowledge(self, observation: Observation) -> "Knowledge":
        """The facts this threat model grants about ``observation``; clear errors for what is unavailable."""
        has_bn = bool(bn_layers(observation.model))
        bn_target = None
        if self.bn != "none" and not has_bn:
            raise ValueError(f"threat.bn={self.bn!r}: the model has no BatchNorm layers; use bn='none'")
        if self.bn == "exact":
            if not observation.side.bn_batch_stats:
                raise ValueError("threat.bn='exact': the observation recorded no BatchNorm statistics")
            bn_target = observation.side.bn_batch_stats
        elif self.bn in ("infer", "proxy"):
            if not observation.released_bn_stats:
                raise ValueError(f"threat.bn={self.bn!r}: the client released no BatchNorm running statistics")
            bn_target = observation.released_bn_stats
        protocol = observation.protocol
        if isinstance(protocol, FedAvg) and self.fedavg == "unknown":
            protocol = None  # the attacker treats the delta as a single gradient step
        return Knowledge(
            labels=observation.side.labels if self.labels == "known" else None,
            bn_mode=self.bn,
            bn_target=bn_target,
            defense_config=observation.defense_config if self.defense == "known" else None,
            protocol=protocol,
        )


@dataclass(frozen=True)
class Knowledge:
    """Facts granted to an attack. ``protocol`` None: FedAvg with unknown hyperparameters."""

    labels: Tensor | None
    bn_mode: str
    bn_target: list[tuple[Tensor, Tensor]] | None
    defense_config: dict | None
    protocol: FedSGD | FedAvg | None


def defense_kinds(config: dict | None) -> list[dict]:
    """The flat list of defense stage configs (a stack expanded), empty when unknown or none."""
    if not config:
        return []
    if config.get("kind") == "stack":
        return [c for member in config["defenses"] for c in defense_kinds(member)]
    return [config]
