"""The red-team configuration (YAML, validated by pydantic; unknown keys are errors): its sections
(``config_sections``) combined, the checks across them, its hash, and ``load_config``."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from guardfl.config import StrictModel, validate
from guardfl.defenses.registry import parse_config
from guardfl.errors import ConfigError
from guardfl.redteam import modality
from guardfl.redteam.config_sections import (AttackSection, AuxSection, CertifySection, ClientSection, DataSection,
                                             ModelSection, TargetSection)
from guardfl.redteam.threat import ThreatModel, inter_instahide
from guardfl.yamlio import load_yaml


def _public_data_refused(threat: ThreatModel, defense: dict | None) -> str | None:
    """Why ``threat.public_data: known`` tests nothing here, or None: it needs an Inter-InstaHide client (the
    public set is the one its configuration names) and the defense's configuration known."""
    if inter_instahide(defense) is None:
        return ("threat.public_data: 'known', but the client's defense has no Inter-InstaHide (instahide with mode: "
                "inter), so there is no public set to know: remove it, or use defense: {kind: instahide, mode: inter, "
                "public: PATH.npz}")
    if threat.defense != "known":
        return ("threat.public_data: 'known' needs threat.defense: 'known' (the public set is the one the defense's "
                "configuration names, and without it the encodings are not decoded): remove one of them")
    return None


class RedTeamConfig(StrictModel):
    #: the client's model (a built-in name or your own factory)
    model: ModelSection = Field(default_factory=ModelSection)
    #: the client's private data: the population the certificate speaks for
    data: DataSection = Field(default_factory=DataSection)
    #: what the client does each round: protocol, batch, local training, inspection, round budget
    client: ClientSection = Field(default_factory=ClientSection)
    #: the defense: applied to the simulated client; with a ``target``, the defense the client runs
    #: (what the attacker knows), not applied by the red team
    defense: dict[str, Any] | None = None
    #: certify the user's own client code instead of simulating one
    target: TargetSection | None = None
    #: the attacks to run; null (or "all" in YAML) = every attack applicable to the setting
    attacks: list[AttackSection] | None = None
    #: the claims, the thresholds past which a sample leaks, the confidence and the budget
    certify: CertifySection = Field(default_factory=CertifySection)
    #: the attacker's auxiliary data (learned attacks such as learned_inversion need it)
    aux: AuxSection | None = None
    #: attack budgets: 'quick' (fits 2 CPU cores), 'paper' (the published budgets), 'auto' (paper on a GPU)
    strength: Literal["auto", "quick", "paper"] = Field(default="auto", json_schema_extra={"allowed": "'auto', 'quick' or 'paper'"})
    #: seeds the draw of the private updates from the population and the attacks (the client's defense draws its own
    #: randomness, as deployed, unless the defense sets a seed)
    seed: int = Field(default=0, ge=0, le=2**32 - 1, json_schema_extra={"allowed": "an integer in [0, 2**32 - 1]"})
    #: where the attacks run; 'auto': CUDA when available (overridden by --device)
    device: str = Field(default="auto", json_schema_extra={"allowed": "'auto', 'cpu', 'cuda' or 'cuda:N'"})

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
            raise ValueError(f"unknown device {device!r}; allowed: 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return device

    @field_validator("defense", mode="before")
    @classmethod
    def _defense(cls, value: Any) -> Any:
        if value is None:
            return None
        try:
            return parse_config(value).model_dump(mode="json")
        except ConfigError as err:
            raise ValueError(str(err)) from None

    @field_validator("attacks", mode="before")
    @classmethod
    def _attack_shorthand(cls, value: Any) -> Any:
        if value == "all":
            return None
        if isinstance(value, (list, tuple)) and not value:  # ran nothing and exited 1 ("no attack could run")
            raise ValueError("give at least one attack, or 'all'; allowed: a non-empty list of attack names, 'all' or null")
        if isinstance(value, list):  # "- dlg" is shorthand for "- {name: dlg}"
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="after")
    def _a_threshold_of_its_modality(self) -> "RedTeamConfig":
        """A threshold of the data's own modality (an image client with only text thresholds would judge
        nothing: every sample would pass, and a claim would certify vacuously)."""
        fields = [name for name, _ in modality.for_source(self.data.source).thresholds.values()]
        if self.certify.max_label_acc is None and all(getattr(self.certify, f) is None for f in fields):
            kind = modality.for_source(self.data.source).name
            raise ValueError(f"certify: no threshold of this {kind} client is set; allowed: at least one of "
                             f"{', '.join(fields + ['max_label_acc'])}")
        return self

    @model_validator(mode="after")
    def _budget(self) -> "RedTeamConfig":
        """``certify.max_updates`` resolved: from ``max_samples`` (``ceil(max_samples / client.n)``, the smaller
        when both are set), else twice the fewest leak-free updates that certify the strictest claim
        (``sequential.zero_leak_updates``): the resolved number is what the certificate shows."""
        c = self.certify
        budget = c.max_updates
        if c.max_samples is not None:
            from_samples = -(-c.max_samples // self.client.n)
            budget = from_samples if budget is None else min(budget, from_samples)
        if budget is None:
            from guardfl.redteam.certification.sequential import zero_leak_updates

            claims = [r for r in (c.max_leak_rate, c.max_reid_rate) if r is not None]
            budget = min(100_000, 2 * (zero_leak_updates(min(claims), 1 - c.confidence) or 50_000))
        if budget != c.max_updates:
            object.__setattr__(self, "certify", c.model_copy(update={"max_updates": budget}))  # frozen: once, here
        return self

    @model_validator(mode="after")
    def _dp_trains_in_train_mode(self) -> "RedTeamConfig":
        """A simulated client with DP-SGD trains in train mode (Opacus computes per-sample gradients only
        there; ``client_round`` refuses the pair): refused here, before any work."""
        if self.target is None and not self.client.train_mode and self.defense is not None:
            if any(leaf.kind == "dpsgd" for leaf in parse_config(self.defense).leaves()):
                raise ValueError("client.train_mode: false (an eval-mode client) cannot run dpsgd, which trains in train "
                                 "mode only (Opacus); allowed with dpsgd: true")
        return self

    @property
    def modality(self) -> str:
        """The name of the private data's modality (``text``: token ids; ``image``): ``modality.SOURCES``."""
        return modality.for_source(self.data.source).name

    @model_validator(mode="after")
    def _modality_match(self) -> "RedTeamConfig":
        """A built-in model, the data and the auxiliary data must be of one modality."""
        kind, name = modality.for_source(self.data.source), self.model.name
        if ":" not in name and modality.for_model(name) is not kind:
            text_models = ", ".join(sorted(modality.get("text").models))
            raise ValueError(f"model.name: {name} is {modality.for_model(name).model_kind}, but data.source "
                             f"{self.data.source!r} is {kind.noun}; text models: {text_models}")
        if self.aux is not None and self.aux.source is not None and modality.for_source(self.aux.source) is not kind:
            raise ValueError(f"aux.source: {self.aux.source!r} is {modality.for_source(self.aux.source).noun} but the "
                             f"client's data is {kind.noun}")
        if not kind.ood and self.aux is not None and self.aux.ood is not None:
            raise ValueError("aux.ood: OOD pseudo-data (LTI-OOD's DCT images) is for images; remove it for a "
                             f"{kind.name} client")
        if not kind.targets and self.target is not None:
            raise ValueError(f"target: certifying the user's own client code is for image models yet; simulate the {kind.name} "
                             "client (remove the target section)")
        return self

    @model_validator(mode="after")
    def _text_bounded(self) -> "RedTeamConfig":
        """A text file (or folder) named by data.path / aux.path is bounded by its size before anything
        reads it (hashing it for the resume key included): ``textdata.MAX_TEXT_BYTES``."""
        modality.for_source(self.data.source).check_path(self.data.path, "data.path")
        if self.aux is not None and self.aux.source is not None:
            modality.for_source(self.aux.source).check_path(self.aux.path, "aux.path")
        return self

    @model_validator(mode="after")
    def _claims_tested(self) -> "RedTeamConfig":
        """Every threat a configured attack runs under must change what that attack does: the certificate
        records it as tested. Refused: ``server: malicious`` on an honest-server attack, a threat field
        the attack never reads set to other than its default (``Attack.ignored_threat``), a budget option
        the threat makes the attack ignore (``Attack.ignored_options``), and ``fedavg: unknown`` for a
        FedSGD client (it has no local hyperparameters to hide). Default values are never refused (a dumped
        config reloads). Checked here, before any work."""
        from guardfl.redteam.attacks import ATTACKS

        defaults = ThreatModel()
        for i, a in enumerate(self.attacks or []):
            cls = ATTACKS[a.name]
            set_fields = {k: getattr(a.threat, k) for k in ThreatModel.model_fields
                          if getattr(a.threat, k) != getattr(defaults, k)}
            why = cls.ignored_threat(set_fields) or cls.ignored_options(a.budget, a.threat)
            if why is None and a.threat.fedavg != defaults.fedavg and self.client.protocol == "fedsgd":
                why = (f"threat.fedavg: {a.threat.fedavg!r}, but client.protocol is 'fedsgd' (no local hyperparameters "
                       "to know or not): remove it, or set client.protocol: fedavg")
            if why is None and a.threat.public_data != defaults.public_data:
                why = _public_data_refused(a.threat, self.defense)
            if why is not None:
                raise ValueError(f"attacks[{i}] {a.name}: {why}")
        return self

    @model_validator(mode="after")
    def _inspection_tested(self) -> "RedTeamConfig":
        """``client.inspect`` changes only what a malicious server's model meets: it needs an image
        classifier, a simulated client, and at least one attack under ``threat.server: malicious``."""
        if not self.client.inspect:
            return self
        if not modality.of(self).inspection:
            raise ValueError("client.inspect: the inspection checks image classifiers (class labels); remove it for a "
                             f"{self.modality} client")
        if self.target is not None:
            raise ValueError("client.inspect: a target's own code decides whether it inspects (guardfl_flower.train("
                             "..., inspect=True)); remove client.inspect")
        if not any(a.threat.server == "malicious" for a in self.attacks or []):
            raise ValueError("client.inspect: true, but no attack runs as a malicious server (threat: {server: malicious}), "
                             "so nothing would test the inspection: add robbing_the_fed, trap_weights or fishing under it")
        return self

    @model_validator(mode="after")
    def _target_protocol(self) -> "RedTeamConfig":
        if self.target is None:
            return self
        if self.client.protocol != "fedavg":
            raise ValueError("client.protocol: a target returns trained weights, so it is 'fedavg' (set the client's lr, "
                             "epochs, batch_size, momentum, weight_decay as it trains)")
        if (self.target.clientapp is not None or self.target.nvflare is not None) and "data" in self.model_fields_set:
            raise ValueError("data: a target.clientapp / target.nvflare loads its own private data; remove the data section "
                             "(choose the client's data with target.node_config / run_config)")
        return self

    def digest(self, strength: str | None = None) -> str:
        """A hash of the settings that determine the results (resume refuses a different config);
        ``strength``: the resolved strength (an 'auto' config resolves by device)."""
        payload = self.model_dump(mode="json", exclude={"device": True, "certify": {f: True for f in BUDGET_FIELDS}})
        payload["strength"] = strength or self.strength
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


#: the sequential rule's budget (``certify``): how far a run may go, never what one update's attack gives; left
#: out of the config's hash, so that ``--resume`` can give a run more updates or time
BUDGET_FIELDS = ("max_updates", "max_samples", "max_seconds")


def load_config(source: str | Path | dict) -> RedTeamConfig:
    """Read and validate a red-team config (a YAML path or a dict); ConfigError with one line otherwise."""
    if isinstance(source, dict):
        data = source
    else:
        data = load_yaml(source)  # duplicate keys, alias bombs, deep nesting, non-UTF-8, empty: one line
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    return validate(RedTeamConfig, data, prefix="config")
