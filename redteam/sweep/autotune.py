"""Which points a sweep evaluates, and the setting it chooses: pure functions and a small scheduler.

**Bisection.** An axis whose parameter makes the defense monotonically stronger (``stronger: higher`` or
``lower``) has its points ordered weak -> strong. If certification is monotone along it (a stronger
setting of one defense certifies whenever a weaker one does), the weakest certifying point is found by
bisection over the index in ceil(log2(n + 1)) evaluations instead of n: 4 of 8, 5 of 16. The probes depend
only on earlier verdicts, never on timing, so the evaluated points, and every point's result, are the same
whatever the backend or worker count; axes are bisected side by side, which is where the parallelism is.
An axis marked ``none`` (not monotone) has its whole grid evaluated.

Monotonicity is an assumption, not a guarantee (an attack's optimisation can fail at one setting and
succeed at a stronger one): ``violations`` lists the evaluated pairs that contradict it, and the sweep
warns when there are any; ``autotune: false`` evaluates the full grid.

**Choice.** Among certified points, the least accuracy drop (with autotune, among the points it
evaluated: it assumes that a stronger setting of one defense never costs less accuracy, so that an axis's
weakest certifying point is its best); ties go to the earlier axis, then to the
weaker setting (never to a timing, so that the choice reproduces). ``frontier`` is the per-axis weakest certifying point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Bisection:
    """The weakest certifying index among ``n`` points ordered weak -> strong. ``lo``: the strongest
    index known to fail (-1: none known); ``hi``: the weakest known to certify (``n``: none known)."""

    n: int
    lo: int = -1
    hi: int = -1

    def __post_init__(self) -> None:
        self.hi = self.n if self.hi < 0 else self.hi

    def probe(self) -> int | None:
        """The next index to evaluate, or None when resolved."""
        return (self.lo + self.hi) // 2 if self.hi - self.lo > 1 else None

    def record(self, index: int, certified: bool) -> None:
        if certified:
            self.hi = min(self.hi, index)
        else:
            self.lo = max(self.lo, index)

    @property
    def answer(self) -> int | None:
        """The weakest certifying index once resolved (None: no point of the axis certifies)."""
        return self.hi if self.probe() is None and self.hi < self.n else None


@dataclass
class Scheduler:
    """Hands out the points to evaluate, axis by axis: the whole grid for a full sweep or an axis that
    is not monotone; one bisection probe at a time per monotone axis with ``autotune``."""

    sizes: list[int]
    directions: list[str]
    autotune: bool
    searches: dict[int, Bisection] = field(default_factory=dict)
    issued: set[tuple[int, int]] = field(default_factory=set)
    pending: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        for a, (n, direction) in enumerate(zip(self.sizes, self.directions)):
            if self.autotune and direction != "none":
                self.searches[a] = Bisection(n)

    def ready(self) -> list[tuple[int, int]]:
        """(axis, index) pairs to evaluate now (never one issued before)."""
        out = []
        for a, n in enumerate(self.sizes):
            search = self.searches.get(a)
            if search is None:
                out += [(a, i) for i in range(n) if (a, i) not in self.issued]
            elif not any(p[0] == a for p in self.pending):
                i = search.probe()
                if i is not None and (a, i) not in self.issued:
                    out.append((a, i))
        self.issued.update(out)
        self.pending.update(out)
        return out

    def record(self, axis: int, index: int, certified: bool) -> None:
        self.pending.discard((axis, index))
        if axis in self.searches:
            self.searches[axis].record(index, certified)

    @property
    def done(self) -> bool:
        return not self.pending and not any(s.probe() is not None for s in self.searches.values()) and all(
            (a, i) in self.issued for a, n in enumerate(self.sizes) if a not in self.searches for i in range(n))


def violations(points: list[dict[str, Any]], directions: list[str]) -> list[tuple[dict, dict]]:
    """Evaluated (weaker certified, stronger not certified) pairs on a monotone axis."""
    out = []
    for a, direction in enumerate(directions):
        if direction == "none":
            continue
        row = sorted((p for p in points if p["axis"] == a), key=lambda p: p["index"])
        for i, weak in enumerate(row):
            for strong in row[i + 1:]:
                if weak["certified"] and not strong["certified"]:
                    out.append((weak, strong))
    return out


def frontier(points: list[dict[str, Any]], directions: list[str]) -> dict[int, dict | None]:
    """Per axis, its weakest certifying evaluated point (monotone axes) or its certified point with the
    least accuracy drop (others); None when none certified."""
    out: dict[int, dict | None] = {}
    for a, direction in enumerate(directions):
        ok = [p for p in points if p["axis"] == a and p["certified"]]
        if not ok:
            out[a] = None
        elif direction == "none":
            out[a] = min(ok, key=_cost)
        else:
            out[a] = min(ok, key=lambda p: p["index"])
    return out


def choose(points: list[dict[str, Any]]) -> dict | None:
    """The certified point with the least utility loss (accuracy drop; ties: the earlier axis, the weaker
    setting); None when no point certifies."""
    ok = [p for p in points if p["certified"] and p["axis"] >= 0]
    return min(ok, key=_cost) if ok else None


def _cost(p: dict[str, Any]) -> tuple:
    u = p["utility"]
    return (round(u["accuracy_drop"], 9), p["axis"], p["index"])
