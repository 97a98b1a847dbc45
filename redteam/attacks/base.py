"""The one small interface of every attack, its budget config, its capabilities, and shared helpers.

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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
from pydantic import Field
from torch import Tensor, nn

from guardfl.config import StrictModel, validate
from guardfl.errors import GuardflError
from guardfl.redteam.client.simulate import FedAvg, FedSGD, Observation, bn_layers
from guardfl.redteam.runtime.files import atomic_torch_save
from guardfl.redteam.threat import Knowledge, ThreatModel, unseeded

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


@dataclass(frozen=True)
class Setting:
    """What is fixed across the private batches of one certification: the public context of an
    observation without the update itself (the global model, the protocol, the batch geometry, and the
    defense's configuration as transmitted with the client's description)."""

    model: nn.Module
    protocol: FedSGD | FedAvg
    num_samples: int
    input_shape: tuple[int, ...]
    num_classes: int
    input_range: tuple[float, float]
    defense_config: dict | None
    train_mode: bool = True
    modality: str = "image"

    @classmethod
    def of(cls, observation: Observation) -> "Setting":
        return cls(observation.model, observation.protocol, observation.num_samples, tuple(observation.input_shape),
                   observation.num_classes, tuple(observation.input_range), observation.defense_config,
                   getattr(observation, "train_mode", True), getattr(observation, "modality", "image"))

    @property
    def param_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    @cached_property
    def fingerprint(self) -> dict[str, Any]:
        """Everything of the setting a prepared state depends on, as JSON-able data (model weights hashed
        once per Setting: a certification builds one Setting and prepares every attack with it)."""
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in self.model.state_dict().items()}, buf)
        return {
            "model": type(self.model).__qualname__,
            "weights": hashlib.sha256(buf.getvalue()).hexdigest(),
            "protocol": repr(self.protocol),
            "num_samples": self.num_samples,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "input_range": list(self.input_range),
            "defense": self.defense_config,
            "train_mode": self.train_mode,
            **({"modality": self.modality} if self.modality != "image" else {}),
        }


class PreparedCache:
    """Prepared attack states by key (``NAME-KEY``): in memory, and stored on disk under ``folder`` when
    given (atomic files). Another store (the red team's state folder) overrides the two storage hooks,
    ``read`` and ``write``; the memory stays here."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self._memory: dict[str, Any] = {}

    def read(self, entry: str) -> Any | None:
        """Storage hook: the stored state of ``entry`` (``NAME-KEY``), None when none is stored."""
        if self.folder is None or not (self.folder / f"{entry}.pt").is_file():
            return None
        return torch.load(self.folder / f"{entry}.pt", map_location="cpu", weights_only=True)  # tensors and plain data only: loading runs no code

    def write(self, entry: str, state: Any) -> None:
        """Storage hook: store the state of ``entry`` (``NAME-KEY``); nothing without a folder."""
        if self.folder is not None:
            atomic_torch_save(state, self.folder / f"{entry}.pt")

    def load(self, name: str, key: str) -> Any | None:
        entry = f"{name}-{key}"
        if entry in self._memory:
            return self._memory[entry]
        state = self.read(entry)
        if state is not None:
            self._memory[entry] = state
        return state

    def entries(self) -> dict[str, Any]:
        """The states held in memory, by ``NAME-KEY`` (to hand to another process)."""
        return dict(self._memory)

    def adopt(self, entries: dict[str, Any]) -> None:
        """Take states another process prepared (``entries()`` there)."""
        self._memory.update(entries)

    def save(self, name: str, key: str, state: Any) -> None:
        self._memory[f"{name}-{key}"] = state
        self.write(f"{name}-{key}", state)


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


def setting_mismatch(a: Observation, b: Observation) -> str | None:
    """Why ``b`` is not an observation of ``a``'s setting (``Setting``), or None when it is. Compared
    directly, no hashing (cheap for 60 observations of an 11M-parameter model): the protocol, batch
    geometry, input range, defense configuration and train mode, the model's class and its weights and
    buffers by value, the updated layers and their shapes. The defense configurations are compared
    without their ``seed``s: the defense's randomness is never the attacker's to use (``known_defense``
    reads no seed), so clients whose defenses differ only in their seed are one setting to an attack."""
    if a is b:
        return None
    fields = {
        "protocol": (a.protocol, b.protocol),
        "num_samples": (a.num_samples, b.num_samples),
        "input_shape": (tuple(a.input_shape), tuple(b.input_shape)),
        "num_classes": (a.num_classes, b.num_classes),
        "input_range": (tuple(a.input_range), tuple(b.input_range)),
        "defense_config": (unseeded(a.defense_config), unseeded(b.defense_config)),
        "train_mode": (getattr(a, "train_mode", True), getattr(b, "train_mode", True)),
        "modality": (getattr(a, "modality", "image"), getattr(b, "modality", "image")),
        "model class": (type(a.model), type(b.model)),
        "updated layers": ([(k, tuple(v.shape)) for k, v in a.update.items()],
                           [(k, tuple(v.shape)) for k, v in b.update.items()]),
    }
    for name, (x, y) in fields.items():
        if x != y:
            return f"its {name} differs"
    if a.model is not b.model:
        sa, sb = a.model.state_dict(), b.model.state_dict()
        if list(sa) != list(sb) or any(sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k].to(sa[k].device)) for k in sa):
            return "its model's weights or buffers differ"
    return None


def on_device(observations: list[Observation], knowledges: list[Knowledge], device: torch.device,
              ) -> tuple[list[Observation], list[Knowledge]]:
    """Observations of one setting and their knowledge moved to ``device``, the observations sharing one
    copy of the global model (for an attack that batches samples: S deep copies would be wasted)."""
    first = observations[0].to(device)
    moved = [first] + [o.to(device, model=first.model) for o in observations[1:]]
    return moved, [k.to(device) for k in knowledges]


def first_linear(model: nn.Module, names: list[str], layer: str | None = None) -> tuple[str, nn.Linear] | None:
    """(weight name, module) of a model's first ``nn.Linear`` whose weight is among ``names`` (or the one
    named ``layer``); None when there is none."""
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and f"{mod_name}.weight" in names:
            weight = f"{mod_name}.weight" if mod_name else "weight"
            if layer is None or layer == weight:
                return weight, module
    return None


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """float32 that is float32 on CUDA while an attack runs: PyTorch lets cuDNN convolutions (and, where
    enabled, matrix products) use TF32, a 10-bit mantissa, by default. That changes the attack's objective
    by ~1e-3 relative, as much as the flat float32 norm whose error once tilted the input gradient, and a
    weaker attack on a GPU than on a CPU could certify what the CPU run would not. No effect on a CPU; the
    caller's settings are restored afterwards."""
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available here; use 'auto' or 'cpu'")
    return device


def random_inputs(shape: tuple[int, ...], bounds: tuple[float, float], gen: torch.Generator, device: torch.device) -> Tensor:
    lo, hi = bounds
    return (lo + (hi - lo) * torch.rand(shape, generator=gen)).to(device)


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


def progress_bar(enabled: bool, total: int, name: str):
    """A tqdm bar for an attack's inner loop, or None when progress is off."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, leave=False)
