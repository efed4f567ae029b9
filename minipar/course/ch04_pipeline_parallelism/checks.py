"""Checks for chapter 04's exercises: the 1F1B action list of one rank, a bubble fraction, a
point-to-point exchange that cannot deadlock, and a V schedule's deadlock found and fixed with the checker.

The first two are checked against :mod:`minipar.pipeline` without processes (the schedule functions and the
simulator's clock); the third runs on 2 and 4 processes with a short timeout, so a deadlock fails in seconds.
"""
from __future__ import annotations

import dataclasses

import torch

from minipar import comm
from minipar.pipeline import make_schedule, simulate
from minipar.pipeline.schedules import Action, Schedule
from minipar.pipeline.simulate import Deadlock
from minipar.course.checks import ExerciseError, fail, run_on_ranks

__all__ = ["check_one_f_one_b_rank", "check_bubble_fraction", "check_exchange", "exchange_inputs",
           "broken_v_schedule", "check_fix_deadlock"]

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
    except Deadlock as err:
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


def exchange_inputs(rank: int, p: int):
    """What each rank holds in the exercise: an activation for rank+1 and a gradient for rank-1."""
    return torch.full((3,), float(rank)), torch.full((2,), 100.0 + rank)


def _run_exchange(rank, p, exchange):
    act, grad = exchange_inputs(rank, p)
    with comm.recording() as log:
        got = exchange(rank, p, act, grad)
    return got, sorted({r.op for r in log.records})


def check_exchange(exchange, timeout: float = 6.0) -> None:
    """``exchange(rank, p, act, grad)`` -> (activation from rank-1 or None, gradient from rank+1 or None):
    every rank but the last sends ``act`` to rank+1, every rank but the first sends ``grad`` to rank-1."""
    for p in (2, 4):
        try:
            results = run_on_ranks(_run_exchange, p, exchange, what="exchange(rank, p, act, grad)",
                                   timeout=timeout)
        except ExerciseError as err:
            if "deadlock" in str(err):
                raise ExerciseError(
                    f"exchange on {p} ranks did not finish: a deadlock.\nlikely mistake: a rank blocks in a "
                    f"receive before it has sent what its neighbour is waiting for (rank p-1 waits for the "
                    f"activation from p-2 while p-2 waits for the gradient from p-1). Post the sends with "
                    f"comm.isend first (wait for them at the end), then receive.") from None
            raise
        for r, ((act_in, grad_in), ops) in enumerate(results):
            if set(ops) - {"send", "recv"}:
                fail(f"exchange on {p} ranks, rank {r}", "only send/recv", ops, "use comm.isend / comm.recv")
            want_act = None if r == 0 else exchange_inputs(r - 1, p)[0]
            want_grad = None if r == p - 1 else exchange_inputs(r + 1, p)[1]
            for name, got, want in (("activation", act_in, want_act), ("gradient", grad_in, want_grad)):
                ok = got is None if want is None else (isinstance(got, torch.Tensor) and got.shape == want.shape
                                                       and torch.equal(got, want))
                if not ok:
                    fail(f"exchange on {p} ranks, rank {r}: the {name} received",
                         None if want is None else want.tolist(),
                         got.tolist() if isinstance(got, torch.Tensor) else got,
                         "activations come from rank - 1, gradients from rank + 1 (None at the ends)")
    print("exchange: no deadlock on 2 and 4 ranks; every activation and gradient reached its neighbour")


def broken_v_schedule(p: int, m: int, where: str = "turn") -> Schedule:
    """ZB-V on p ranks with one action moved too early on one rank: ``"turn"``, the last rank runs its first
    up-going forward (stage p) before the down-going one (stage p-1) that feeds it; ``"loss"``, rank 0 runs
    the first backward of the last stage before that stage's forward."""
    s = make_schedule("zb-v", p, m, 2)
    rank, early = (p - 1, Action("F", p, 0)) if where == "turn" else (0, Action("B", 2 * p - 1, 0))
    acts = [a for a in s.actions[rank] if a != early]
    acts.insert(0 if where == "turn" else 2 * p - 1, early)
    return dataclasses.replace(s, name=f"zb-v broken at the {where}",
                               actions=[acts if r == rank else list(a) for r, a in enumerate(s.actions)])


def check_fix_deadlock(fix_deadlock) -> None:
    """``fix_deadlock(schedule)`` -> the schedule with its actions reordered so that the checker passes:
    the same actions on every rank, only the broken rank changed."""
    from minipar.pipeline.checker import ScheduleError, check
    for p, m, where in ((4, 8, "turn"), (2, 4, "turn"), (3, 6, "loss"), (4, 8, "loss")):
        broken = broken_v_schedule(p, m, where)
        what = f"fix_deadlock(broken_v_schedule({p}, {m}, {where!r}))"
        got = fix_deadlock(dataclasses.replace(broken, actions=[list(a) for a in broken.actions]))
        if not isinstance(got, Schedule):
            fail(what, "a Schedule", type(got).__name__, "return the schedule, with the changed rank's list")
        for r, (mine, theirs) in enumerate(zip(got.actions, broken.actions)):
            if sorted(map(str, mine)) != sorted(map(str, theirs)):
                fail(f"{what}: rank {r}'s actions", "the same actions, reordered", _diff(theirs, mine),
                     "a fix moves the action that waits; dropping or adding one breaks training (the checker "
                     "says: never runs ...)")
        changed = [r for r in range(p) if list(got.actions[r]) != list(broken.actions[r])]
        try:
            check(got)
        except ScheduleError as err:
            fail(f"{what} still cannot run", "the checker passes", str(err),
                 "move the action the checker names *later* in its rank's list, just after what it waits for")
        if len(changed) != 1:
            fail(f"{what}: ranks changed", "only the broken one", changed, "leave the healthy ranks alone")
    print("fix_deadlock: every broken V schedule passes the checker, with one rank's actions reordered")


def _diff(want, got) -> str:
    missing = sorted(set(map(str, want)) - set(map(str, got)))
    extra = sorted(set(map(str, got)) - set(map(str, want)))
    return f"missing {missing}, extra {extra}" if missing or extra else "an action twice"
