"""Checks for chapter 04b's exercises: a point-to-point exchange that cannot deadlock, and a V schedule's
deadlock found and fixed with the schedule checker.

The first runs on 2 and 4 processes with a short timeout, so a deadlock fails in seconds; the second is
checked by :mod:`minipar.pipeline.checker` without any process.
"""
from __future__ import annotations

import dataclasses

import torch

from minipar import comm
from minipar.pipeline import make_schedule
from minipar.pipeline.schedules import Action, Schedule
from minipar.course.checks import ExerciseError, fail, run_on_ranks

__all__ = ["check_exchange", "exchange_inputs", "broken_v_schedule", "check_fix_deadlock"]


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
