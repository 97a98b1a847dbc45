"""The one small interface of every attack: ``Attack``, its budget config, its capabilities, its answer, its errors.

The lifecycle of an attack (what ``certify`` does, and what a Python user can do by hand):

1. ``cls.applicable(setting, threat)``: from data the class declares (``capabilities``), whether the
   attack can run against this setting at all, and if not, why (a planner filters, it does not catch).
2. ``attack.prepare(setting, threat, cache=...)``: a once-per-setting step (train an inverter, ...)
   reused for every private batch of the same setting. Its result is cached under a key of everything it
   depends on; ``certify`` keeps that cache under ``OUT/state/prepared`` so ``--resume`` never redoes it.
   Attacks without a preparation (the optimisation attacks) do nothing here.
3. ``attack.reconstruct(observation, threat)``: one private batch. An error here is a failure of the run,
   never a silent skip. ``attack.reconstruct_many(observations, threat, seeds)``: several private batches
   of the same setting (each its own client update), one ``Reconstruction`` each, in order; observation
   i's result depends on it and ``seeds[i]`` only. Every attack has it (the default is a loop over
   ``reconstruct``'s path); attacks with ``capabilities.batches_samples`` run a chunk as one batched
   computation, cheaper per sample (a planner chooses the chunk size from that flag).

Budgets: every attack declares its budgets per strength (``budgets["quick"]``: what fits the 2-core
default; ``budgets["paper"]``: the published budget) and ``paper_budget``, a sentence naming the source.

What an attack shares beside the interface has a module each: ``setting`` (``Setting``), ``prepared``
(``PreparedCache``), ``labels`` (restoring labels), ``compute`` (device, float32, initial guesses).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from guardfl.config import StrictModel, validate
from guardfl.errors import GuardflError
from guardfl.redteam.attacks.compute import exact_float32, resolve_device
from guardfl.redteam.attacks.prepared import PreparedCache
from guardfl.redteam.attacks.setting import Setting, first_linear, setting_mismatch
from guardfl.redteam.client.simulate import Observation, bn_layers
from guardfl.redteam.threat import Knowledge, ThreatModel

STRENGTHS = ("quick", "paper")
#: the threat fields an attack may read (``Capabilities.threat``); ``server`` is ``Capabilities.server``
THREAT_FIELDS = ("labels", "bn", "defense", "fedavg", "public_data")
#: the fields a gradient attack reads (the default ``Capabilities.threat``)
GRADIENT_THREAT = frozenset(("labels", "bn", "defense", "fedavg"))
#: read by the honest-server image attacks, whose reconstructions of an input encoding are decoded
#: (``encoded.decode``): ``public_data`` decides whether Inter-InstaHide's public partners are subtracted
DECODING_THREAT = frozenset(("public_data",))


class AttackFailed(GuardflError, RuntimeError):
    """An attack raised while attacking a setting it declared itself applicable to (fails the run)."""


class NotApplicable(GuardflError, ValueError):
    """The attack cannot run against this setting (the reason is the message)."""


@dataclass(frozen=True)
class Capabilities:
    """What an attack applies to, declared as data (torchattacks style) so a planner can filter.

    protocols: the client protocols it attacks. max_samples: the most samples in one observation (None:
    any). needs_aux: it needs auxiliary data in the threat model. prepares: it has a once-per-setting
    ``prepare`` step. max_samples_inferred_labels: with labels inferred rather than granted, the most
    samples it can restore labels for ("classes": one per class; None: any). needs_linear_layer: the
    model must have a linear layer among the updated parameters with at least as many neurons as samples
    (analytic / ICA attacks on a layer's update). batches_samples: ``reconstruct_many`` attacks a chunk of
    observations (private samples of one setting) in one batched computation, cheaper per sample than
    one call each, with each sample's result that of its own call up to float32 reduction order (so a
    planner should hand it chunks of many samples); False: ``reconstruct_many`` is the loop of
    ``reconstruct`` and the chunk size does not matter. server: ``honest`` (attacks what an honest
    server observes) or ``malicious`` (a ``ServerAttack``: sends the client models of its own making,
    needs ``threat.server == "malicious"``). modalities: the inputs it reconstructs, ``image`` (float
    tensors in an input range) and/or ``text`` (token ids of a text model, ``Observation.modality``).
    threat: the threat fields (``ThreatModel``: labels, bn, defense, fedavg, public_data) whose value changes
    what the attack does (default: the gradient attack's four; ``public_data`` only for the attacks whose
    reconstructions of an Inter-InstaHide client are decoded, ``DECODING_THREAT``); a field it does not read, set in a config to other than its default, is refused
    (``ignored_threat``): the certificate records the threat of each attack, and a recorded threat no
    attack acted on is a claim nothing tested. ``server`` is ``server`` above. inverts_encodings: against
    a client that encodes its inputs (MixUp / InstaHide) the attack answers with the PRIVATE images itself
    (learned inversion learns the encoding as augmentation), so it gets the observation as it is, not the
    encodings' view, and its answer is not demixed (``certify``; ``attacks.encoded``).
    same_run_as: the registered attack whose run this one's is, bit for bit, whenever both attack one
    observation with the same budget and seed, the same threat apart from ``labels``, and the same fixed
    labels (``Attack.fixed_labels``, not None for either): iDLG is DLG given the label it restores. A
    planner then runs it once and reports the result under both names (``redteam.repeats``).
    """

    protocols: frozenset[str] = frozenset({"fedsgd", "fedavg"})
    max_samples: int | None = None
    needs_aux: bool = False
    prepares: bool = False
    max_samples_inferred_labels: int | str | None = None
    needs_linear_layer: bool = False
    batches_samples: bool = False
    server: str = "honest"
    modalities: frozenset[str] = frozenset({"image"})
    threat: frozenset[str] = GRADIENT_THREAT
    inverts_encodings: bool = False
    same_run_as: str | None = None


@dataclass
class Reconstruction:
    """An attack's answer: ``inputs`` with the shape and value range of the client's inputs, ``labels``.

    ``objective``: the attack's own final objective for the returned guess (how the winner among restarts
    was chosen: never with the ground truth). ``restart_objectives``: that value for every restart.
    """

    inputs: Tensor
    labels: Tensor
    objective: float
    restart_objectives: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class AttackConfig(StrictModel):
    """Fields every attack has."""

    seed: int | None = Field(default=None, ge=0, json_schema_extra={"allowed": "null (OS entropy) or >= 0"})
    device: str = Field(default="auto", json_schema_extra={"allowed": "'auto', 'cpu', 'cuda' or 'cuda:N'"})
    progress: bool = False


class OptimisationConfig(AttackConfig):
    """Budget fields of the optimisation attacks."""

    iterations: int = Field(default=1000, ge=1, le=1_000_000, json_schema_extra={"allowed": "an integer in [1, 1000000]"})
    restarts: int = Field(default=1, ge=1, le=64, json_schema_extra={"allowed": "an integer in [1, 64]"})


class Attack:
    """Base class: ``applicable`` (class-level, from data), ``prepare`` (once per setting, optional),
    ``reconstruct(observation, threat) -> Reconstruction`` (once per private batch)."""

    name: ClassVar[str]
    Config: ClassVar[type[AttackConfig]]
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: budget per strength; ``quick`` fits the 2-core default, ``paper`` is the published budget
    budgets: ClassVar[dict[str, dict[str, Any]]] = {"quick": {}, "paper": {}}
    #: where the paper budget comes from (shown in certificates)
    paper_budget: ClassVar[str] = ""
    #: threat settings this attack is meant to run with under ``attacks: all`` (e.g. iDLG: labels inferred)
    default_threat: ClassVar[dict[str, str]] = {}

    def __init__(self, **budget: Any) -> None:
        self.config = validate(self.Config, budget, prefix=self.name)
        self._prepared: tuple[str, Any] | None = None

    # -- 1. applicability -------------------------------------------------------------------------------
    @classmethod
    def applicable(cls, setting: Setting, threat: ThreatModel | None = None) -> str | None:
        """None when the attack can run against ``setting`` under ``threat``; else the reason it cannot."""
        threat = threat or ThreatModel()
        cap = cls.capabilities
        if setting.modality not in cap.modalities:
            what = {"text": "a text model (token ids)", "image": "an image model"}.get(setting.modality, setting.modality)
            return f"reconstructs {' and '.join(sorted(cap.modalities))} inputs (this client trains {what})"
        if setting.protocol.name not in cap.protocols:
            return f"attacks {'/'.join(sorted(cap.protocols))} clients only (this one runs {setting.protocol.name})"
        if cap.max_samples is not None and setting.num_samples > cap.max_samples:
            return f"attacks at most {cap.max_samples} samples per update (this client sends {setting.num_samples})"
        if cap.server == "malicious" and threat.server != "malicious":
            return ("a malicious-server attack (the server sends a model of its own making); it runs under "
                    "threat.server: malicious")
        if threat.bn != "none" and not bn_layers(setting.model):
            return f"threat.bn: {threat.bn!r} grants BatchNorm statistics, but the model has no BatchNorm layers; use bn: none"
        if cap.needs_aux and threat.aux is None:
            return "needs auxiliary data in the threat model (an 'aux' section, or ThreatModel(aux=...))"
        if cap.needs_linear_layer:
            found = first_linear(setting.model, setting.param_names)
            if found is None:
                return "needs a linear layer among the updated parameters (the model has none)"
            name, module = found
            if module.out_features < setting.num_samples:
                return (f"layer {name} has {module.out_features} neurons, fewer than the {setting.num_samples} samples "
                        "mixed in its update (ICA needs at least as many mixtures as sources)")
        limit = cap.max_samples_inferred_labels
        if threat.labels == "inferred" and limit is not None:
            most = setting.num_classes if limit == "classes" else int(limit)
            if setting.num_samples > most:
                return (f"restores labels for at most {most} sample(s) with labels='inferred' (this client sends "
                        f"{setting.num_samples}); grant labels='known' to attack this batch")
        return cls._refuses(setting, threat)

    @classmethod
    def ignored_threat(cls, explicit: dict[str, str]) -> str | None:
        """Why the threat fields ``explicit`` (field -> value: those a config sets to other than their
        defaults) claim more than this attack tests, or None: ``server: malicious`` for an honest-server attack (it never sends a model of its
        own), or a field not in ``capabilities.threat`` (the attack never reads it). Checked on the config,
        before any work: a certificate records each attack's threat, so every field of it must have
        changed what that attack did."""
        from guardfl.redteam.attacks.registry import ATTACKS

        cap = cls.capabilities
        if explicit.get("server") == "malicious" and cap.server != "malicious":
            backers = sorted(n for n, a in ATTACKS.items() if a.capabilities.server == "malicious")
            return (f"threat.server: 'malicious', but {cls.name} is an honest-server attack (it never sends the client a "
                    f"model of its own), so the certificate would claim a malicious server nothing tested; attacks that "
                    f"back it: {', '.join(backers)}")
        for field_name in THREAT_FIELDS:
            if field_name in explicit and field_name not in cap.threat:
                backers = sorted(n for n, a in ATTACKS.items() if field_name in a.capabilities.threat)
                return (f"threat.{field_name}: {explicit[field_name]!r}, but {cls.name} never reads threat.{field_name}, "
                        f"so the certificate would record a threat it did not test; remove it, or use an attack that "
                        f"reads it: {', '.join(backers)}")
        return None

    @classmethod
    def ignored_options(cls, budget: dict[str, Any], threat: Any) -> str | None:
        """Why a budget option set in ``budget`` (the config's, explicit) has no effect under ``threat``
        (e.g. a BatchNorm prior's weight when the threat grants no BatchNorm statistics), or None. Options
        that another option of the same budget switches off are the ``Config``'s own validator's."""
        return None

    @classmethod
    def _refuses(cls, setting: Setting, threat: ThreatModel) -> str | None:
        """What an attack needs beyond its declared ``capabilities`` (checked after them): the reason it
        cannot run, or None. Attacks with such needs override this, not ``applicable``."""
        return None

    @classmethod
    def fixed_labels(cls, observation: Observation, knowledge: Knowledge) -> tuple[Tensor, str] | None:
        """The labels this attack's objective holds fixed on ``observation`` and where they come from
        (``known`` or ``inferred``), or None when it optimises them or does not say (the default): what a
        planner compares to find an attack repeating another's run (``Capabilities.same_run_as``)."""
        return None

    def refuses(self, setting: Setting) -> str | None:
        """What this attack's budget (``config``) cannot do against ``setting``, or None: an option out of
        the setting's range, or a memory need past a bound. A planner asks it after ``applicable``,
        before any work."""
        return None

    @classmethod
    def budget_for(cls, strength: str) -> dict[str, Any]:
        if strength not in STRENGTHS:
            raise ValueError(f"strength: {strength!r}; allowed: {', '.join(STRENGTHS)}")
        return dict(cls.budgets.get(strength, {}))

    # -- 2. preparation ---------------------------------------------------------------------------------
    def preparation_key(self, setting: Setting, threat: ThreatModel) -> str:
        """A hash of everything a prepared state depends on: the setting, the threat (aux data identity
        included) and the budget (device and progress excluded)."""
        payload = {
            "attack": self.name,
            "setting": setting.fingerprint,
            "threat": threat.fingerprint(),
            "budget": self.config.model_dump(mode="json", exclude={"device", "progress"}),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]

    def prepare(self, setting: Setting, threat: ThreatModel | None = None, *, cache: PreparedCache | None = None,
                on_done: Callable[[dict], None] | None = None) -> Any:
        """Run (or load from ``cache``) the once-per-setting preparation; a no-op for attacks without one.
        ``on_done`` receives ``{"key", "cached", "seconds", **info}``."""
        if not self.capabilities.prepares:
            return None
        threat = threat or ThreatModel()
        reason = self.applicable(setting, threat)
        if reason is not None:
            raise NotApplicable(f"{self.name}: {reason}")
        key = self.preparation_key(setting, threat)
        if self._prepared is not None and self._prepared[0] == key:
            return self._prepared[1]
        t0 = time.time()
        state = cache.load(self.name, key) if cache is not None else None
        cached = state is not None
        if state is None:
            device = resolve_device(self.config.device)
            with exact_float32():
                state = self._prepare(setting, threat, device, self._generator())
            if cache is not None:
                cache.save(self.name, key, state)
        self._prepared = (key, state)
        if on_done is not None:
            on_done({"key": key, "cached": cached, "seconds": time.time() - t0, **self.preparation_info(state)})
        return state

    def _prepare(self, setting: Setting, threat: ThreatModel, device: torch.device, gen: torch.Generator) -> Any:
        raise NotImplementedError

    def preparation_info(self, state: Any) -> dict[str, Any]:
        """What a report should say about a prepared state (JSON-able)."""
        return {}

    # -- 3. reconstruction ------------------------------------------------------------------------------
    def reconstruct(self, observation: Observation, threat: ThreatModel | None = None) -> Reconstruction:
        """One private batch, with the attack's ``config.seed`` (OS entropy when None)."""
        return self.reconstruct_many([observation], threat, [self.config.seed])[0]

    def reconstruct_many(self, observations: list[Observation], threat: ThreatModel | None = None,
                         seeds: list[int | None] | None = None) -> list[Reconstruction]:
        """One ``Reconstruction`` per observation, in order. Every observation is one private client update
        of the same setting (the same model and weights, protocol, batch geometry and defense
        configuration: ``setting_mismatch``; else ``ValueError``). ``seeds[i]`` seeds observation i's
        randomness (initial guesses, restarts); None (or ``seeds`` None): ``config.seed``, OS entropy when
        that is None. Observation i's result depends on it and ``seeds[i]`` only, never on the other
        observations of the call: exactly for the loop (the default, ``_reconstruct_many``), up to
        float32 reduction order for attacks that batch samples (``capabilities.batches_samples``); a
        chunk of one is exactly ``reconstruct`` with that seed."""
        threat = threat or ThreatModel()
        observations = list(observations)
        seeds = [None] * len(observations) if seeds is None else list(seeds)
        if len(seeds) != len(observations):
            raise ValueError(f"{self.name}.reconstruct_many: {len(seeds)} seeds for {len(observations)} observations")
        if not observations:
            return []
        for i, other in enumerate(observations[1:], 1):
            why = setting_mismatch(observations[0], other)
            if why is not None:
                raise ValueError(f"{self.name}.reconstruct_many: observation {i} is not of observation 0's setting "
                                 f"({why}); attack observations of different settings in separate calls")
        knowledges = [threat.knowledge(o) for o in observations]
        setting = Setting.of(observations[0])
        reason = self.applicable(setting, threat)
        if reason is not None:
            raise NotApplicable(f"{self.name}: {reason}")
        for observation, knowledge in zip(observations, knowledges):
            self.check(observation, knowledge)
        if self.capabilities.prepares:
            self.prepare(setting, threat)
        device = resolve_device(self.config.device)
        gens = [self._generator(seed) for seed in seeds]
        with exact_float32():
            return self._reconstruct_many(observations, knowledges, device, gens)

    def _reconstruct_many(self, observations: list[Observation], knowledges: list[Knowledge], device: torch.device,
                          gens: list[torch.Generator]) -> list[Reconstruction]:
        """The checked observations (still where the caller has them) with their knowledge and generators:
        by default one ``_reconstruct`` each, moved to ``device`` one at a time (``reconstruct``'s path).
        Attacks that batch samples override this."""
        return [self._reconstruct(o.to(device), k.to(device), device, g) for o, k, g in zip(observations, knowledges, gens)]

    def _generator(self, seed: int | None = None) -> torch.Generator:
        """A CPU generator seeded with ``seed``, else ``config.seed``, else OS entropy."""
        if seed is None:
            seed = self.config.seed
        return torch.Generator(device="cpu").manual_seed(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        )

    def check(self, observation: Observation, knowledge: Knowledge) -> None:
        """Refuse an observation the declared capabilities do not cover (raise ``NotApplicable``)."""

    def _reconstruct(self, observation: Observation, knowledge: Knowledge, device: torch.device, gen: torch.Generator) -> Reconstruction:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.model_dump(exclude_defaults=True)})"
