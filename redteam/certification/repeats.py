"""Planned attack runs that repeat another's computation exactly: found here, run once, reported under both names.

An attack declares whose run it repeats (``Capabilities.same_run_as``: iDLG, DLG's) and the labels its
objective holds fixed (``Attack.fixed_labels``). Two plans are candidates (``find_repeats``) when the
repeating plan's attack names the other's, their budgets are equal, their threats are equal apart from
``labels``, and both attack the observation the same way (an honest server's gradient attack, on the
encodings' view of an encoding client, no preparation). On a private batch the repeat is then exact
(``reuse_on``) when both attacks get the same seed and both hold labels fixed that are equal (values,
dtype, shape): the same initial guesses, the same objective, the same optimiser. Only then is the
repeating record built from the other's (``reused_record``): the same reconstruction and metrics, its
own name, threat and label source, ``seconds`` 0 and a ``reused`` entry saying from which job and why.

Decided before any attack runs, from what the certifier holds: the observation and the granted labels.
This compares two computations; it picks no result (no ground truth chooses between runs), and the
reused record is the one the repeating attack would have produced. Anything else (DLG optimising soft
labels jointly, a restored label that differs from the granted one, soft labels of an encoding client,
a check that raises) is not a repeat: that batch's job runs, and reports its own error if it has one.
An attack never drops out of a verdict here: it has a record for every batch.

Not repeats: attacks whose objectives differ (GradInversion's group term and consensus against Inverting
Gradients, even without BatchNorm): a different objective may find a leak the other misses.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from guardfl.config import validate
from guardfl.redteam import attacks as attack_registry
from guardfl.redteam.attacks.analytic.encoded import attack_view
from guardfl.redteam.client.simulate import Observation


@dataclass(frozen=True)
class Repeat:
    """Plan ``plan`` may repeat plan ``of``'s run (decided batch by batch: ``reuse_on``)."""

    plan: int
    of: int


@dataclass(frozen=True)
class Reuse:
    """Plan ``plan``'s run on one batch is plan ``of``'s: ``labels`` is where the repeating attack's labels
    come from (``known`` / ``inferred``), ``reason`` the sentence a certificate carries."""

    plan: int
    of: int
    labels: str
    reason: str


def _gradient_path(cls: type) -> bool:
    """The attack attacks what an honest server observes (the encodings' view of an encoding client),
    without a preparation: the runner's one path whose only per-attack inputs are budget, seed, threat."""
    cap = cls.capabilities
    return cap.server == "honest" and not cap.inverts_encodings and not cap.prepares


def _same_budget(a: Any, b: Any) -> bool:
    """The two plans' budgets validate to the same config (defaults filled in: ``{}`` and the defaults
    written out are one budget)."""
    ca, cb = (attack_registry.ATTACKS[p.name].Config for p in (a, b))
    return ca is cb and validate(ca, a.budget, a.name).model_dump() == validate(cb, b.budget, b.name).model_dump()


def find_repeats(plans: list[Any]) -> list[Repeat]:
    """The pairs of plans (``AttackSection``s: name, budget, threat) where one may repeat the other's run:
    its attack's ``same_run_as`` names the other's, equal budgets (as validated), equal threats apart from ``labels``,
    both on the gradient path. Each plan repeats at most one (the first such)."""
    found = []
    for i, plan in enumerate(plans):
        cls = attack_registry.ATTACKS[plan.name]
        if cls.capabilities.same_run_as is None or not _gradient_path(cls):
            continue
        for j, other in enumerate(plans):
            if j == i or other.name != cls.capabilities.same_run_as:
                continue
            if not _gradient_path(attack_registry.ATTACKS[other.name]) or not _same_budget(plan, other):
                continue
            mine, theirs = plan.threat.as_config(), other.threat.as_config()
            mine.pop("labels"), theirs.pop("labels")
            if mine == theirs:
                found.append(Repeat(i, j))
                break
    return found


def _labels(plan: Any, observation: Observation, aux: Any) -> tuple[torch.Tensor, str] | None:
    """The labels plan's attack holds fixed on ``observation`` as the runner hands it over (the encodings'
    view under a known encoding), None when it optimises them."""
    cls = attack_registry.ATTACKS[plan.name]
    threat = plan.threat.with_aux(aux)
    view = attack_view(observation, threat.defense == "known")
    return cls.fixed_labels(view, threat.knowledge(view))


def reuse_on(repeat: Repeat, plans: list[Any], observation: Observation, aux: Any, seeds: tuple[int, int]) -> Reuse | None:
    """The reuse of plan ``repeat.of``'s run for plan ``repeat.plan`` on ``observation`` when it is an exact
    repeat there (the same ``seeds``, equal fixed labels), else None (that batch runs)."""
    if seeds[0] != seeds[1]:
        return None
    mine, theirs = plans[repeat.plan], plans[repeat.of]
    try:
        a, b = _labels(mine, observation, aux), _labels(theirs, observation, aux)
    except Exception:  # the attack itself will meet (and report) this; nothing is decided here
        return None
    if a is None or b is None:
        return None
    (la, source_a), (lb, source_b) = a, b
    if la.dtype != lb.dtype or la.shape != lb.shape or not torch.equal(la.cpu(), lb.cpu()):
        return None
    reason = (f"repeats {theirs.name}'s run exactly (same budget, seed and threat apart from labels; its {source_a} "
              f"labels are {theirs.name}'s {source_b} ones): computed once")
    return Reuse(repeat.plan, repeat.of, source_a, reason)


def plan_reuse(plans: list[Any], observations: dict[int, Observation], aux: Any,
               seed_of: Callable[[type, int], int]) -> dict[tuple[int, int], Reuse]:
    """(batch, plan index) -> ``Reuse`` for every record that repeats another plan's run on that batch.
    ``seed_of(attack class, batch)``: the seed the runner gives that attack on that batch."""
    out: dict[tuple[int, int], Reuse] = {}
    for repeat in find_repeats(plans):
        cls, other = (attack_registry.ATTACKS[plans[k].name] for k in (repeat.plan, repeat.of))
        for b, observation in observations.items():
            found = reuse_on(repeat, plans, observation, aux, (seed_of(cls, b), seed_of(other, b)))
            if found is not None:
                out[(b, repeat.plan)] = found
    return out


def reused_record(record: dict[str, Any], job: str, plan: Any, reuse: Reuse) -> dict[str, Any]:
    """The repeating plan's record from the record of the run it repeats: the same reconstruction, metrics,
    objective and budget (equal by ``find_repeats``); its own job name, attack, threat and label source;
    no time of its own (``seconds`` 0) and ``reused`` naming the job it comes from and why."""
    out = copy.deepcopy(record)
    out.update(job=job, attack=plan.name, threat=plan.threat.as_config(), seconds=0.0,
               reused={"from": record["job"], "reason": reuse.reason})
    out["info"] = {**out.get("info", {}), "labels": reuse.labels}
    return out


def listing_note(plan_index: int, reuse: dict[tuple[int, int], Reuse], plans: list[Any], batches: int) -> dict[str, Any] | None:
    """What the certificate's ``attacks`` line of plan ``plan_index`` says about reused batches (None: none)."""
    mine = sorted(b for (b, i) in reuse if i == plan_index)
    if not mine:
        return None
    of = plans[reuse[(mine[0], plan_index)].of].name
    ran = batches - len(mine)
    return {"from": of, "batches": mine, "of": batches,
            "note": (f"on {len(mine)} of {batches} batches this run is {of}'s exactly (same budget, seed and threat "
                     f"apart from labels, and the labels it holds fixed equal {of}'s): computed once, reported under both "
                     f"names" + (f"; the other {ran} ran" if ran else ""))}
