"""The client's round budget: it answers at most ``max_rounds`` FL rounds, whatever model it receives.

A defense that draws fresh noise every round (Gaussian or Laplace noise, clipped or not, Outpost,
GradDefense, DP-SGD) protects one round; a server that sends one model again and averages the updates the
client computed on the same data divides that noise by the square root of the rounds it averaged (the red
team's ``repeats``: through Gaussian noise 0.01 clipped to 1, SEER reads 5 of 64 CIFAR-10 images at 16
rounds and none at 1). The budget is what bounds that: every model counts, so varying the model between
rounds does not reset it, and a server gets no more than ``max_rounds`` looks at the client's data. It is a
property of the client, not of one batch (the leak history's ``max_rounds`` counts rounds per first batch
and only behind a leak limit: a shuffled loader has a new first batch every round).

A round counts when the client sends an update (``ClientState.rounds``, which ``local_update`` advances):
a model refused by the inspection, or a round that failed, sent nothing and spends nothing. The count
lives in the ``ClientState`` the caller keeps between rounds, so the budget needs one: without it every
round would look like the first (``ConfigError``, fail closed). DP-SGD's accountant already turns rounds
into epsilon; the budget is the plain-noise counterpart, and ``guardfl redteam`` certifies a client for
the budget it sets (``client.max_rounds``).
"""

from __future__ import annotations

import json
from pathlib import Path

from guardfl.errors import ConfigError, RoundBudgetError
from guardfl.integrations import statefile

#: the largest round budget accepted (a cross-silo run of a few thousand rounds fits well inside)
MAX_ROUNDS_LIMIT = 1_000_000


def check_max_rounds(max_rounds: int | None, field: str = "max_rounds") -> int | None:
    """``max_rounds`` validated: None (no budget) or an integer in [1, ``MAX_ROUNDS_LIMIT``]; one
    ``ConfigError`` line naming ``field`` otherwise."""
    if max_rounds is None:
        return None
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or not 1 <= max_rounds <= MAX_ROUNDS_LIMIT:
        raise ConfigError(f"{field}: expected None or an integer in [1, {MAX_ROUNDS_LIMIT}] (got {max_rounds!r})")
    return max_rounds


def check_budget_left(max_rounds: int | None, rounds_done: int, field: str = "max_rounds") -> None:
    """Raise ``RoundBudgetError`` when a client that has sent ``rounds_done`` updates has no round left
    of ``max_rounds`` (None: no budget)."""
    if check_max_rounds(max_rounds, field) is not None and rounds_done >= max_rounds:
        raise RoundBudgetError(f"{field}: this client has answered {rounds_done} rounds, its budget of {max_rounds}: it "
                               "answers no more (a server that averages the updates of repeated rounds divides the "
                               "defense's fresh noise by the root of the rounds it holds); raise max_rounds only with a "
                               "certificate for the larger budget")


def _parse_count(data) -> int:
    rounds = data["rounds"]
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
    return rounds


def read_count(path: str | Path) -> int:
    """The rounds counted in a budget file (``{"rounds": n}``; 0 on a first launch: no file and no
    ``<path>.created`` marker). Fails closed (``guardfl.integrations.statefile``): a file that cannot be read,
    holds anything else, or is missing where its marker says it was written is an error naming it, never a
    count of 0 (``StateFileError``, a ``GuardflError``)."""
    counted = statefile.load(Path(path), "budget file", _parse_count)
    return 0 if counted is None else counted


def spent_rounds(counted: int, path: str | Path | None) -> int:
    """The rounds a budget has spent: the larger of the count kept in memory and the one in ``path``
    (None: memory only), so that neither a restart (memory lost) nor an old file undercounts."""
    return max(counted, read_count(path) if path is not None else 0)


def write_count(path: str | Path, rounds: int) -> None:
    """Write the count atomically and durably (a temporary file beside it, fsync, ``os.replace``; the first
    write leaves the ``.created`` marker): a crash leaves the old count or the new one, never half a file."""
    statefile.save(Path(path), json.dumps({"rounds": int(rounds)}))


__all__ = ["MAX_ROUNDS_LIMIT", "check_budget_left", "check_max_rounds", "read_count", "spent_rounds", "write_count"]
