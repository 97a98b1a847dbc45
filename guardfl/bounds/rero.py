"""The reconstruction bound of a mechanism over the rounds a client answers, and of a whole defense.

``rero(mechanism, kappa, rounds)``: the bound ``1 - f(kappa)`` of ``rounds * steps_per_round`` compositions
of the mechanism (``guardfl.bounds.accountant``). ``defense_bound(defense, client, kappa)``: the least bound
among the defense's mechanisms (``guardfl.bounds.mechanisms.analyse``), or why there is none, as a
``Bound``. The rounds are the client's budget (``Client.max_rounds``): without one a per-round mechanism
composes without end, and nothing is proven.

>>> from guardfl.bounds.mechanisms import Client
>>> b = defense_bound({"kind": "dpsgd", "noise_multiplier": 2.0}, Client(batch_size=8, max_rounds=4), 0.1)
>>> b.status, round(b.rero, 4)
('COMPUTED', 0.3891)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from scipy.special import ndtri

from guardfl.bounds.accountant import gaussian_pld, pure_dp_pld, rero_from_pld
from guardfl.bounds.checks import check_count, check_kappa
from guardfl.bounds.mechanisms import NO_MECHANISM, NOT_PROVEN, PROVEN, Client, Mechanism, Unbounded, analyse

#: a bound's status when a number was computed (PROVEN or NOT PROVEN once compared with a claim: ``verdict``)
COMPUTED = "COMPUTED"
from guardfl.defenses import DefenseConfig
from guardfl.integrations.budget import MAX_ROUNDS_LIMIT

#: Phi(x) is 1 to double precision beyond this x (1 - Phi(8.3) = 5e-17)
GDP_SATURATES = 8.3
#: a pure-DP step of this epsilon or more: the bound is 1 to double precision (1 - e^-40 rounds to 1)
PURE_EPS_SATURATES = 40.0

#: the assumption every bound states
ASSUMPTION = ("informed adversary (Hayes, Mahloujifar, Balle 2023): it knows the model, the mechanism and its "
              "parameters and every other sample of the client, and sees every update the client sends; the prior's "
              "baseline kappa is its best guess's chance of success without the updates; one reconstruction per "
              "target (an attacker allowed m guesses has a baseline up to m times kappa)")


def rero(mechanism: Mechanism, kappa: float, rounds: int) -> float:
    """The reconstruction bound of ``mechanism`` composed over ``rounds`` rounds (``steps_per_round``
    steps each), for a prior of baseline ``kappa``."""
    kappa = check_kappa(kappa)
    check_count(rounds, "rounds", 1, MAX_ROUNDS_LIMIT)
    steps = rounds * mechanism.steps_per_round
    if mechanism.noise == "gaussian":
        if mechanism.sample_rate == 1.0 and ndtri(kappa) + math.sqrt(steps) / mechanism.noise_multiplier > GDP_SATURATES:
            # full batch: exactly mu-GDP, and Phi(Phi^-1(kappa) + mu) is 1 to double precision (the capped
            # accountant answers 1 too, after building a PLD spanning a privacy loss of mu^2 / 2)
            return 1.0
        return rero_from_pld(gaussian_pld(mechanism.noise_multiplier, mechanism.sample_rate, steps), kappa)
    if mechanism.epsilon >= PURE_EPS_SATURATES:
        return 1.0
    return rero_from_pld(pure_dp_pld(mechanism.epsilon, steps), kappa)


@dataclass(frozen=True)
class Bound:
    """A defense's bound: ``status`` (COMPUTED: a number; NOT PROVEN or NO MECHANISM: none, ``reason`` says
    why; ``verdict`` compares a number with a claim), the bound ``rero`` (None when there is none), the mechanism it comes from, the
    others, and the reason when there is no number."""

    status: str
    rero: float | None
    kappa: float
    rounds: int | None
    steps: int | None
    mechanism: Mechanism | None = None
    others: tuple[Mechanism, ...] = ()
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def defense_bound(defense: DefenseConfig | dict | None, client: Client, kappa: float,
                  rounds: int | None = None) -> Bound:
    """The least bound among ``defense``'s mechanisms for ``client`` over ``rounds`` (default: its
    ``max_rounds``) and a prior of baseline ``kappa``; status COMPUTED (a number), NOT PROVEN or NO MECHANISM
    (with the reason)."""
    kappa = check_kappa(kappa)
    rounds = client.max_rounds if rounds is None else rounds
    found = analyse(defense, client)
    if isinstance(found, Unbounded):
        return Bound(found.status, None, kappa, rounds, None, reason=found.reason)
    if rounds is None:
        return Bound(NOT_PROVEN, None, kappa, None, None, mechanism=found[0], others=tuple(found[1:]),
                     reason="no round budget (client.max_rounds): a server may ask for any number of rounds, each "
                            "spending the mechanism again, so no number of compositions bounds what it learns; set "
                            "client.max_rounds (local_update(..., max_rounds=), flower RoundBudgetMod)")
    scored = sorted(((rero(m, kappa, rounds), i, m) for i, m in enumerate(found)), key=lambda x: (x[0], x[1]))
    value, _, best = scored[0]
    return Bound(COMPUTED, value, kappa, rounds, rounds * best.steps_per_round, mechanism=best,
                 others=tuple(m for _, _, m in scored[1:]))


def verdict(bound: Bound, claim: float) -> tuple[str, str]:
    """(PROVEN, "") when the bound is a number below ``claim`` (a leak rate in (0, 1)); else (NOT PROVEN or
    NO MECHANISM, the reason)."""
    if bound.status != COMPUTED:
        return bound.status, bound.reason
    if bound.rero < claim:
        return PROVEN, ""
    why = f"the bound {bound.rero:.4g} is not below the claimed leak rate {claim:g}"
    if bound.kappa >= claim:
        why += f" (the prior's baseline kappa {bound.kappa:.4g} alone is not: no noise proves less than kappa)"
    return NOT_PROVEN, why


__all__ = ["ASSUMPTION", "Bound", "COMPUTED", "NOT_PROVEN", "NO_MECHANISM", "PROVEN", "defense_bound", "rero", "verdict"]
