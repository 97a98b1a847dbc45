"""The sweep's scheduler and choice (``guardfl.redteam.sweep.autotune``, issue 17): bisection finds the weakest
certifying setting of a monotone axis in ceil(log2(n + 1)) evaluations, the full grid issues every point
once, the evaluated points never depend on the order results come back in, and the choice is the
certified point with the least accuracy drop (ties: earlier axis, weaker setting)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from guardfl.redteam.sweep.autotune import Bisection, Scheduler, choose, frontier, violations


def record(axis, index, certified, drop=None, value=None):
    """A sweep record as ``sweep`` builds them (what frontier / choose / violations read)."""
    return {"id": f"a{axis}-v{index}" if axis >= 0 else "baseline", "axis": axis, "index": index,
            "value": index if value is None else value, "certified": certified,
            "utility": {"accuracy_drop": index / 100 if drop is None else drop}}


def drive(scheduler, oracles, pick=None):
    """Run ``scheduler`` to completion: ``oracles[axis](index)`` is the verdict. ``pick(pending)``: which
    pending point completes next (default: all of a batch in the order issued). Returns the records in
    evaluation order and checks the scheduler's invariants on the way."""
    records, pending = [], []
    for _ in range(10_000):
        new = scheduler.ready()
        assert not set(new) & {(r["axis"], r["index"]) for r in records}, "ready() re-issued an evaluated point"
        assert not set(new) & set(pending), "ready() re-issued a pending point"
        pending += new
        for a in scheduler.searches:
            assert sum(1 for p in pending if p[0] == a) <= 1, f"axis {a} has several probes pending"
        if not pending:
            break
        k = 0 if pick is None else pick(pending)
        a, i = pending.pop(k)
        ok = oracles[a](i)
        scheduler.record(a, i, ok)
        records.append(record(a, i, ok))
    assert scheduler.done and not pending
    return records


def threshold(t):
    return lambda i: i >= t


@given(n=st.integers(1, 64), data=st.data())
def test_bisection_finds_the_weakest_certifying_index_in_log_evaluations(n, data):
    t = data.draw(st.integers(0, n), label="t")
    s = Scheduler([n], ["higher"], autotune=True)
    records = drive(s, [threshold(t)])
    assert len(records) <= math.ceil(math.log2(n + 1))
    assert len({(r["axis"], r["index"]) for r in records}) == len(records)
    assert s.searches[0].answer == (None if t == n else t)
    best = choose(records)
    edge = frontier(records, ["higher"])[0]
    if t == n:
        assert best is None and edge is None
    else:
        assert best["index"] == t and edge["index"] == t
    assert violations(records, ["higher"]) == []


def test_bisection_alone():
    b = Bisection(8)
    assert (b.lo, b.hi, b.probe(), b.answer) == (-1, 8, 3, None)
    b.record(3, False)
    assert b.probe() == 5
    b.record(5, True)
    assert b.probe() == 4
    b.record(4, True)
    assert b.probe() is None and b.answer == 4
    none = Bisection(1)
    none.record(0, False)
    assert none.probe() is None and none.answer is None


@pytest.mark.parametrize("autotune, direction", [(False, "higher"), (False, "lower"), (True, "none"), (False, "none")])
def test_full_grid_issues_every_index_exactly_once(autotune, direction):
    s = Scheduler([5], [direction], autotune=autotune)
    assert s.searches == {}
    first = s.ready()
    assert first == [(0, i) for i in range(5)]
    assert s.ready() == [] and not s.done
    for i in (4, 0, 2):
        s.record(0, i, i % 2 == 0)
    assert s.ready() == [] and not s.done
    s.record(0, 1, False)
    s.record(0, 3, True)
    assert s.done and s.ready() == []


def test_several_axes_side_by_side():
    # axis 0 bisected, axis 1 (not monotone) fully evaluated, axis 2 bisected: all start at once
    first = Scheduler([8, 3, 4], ["higher", "none", "lower"], autotune=True).ready()
    assert sorted(first) == [(0, 3), (1, 0), (1, 1), (1, 2), (2, 1)]
    s = Scheduler([8, 3, 4], ["higher", "none", "lower"], autotune=True)
    records = drive(s, [threshold(6), lambda i: i == 1, threshold(0)])
    assert sorted(r["index"] for r in records if r["axis"] == 1) == [0, 1, 2]
    assert s.searches[0].answer == 6 and s.searches[2].answer == 0
    assert set(s.searches) == {0, 2}


def test_full_grid_of_several_axes_issues_each_point_once():
    s = Scheduler([3, 2, 4], ["higher", "none", "lower"], autotune=False)
    records = drive(s, [threshold(1), threshold(0), threshold(9)])
    keys = [(r["axis"], r["index"]) for r in records]
    assert sorted(keys) == [(a, i) for a, n in enumerate([3, 2, 4]) for i in range(n)]
    assert len(set(keys)) == len(keys)


@given(n0=st.integers(1, 20), n1=st.integers(1, 20), n2=st.integers(1, 5), data=st.data())
def test_evaluated_points_do_not_depend_on_the_completion_order(n0, n1, n2, data):
    t0, t1 = data.draw(st.integers(0, n0), label="t0"), data.draw(st.integers(0, n1), label="t1")
    oracles = [threshold(t0), threshold(t1), lambda i: i % 2 == 0]
    sizes, directions = [n0, n1, n2], ["higher", "lower", "none"]
    in_order = drive(Scheduler(sizes, directions, autotune=True), oracles)
    reversed_ = drive(Scheduler(sizes, directions, autotune=True), oracles, pick=lambda pending: len(pending) - 1)
    shuffled = drive(Scheduler(sizes, directions, autotune=True), oracles,
                     pick=lambda pending: data.draw(st.integers(0, len(pending) - 1), label="pick"))

    def keys(records):
        return sorted((r["axis"], r["index"], r["certified"]) for r in records)

    assert keys(in_order) == keys(reversed_) == keys(shuffled)
    assert choose(in_order) == choose(reversed_) == choose(shuffled)


def test_violations_on_monotone_axes_only():
    points = [record(0, 0, True), record(0, 1, False), record(0, 2, True),  # 0 certified, 1 not: one violation
              record(1, 0, True), record(1, 1, False),                      # axis 1 is not monotone: ignored
              record(2, 0, False), record(2, 1, True), record(2, 2, True)]  # monotone: fine
    bad = violations(points, ["higher", "none", "lower"])
    assert [(w["axis"], w["index"], s["index"]) for w, s in bad] == [(0, 0, 1)]
    assert violations(points, ["none", "none", "none"]) == []
    both = violations([record(0, 0, True), record(0, 3, False), record(0, 1, True)], ["higher"])
    assert sorted((w["index"], s["index"]) for w, s in both) == [(0, 3), (1, 3)]
    assert violations([record(-1, 0, True), record(0, 0, False)], ["higher"]) == []


def test_choose_ignores_uncertified_points_and_the_baseline():
    points = [record(-1, 0, True, drop=-1.0), record(0, 0, False, drop=0.0), record(0, 1, True, drop=0.3),
              record(1, 0, True, drop=0.2), record(1, 1, True, drop=0.25)]
    assert choose(points)["id"] == "a1-v0"
    assert choose([record(-1, 0, True, drop=0.0), record(0, 0, False, drop=0.0)]) is None
    assert choose([]) is None


def test_choose_breaks_ties_by_axis_then_index():
    tied = [record(1, 0, True, drop=0.1), record(0, 2, True, drop=0.1), record(0, 1, True, drop=0.1 + 1e-12),
            record(2, 0, True, drop=0.1)]
    assert choose(tied)["id"] == "a0-v1"  # drops equal to 9 decimals tie; axis 0, then index 1
    assert choose(list(reversed(tied)))["id"] == "a0-v1"
    assert choose([record(1, 3, True, drop=0.0), record(1, 2, True, drop=0.0)])["index"] == 2


def test_frontier_per_axis():
    points = [record(0, 1, False), record(0, 3, True, drop=0.5), record(0, 5, True, drop=0.1),
              record(1, 0, True, drop=0.4), record(1, 2, True, drop=0.2), record(1, 1, False),
              record(2, 0, False)]
    edge = frontier(points, ["higher", "none", "lower"])
    assert edge[0]["index"] == 3      # monotone: the weakest certifying, whatever its drop
    assert edge[1]["index"] == 2      # not monotone: the least drop among certified
    assert edge[2] is None


@pytest.mark.parametrize("t", range(9))
def test_autotune_reaches_the_full_grid_choice_with_half_the_evaluations(t):
    """The issue's target: on an 8-value axis, at most 4 evaluations reach the full grid's choice."""
    full = drive(Scheduler([8], ["higher"], autotune=False), [threshold(t)])
    tuned = drive(Scheduler([8], ["higher"], autotune=True), [threshold(t)])
    assert len(full) == 8 and len(tuned) <= 4
    full_choice, tuned_choice = choose(full), choose(tuned)
    if t == 8:
        assert full_choice is None and tuned_choice is None
    else:
        assert full_choice["index"] == tuned_choice["index"] == t
        assert frontier(tuned, ["higher"])[0]["index"] == frontier(full, ["higher"])[0]["index"] == t
