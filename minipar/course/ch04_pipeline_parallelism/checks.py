"""Checks for chapter 04's exercises: the 1F1B action list of one rank, and a bubble fraction.

Both are checked against :mod:`minipar.pipeline` without processes (the schedule functions and the
simulator's clock). The deadlock exercises are chapter 04b's.
"""
from __future__ import annotations

from minipar.pipeline import make_schedule, simulate
from minipar.pipeline.schedules import Action, Schedule
from minipar.pipeline.simulate import ScheduleDeadlock
from minipar.course.checks import ExerciseError, fail

__all__ = ["check_one_f_one_b_rank", "check_bubble_fraction"]

CASES = ((4, 8), (4, 4), (3, 7), (2, 5))


def _as_pairs(actions) -> list:
    out = []
    for a in actions:
        if isinstance(a, Action):
            out.append((a.kind, a.microbatch))
        elif isinstance(a, (tuple, list)) and len(a) == 2:
            out.append((str(a[0]), int(a[1])))
        else:
            raise ExerciseError(f"each action should be a pair (kind, micro-batch) like ('F', 0), got {a!r}")
    return out


def _show(pairs) -> str:
    return " ".join(f"{k}{i}" for k, i in pairs)


def check_one_f_one_b_rank(one_f_one_b_rank) -> None:
    """``one_f_one_b_rank(p, m, r)`` -> rank r's 1F1B list of (kind, micro-batch), kind "F" or "BW"."""
    for p, m in CASES:
        got_all = []
        for r in range(p):
            want = [(a.kind, a.microbatch) for a in make_schedule("1f1b", p, m).actions[r]]
            got = _as_pairs(one_f_one_b_rank(p, m, r))
            got_all.append(got)
            if got != want:
                _diagnose_1f1b(p, m, r, got, want)
        _simulate_pairs(p, m, got_all)
    print("1F1B: every rank's list is right for p, m in", ", ".join(f"({p}, {m})" for p, m in CASES),
          "- rank r holds at most p - r micro-batches")


def _diagnose_1f1b(p, m, r, got, want):
    what = f"one_f_one_b_rank(p={p}, m={m}, r={r})"
    forwards = 0
    for k, _ in got:
        if k != "F":
            break
        forwards += 1
    if got == [("F", i) for i in range(m)] + [("BW", i) for i in range(m)] or \
            got == [("F", i) for i in range(m)] + [("BW", i) for i in reversed(range(m))]:
        fail(what, _show(want), _show(got), "that is GPipe (all forwards, then all backwards): m micro-batches "
             "in flight; 1F1B starts the backwards after p - r - 1 warm-up forwards")
    if sorted(got) != sorted(want):
        fail(what, _show(want), _show(got), "every micro-batch needs exactly one F and one BW on each rank")
    if forwards != min(p - r, m):
        fail(what, _show(want), _show(got), f"rank {r} should run p - r - 1 = {p - r - 1} warm-up forwards, then "
             f"one more F before its first BW ({p - r} forwards in a row); you run {forwards}")
    fail(what, _show(want), _show(got), "after the warm-up, alternate F of the next micro-batch and BW of the "
         "oldest one; when the forwards run out, drain the remaining BWs in order")


def _simulate_pairs(p, m, lists):
    sched = Schedule("yours", p, m, 1, [[Action(k, r, i) for k, i in acts] for r, acts in enumerate(lists)])
    try:
        sim = simulate(sched)
    except ScheduleDeadlock as err:
        raise ExerciseError(f"your lists deadlock for p={p}, m={m}: {err}") from None
    if sim.peak_in_flight != [p - r for r in range(p)]:
        fail(f"micro-batches in flight for p={p}, m={m}", [p - r for r in range(p)], sim.peak_in_flight,
             "1F1B bounds rank r's activations by p - r")


def check_bubble_fraction(bubble_fraction) -> None:
    """``bubble_fraction(p, m, v)`` -> idle fraction of interleaved 1F1B (v = 1: plain 1F1B / GPipe) with
    F = 1, BW = 2 and free transfers, checked against the simulator's clock."""
    for p, m, v in ((4, 8, 1), (4, 8, 2), (2, 4, 1), (4, 4, 4), (8, 16, 2), (3, 9, 3)):
        name = "interleaved" if v > 1 else "1f1b"
        want = simulate(make_schedule(name, p, m, v)).bubble_fraction
        got = bubble_fraction(p, m, v)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
            _diagnose_bubble(p, m, v, got, want)
    print("bubble fraction: equals the simulated clock for v = 1, 2, 3, 4 - bubble time divided by v")


def _diagnose_bubble(p, m, v, got, want):
    what = f"bubble_fraction(p={p}, m={m}, v={v})"
    near = lambda x: isinstance(got, (int, float)) and abs(got - x) < 1e-9   # noqa: E731
    if near((p - 1) / (v * m)) or near((p - 1) / m):
        fail(what, f"{want:.4f}", got, "(p-1)/(v·m) is the bubble time over the ideal time (Megatron's ratio), "
             "not a fraction of the whole step: divide by the total, ideal + bubble")
    if near((p - 1) / (m + p - 1) / v):
        fail(what, f"{want:.4f}", got, "interleaving divides the bubble *time* by v, not the fraction: the "
             "step is v·m chunk-slots of work plus (p-1) slots of bubble")
    if near((p - 1) / (m + p - 1)):
        fail(what, f"{want:.4f}", got, "this ignores v: with v chunks each slot is v times shorter")
    fail(what, f"{want:.4f}", got, "count in chunk-slots (one F + BW of one chunk): v·m of work per rank and "
         "p - 1 of fill and drain")
