"""The threat model: what the attacker (an honest-but-curious server, an eavesdropper, or a malicious
server) knows and may do.

Always known: the global model (architecture and weights) and what the client transmitted. Optionally:
the private labels, BatchNorm statistics (the four settings of Huang et al. 2021, Sec. 3), the defense's
configuration (never its randomness), and the FedAvg local hyperparameters. A malicious server may also
send the client a model of its own making (Wang et al. 2024, Sec. VII: Robbing the Fed, Fishing) and
query it more than once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr
from torch import Tensor

from guardfl.config import StrictModel
from guardfl.defenses import DefenseConfig, parse_config
from guardfl.defenses.stack import StackConfig
from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.auxdata import AuxData, content_hashes
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, bn_layers


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
    server: ``honest`` (follows the protocol: sends the true global model, observes the update) or
        ``malicious`` (may modify the model it sends, its architecture or its parameters, and query the
        client repeatedly within a round: the attacks with ``capabilities.server == "malicious"``).
    public_data: ``known`` (the attacker holds the public set an Inter-InstaHide client mixes its images
        with, as the defense's configuration names it: its partners are identified and subtracted when the
        reconstructed encodings are decoded, ``attacks.demix_public``) or ``unknown`` (encodings decoded as
        |encoding|). Meaningful only for an Inter-InstaHide client with ``defense: known``; never the
        partners, coefficients or sign masks (the defense's randomness).
    aux: auxiliary data the attacker holds (public images, disjoint from the client's): a torch
        ``Dataset`` of (image, label), an ``(images, labels)`` pair of tensors in the client's input range,
        or an ``AuxData`` (which can add OOD images for LTI-OOD). Learned attacks need it. Data, not a
        setting: given in code (``ThreatModel(aux=...)``, ``with_aux``), never dumped, and a config's
        threat (``as_config``, the fields above) has none: a run adds the config's ``aux`` section.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    labels: Literal["known", "inferred"] = Field(default="inferred", json_schema_extra={"allowed": "'known' or 'inferred'"})
    bn: Literal["exact", "proxy", "infer", "none"] = Field(
        default="none", json_schema_extra={"allowed": "'exact', 'proxy', 'infer' or 'none'"}
    )
    defense: Literal["known", "unknown"] = Field(default="known", json_schema_extra={"allowed": "'known' or 'unknown'"})
    fedavg: Literal["known", "unknown"] = Field(default="known", json_schema_extra={"allowed": "'known' or 'unknown'"})
    server: Literal["honest", "malicious"] = Field(default="honest", json_schema_extra={"allowed": "'honest' or 'malicious'"})
    public_data: Literal["known", "unknown"] = Field(default="unknown", json_schema_extra={"allowed": "'known' or 'unknown'"})
    _aux: AuxData | None = PrivateAttr(default=None)

    def __init__(self, aux: Any = None, **fields: Any) -> None:
        super().__init__(**fields)
        self._aux = None if aux is None else AuxData.from_any(aux)

    @property
    def aux(self) -> AuxData | None:
        """The attacker's auxiliary data (None: none)."""
        return self._aux

    def with_aux(self, aux: Any) -> "ThreatModel":
        """This threat with the attacker holding ``aux`` (anything ``ThreatModel(aux=...)`` takes; None: none)."""
        threat = self.model_copy()
        threat._aux = None if aux is None else AuxData.from_any(aux)
        return threat

    def as_config(self) -> dict[str, str]:
        """The threat's settings as a config's ``threat`` section gives them (field order, no ``aux``): what a
        certificate, its state and the config's hash record."""
        return self.model_dump()

    def fingerprint(self) -> dict[str, Any]:
        """The threat as JSON-able data (auxiliary data by its content digest)."""
        return {**self.model_dump(mode="json"), "aux": self.aux.digest() if self.aux is not None else None}

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
        if self.aux is not None and observation.side.input_hashes:
            shared = set(observation.side.input_hashes) & set(content_hashes(self.aux.images, observation.input_range))
            if shared:
                what = modality.get(getattr(observation, "modality", modality.DEFAULT)).unit
                raise ConfigError(f"threat.aux: {len(shared)} auxiliary {what}(s) are private {what}s of this client; the "
                                  "attacker's auxiliary data must be disjoint from the client's")
        protocol = observation.protocol
        if isinstance(protocol, FedAvg) and self.fedavg == "unknown":
            protocol = None  # the attacker treats the delta as a single gradient step
        return Knowledge(
            # the labels the client trained on: soft (mixed) labels for an input encoding
            labels=observation.side.training_labels() if self.labels == "known" else None,
            bn_mode=self.bn,
            bn_target=bn_target,
            defense_config=observation.defense_config if self.defense == "known" else None,
            protocol=protocol,
            aux=self.aux,
        )


@dataclass(frozen=True)
class Knowledge:
    """Facts granted to an attack. ``protocol`` None: FedAvg with unknown hyperparameters."""

    labels: Tensor | None
    bn_mode: str
    bn_target: list[tuple[Tensor, Tensor]] | None
    defense_config: DefenseConfig | None
    protocol: FedSGD | FedAvg | None
    aux: AuxData | None = None

    def to(self, device) -> "Knowledge":
        """The same facts with the granted tensors (labels, BatchNorm statistics) on ``device``, where the
        attack runs (auxiliary data stays where it is: a trained attack streams it)."""
        from dataclasses import replace

        bn = [(m.to(device), v.to(device)) for m, v in self.bn_target] if self.bn_target is not None else None
        return replace(self, labels=self.labels.to(device) if self.labels is not None else None, bn_target=bn)


def unseeded(config: DefenseConfig | None) -> DefenseConfig | None:
    """A defense configuration with every ``seed`` cleared, at any depth (a stack's members included;
    None stays None): what the attacker knows of the defense, never its randomness. The one place seeds
    are cleared: the attacker's simulator builds its defense from it (``augment``), and settings are
    compared with it (``attacks.setting.setting_mismatch``). The caller's configuration is left alone."""
    if config is None:
        return None
    update: dict[str, Any] = {"seed": None}
    if isinstance(config, StackConfig):
        update["defenses"] = [unseeded(member) for member in config.defenses]
    return config.model_copy(update=update)


def defense_kinds(config: DefenseConfig | dict | None) -> list[DefenseConfig]:
    """The leaf defense configs (a stack expanded at every depth), empty when unknown or none. A dict (a
    ``RedTeamConfig.defense`` as its JSON holds it) is parsed; a parsed config is walked as it is."""
    return parse_config(config).leaves() if config else []


def inter_instahide(config: DefenseConfig | dict | None) -> DefenseConfig | None:
    """The Inter-InstaHide leaf of a defense configuration (InstaHide with ``mode: inter``), or None: the
    one defense whose decoding ``threat.public_data`` changes."""
    for leaf in defense_kinds(config):
        if leaf.kind == "instahide" and getattr(leaf, "mode", None) == "inter":
            return leaf
    return None
