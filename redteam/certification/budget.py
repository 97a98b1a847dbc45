"""A run's budget across resumes (``OUT/state/budget.json``): the most updates it attacks, where it
stopped and why, its verdict, and how many more updates would most likely decide its claims. A resume
of a run that ended INCONCLUSIVE when its budget ran out is given more updates (``more``, else the
certificate's estimate); a killed run keeps the budget it had.
"""

from __future__ import annotations

from typing import Any

from guardfl.errors import ConfigError
from guardfl.redteam.certification import evidence, judge
from guardfl.redteam.config import RedTeamConfig
from guardfl.redteam.runtime.files import StateFolder

#: the state file that keeps a run's budget (and where it stopped) across resumes
BUDGET_FILE = "budget.json"


def prepare_budget(cfg: RedTeamConfig, state: StateFolder | None, resume: bool, more: int | None) -> int:
    """The most updates this run attacks: the config's ``certify.max_updates``; a resumed run keeps the
    budget it had, and one that ended INCONCLUSIVE when its budget ran out gets more: ``more``, else the
    updates its certificate said would most likely decide (else as many again as it attacked)."""
    budget = cfg.certify.max_updates
    earlier = state.load_json(BUDGET_FILE) if state is not None and resume else None
    if earlier:
        budget = max(budget, int(earlier["budget"]))
        stop = earlier.get("stop") or {}
        if earlier.get("verdict") == evidence.INCONCLUSIVE and stop.get("reason") in ("budget", "max_seconds"):
            extra = more or earlier.get("more") or max(1, int(stop.get("updates", budget)))
            budget = max(budget, int(stop.get("updates", budget)) + int(extra))
    elif more is not None:
        raise ConfigError("more: only with --resume of a run that ended INCONCLUSIVE (there is no earlier run here)")
    if state is not None:
        state.save_json(BUDGET_FILE, {**(earlier or {}), "budget": budget, "finished": False})
    return min(budget, 100_000)


def save_budget(state: StateFolder | None, budget: int, stop: dict[str, Any], found: dict[str, Any], verdict: str) -> None:
    """Where the run stopped, its verdict and how many more updates would most likely decide its claims
    (what a resume reads)."""
    if state is None:
        return
    more = [((found.get(name) or {}).get("more_updates") or {}).get("more") for name in judge.CLAIMS]
    state.save_json(BUDGET_FILE, {"budget": budget, "finished": True, "stop": stop, "verdict": verdict,
                                  "more": max((m for m in more if m), default=None)})


