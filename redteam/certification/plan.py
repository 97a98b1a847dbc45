"""The plan of a run: its strength, the attacks that run (and why the others do not), the jobs they make,
and the bounds on workers and threads.

Every registered attack is listed in the certificate: ran, or not applicable with the reason. ``attacks``
(name -> attack class) is the registry unless a caller injects another mapping.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from pydantic import ValidationError

from guardfl.config import format_validation_error
from guardfl.errors import ConfigError
from guardfl.redteam import attacks as attack_registry
from guardfl.redteam import modality
from guardfl.redteam.attacks.base import THREAT_FIELDS, Setting
from guardfl.redteam.auxdata import AuxData
from guardfl.redteam.client.simulate import bn_layers
from guardfl.redteam.config import AttackSection, RedTeamConfig
from guardfl.redteam.runtime.workers import Job, available_cores
from guardfl.redteam.threat import ThreatModel, inter_instahide


def resolve_strength(strength: str, device: torch.device) -> str:
    """'auto' is 'paper' on a GPU and 'quick' on a CPU."""
    if strength == "auto":
        return "paper" if device.type == "cuda" else "quick"
    if strength not in ("quick", "paper"):
        raise ConfigError(f"strength: {strength!r}; allowed: 'auto', 'quick' or 'paper'")
    return strength


def plan_attacks(cfg: RedTeamConfig, setting: Setting, strength: str, aux: AuxData | None,
                 attacks: Mapping[str, type] | None = None) -> tuple[list[AttackSection], list[dict[str, Any]]]:
    """The attacks to run, and a line for every registered attack (the certificate's ``attacks``).

    ``attacks: all``: every registered attack, at the strongest threat (labels known, except a causal
    LM's, which are the private text itself: inferred; the defense's configuration known, BN statistics
    exact when the model has BatchNorm, FedAvg hyperparameters known, Inter-InstaHide's public set known,
    the auxiliary data when there is some) adjusted by the attack's own ``default_threat`` (iDLG restores
    labels), with its budget for ``strength``; those that do not apply are listed with the reason.
    Configured attacks: their threat and budget (over the strength's budget); one that does not apply to
    this setting is a config error. ``attacks``: name -> attack class (default: the registry)."""
    attacks = attack_registry.ATTACKS if attacks is None else attacks
    listing: list[dict[str, Any]] = []
    plans: list[AttackSection] = []
    if cfg.attacks is None:
        # a causal LM's labels are its next tokens, i.e. the private text: granting them grants the answer
        text_is_label = modality.of(setting).targets_are_inputs(setting.model)
        strongest = ThreatModel(labels="inferred" if text_is_label else "known",
                                bn="exact" if bn_layers(setting.model) else "none", defense="known", fedavg="known",
                                public_data="known" if inter_instahide(setting.defense_config) else "unknown")
        # a field the attack never reads stays at its default: the certificate records what it tested
        candidates = [(name, {}, strongest.model_copy(update={**{k: ThreatModel.model_fields[k].default for k in
                                                                 THREAT_FIELDS if k not in cls.capabilities.threat},
                                                              **cls.default_threat}))
                      for name, cls in sorted(attacks.items())]
    else:
        candidates = [(a.name, a.budget, a.threat) for a in cfg.attacks]
    for i, (name, overrides, threat) in enumerate(candidates):
        cls = attacks[name]
        budget = {**cls.budget_for(strength), **overrides}
        reason = cls.applicable(setting, threat.with_aux(aux)) or cls(**budget).refuses(setting)
        if reason is None and cfg.target is not None and cls.capabilities.server == "malicious":
            reason = ("sends the client a model of its own making, which needs the simulated client; a "
                      "target (your ClientApp / train_fn) cannot be queried that way yet")
        line = {"attack": name, "threat": threat.as_config(), "budget": budget, "strength": strength,
                "paper_budget": cls.budget_for("paper"), "paper_reference": cls.paper_budget}
        if reason is not None:
            if cfg.attacks is not None:
                raise ConfigError(f"attacks[{i}] {name}: not applicable to this client: {reason}")
            line.update(status="not applicable", reason=reason)
        else:
            line.update(status="ran")
            plans.append(AttackSection(name=name, budget=budget, threat=threat))
        listing.append(line)
    for name in sorted(attacks):
        if not any(line["attack"] == name for line in listing):
            listing.append({"attack": name, "status": "not requested", "reason": "not in the config's attacks list"})
    return plans, listing

def with_samples(cfg: RedTeamConfig, samples: int | None) -> tuple[RedTeamConfig, list[str]]:
    """``cfg`` attacking at most about ``samples`` private samples (``certify.max_updates = ceil(samples /
    n)``: a budget, as ``certify.max_samples``), and the warning the certificate then carries; ``cfg``
    unchanged for None."""
    if samples is None:
        return cfg, []
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ConfigError(f"samples: expected an integer >= 1 (got {samples!r})")
    configured = cfg.certify.max_updates * cfg.client.n
    updates = -(-samples // cfg.client.n)
    certify = cfg.certify.model_copy()
    try:
        type(certify).__pydantic_validator__.validate_assignment(certify, "max_updates", updates)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "config.certify", type(certify))) from None
    smaller = "a smaller budget than the config's" if updates * cfg.client.n < configured else "not the config's budget"
    return cfg.model_copy(update={"certify": certify}), [
        f"the budget was set on the command line (--samples {samples}: at most {updates * cfg.client.n} samples; the "
        f"config allows {configured}): {smaller}"]


#: private batches per job for attacks that reconstruct many client updates in one batched optimisation
#: (``Capabilities.batches_samples``); fixed, so that the results do not depend on the worker count
CHUNK = 16


def plan_jobs(plans: list[AttackSection], batches: int | range, attacks: Mapping[str, type] | None = None) -> list[Job]:
    """One job per (chunk of private batches, attack) for the batches ``batches`` (a count from 0, or a
    round's range): chunks of ``CHUNK`` consecutive batches of the range for the attacks that batch samples
    natively, single batches for the others."""
    attacks = attack_registry.ATTACKS if attacks is None else attacks
    span = range(batches) if isinstance(batches, int) else batches
    jobs = []
    for i, plan in enumerate(plans):
        cls = attacks[plan.name]
        size = CHUNK if cls.capabilities.batches_samples else 1
        for lo in range(span.start, span.stop, size):
            bs = tuple(range(lo, min(span.stop, lo + size)))
            label = f"b{bs[0]}" if len(bs) == 1 else f"b{bs[0]}-{bs[-1]}"
            jobs.append(Job(f"{label}-{i}-{plan.name}", bs, i, cls.capabilities.prepares))
    return jobs


#: intra-op threads per job (and worker processes) at most this many per core available to the process:
#: more only oversubscribes the cores (and thousands of threads can exhaust the process's thread limit)
THREADS_PER_CORE = 4


def max_threads() -> int:
    """The most ``threads`` (per job) and ``workers`` a run accepts: ``THREADS_PER_CORE`` x the cores
    available to this process."""
    return THREADS_PER_CORE * available_cores()


def round_ends(budget: int, milestones: tuple[int, ...] = ()) -> list[int]:
    """Where the sequential rule's rounds end (update counts), up to ``budget``: after 4, 8, 16 and 32
    updates, then every ``CHUNK``: short rounds first (a leaking client is refuted within a few updates),
    chunks of the batched attacks' size later; and at each of ``milestones`` (the fewest leak-free updates
    that certify each claim: a clean deployment stops there, not at the next round's end). Fixed by the
    config alone, never by workers or timing, so a run and its resume attack the same rounds."""
    ends = {e for e in (4, 8, 16, 32) if e < budget} | {m for m in milestones if 0 < m < budget}
    e = 32 + CHUNK
    while e < budget:
        ends.add(e)
        e += CHUNK
    return sorted(ends) + [budget]


def record_name(b: int, i: int, plan: AttackSection) -> str:
    """The state (and report) name of one private batch's result under plan i."""
    return f"b{b}-{i}-{plan.name}"



def check_workers_threads(workers: Any, threads: Any) -> None:
    """``workers`` (None: the default) and ``threads`` (None: the default) as ``certify`` accepts them:
    integers >= 1, at most ``max_threads()``; else a ConfigError of one line."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"workers: expected an integer >= 1 (got {workers!r})")
    if threads is not None and (not isinstance(threads, int) or not 1 <= threads <= max_threads()):
        raise ConfigError(f"threads: expected an integer in [1, {max_threads()}] ({THREADS_PER_CORE} x the "
                          f"{available_cores()} cores available) (got {threads!r})")
    if workers is not None and workers > max_threads():
        raise ConfigError(f"workers: expected an integer in [1, {max_threads()}] ({THREADS_PER_CORE} x the "
                          f"{available_cores()} cores available) (got {workers!r})")
