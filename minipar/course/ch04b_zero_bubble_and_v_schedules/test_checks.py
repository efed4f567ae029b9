"""Chapter 04b checks: each passes the solution, fails on the stub, and rejects plausible wrong answers
(receive-before-send deadlock, the wrong neighbour, a V schedule "fixed" by dropping the action or by moving
it to the end, or not at all)."""
import dataclasses

import pytest
import torch

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch04b_zero_bubble_and_v_schedules import checks as ch04b


def stub(*args):
    raise NotImplementedError()


# -- 1. the exchange ------------------------------------------------------------------------------------

def exchange(rank, p, act, grad):
    act_in = torch.empty_like(act) if rank > 0 else None
    grad_in = torch.empty_like(grad) if rank < p - 1 else None
    reqs = []
    if rank < p - 1:
        reqs.append(comm.isend(act, rank + 1))
    if rank > 0:
        reqs.append(comm.isend(grad, rank - 1))
        comm.recv(act_in, rank - 1)
    if rank < p - 1:
        comm.recv(grad_in, rank + 1)
    for r in reqs:
        r.wait()
    return act_in, grad_in


def exchange_deadlocks(rank, p, act, grad):
    act_in = torch.empty_like(act) if rank > 0 else None
    grad_in = torch.empty_like(grad) if rank < p - 1 else None
    if rank < p - 1:
        comm.recv(grad_in, rank + 1)
    if rank > 0:
        comm.recv(act_in, rank - 1)
    if rank < p - 1:
        comm.send(act, rank + 1)
    if rank > 0:
        comm.send(grad, rank - 1)
    return act_in, grad_in


def exchange_returns_swapped(rank, p, act, grad):
    act_in, grad_in = exchange(rank, p, act, grad)
    return grad_in, act_in


def exchange_stub(rank, p, act, grad):
    raise NotImplementedError()


def test_exchange_check_accepts_the_solution():
    ch04b.check_exchange(exchange)


def test_exchange_check_names_the_deadlock():
    with pytest.raises(ExerciseError, match="deadlock"):
        ch04b.check_exchange(exchange_deadlocks, timeout=3)


def test_exchange_check_rejects_swapped_results_and_the_stub():
    with pytest.raises(ExerciseError, match="activations come from rank - 1"):
        ch04b.check_exchange(exchange_returns_swapped)
    with pytest.raises(NotImplementedError):
        ch04b.check_exchange(exchange_stub)


# -- 2. a V schedule's deadlock, found with the checker and fixed -------------------------------------------

def fix_deadlock(schedule):
    from minipar.pipeline.checker import ScheduleError, check
    try:
        check(schedule)
        return schedule
    except ScheduleError as err:
        rank, index = err.rank, err.index
    acts = list(schedule.actions[rank])
    action = acts.pop(index)
    for k in range(index + 1, len(acts) + 1):
        trial = dataclasses.replace(schedule, actions=[acts[:k] + [action] + acts[k:] if r == rank else a
                                                       for r, a in enumerate(schedule.actions)])
        try:
            check(trial)
            return trial
        except ScheduleError:
            continue


def _moved(schedule, where):
    from minipar.pipeline.checker import ScheduleError, check
    try:
        check(schedule)
    except ScheduleError as err:
        acts = list(schedule.actions[err.rank])
        action = acts.pop(err.index)
        if where == "end":
            acts.append(action)
        return dataclasses.replace(schedule, actions=[acts if r == err.rank else a
                                                      for r, a in enumerate(schedule.actions)])
    return schedule


def test_fix_deadlock_check_accepts_the_solution(capsys):
    ch04b.check_fix_deadlock(fix_deadlock)
    assert "passes the checker" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (lambda s: _moved(s, "drop"), "same actions"),          # drops the action that waits
    (lambda s: _moved(s, "end"), "still cannot run"),        # moves it to the very end: its backward waits
    (lambda s: s, "still cannot run"),                       # returns it unchanged
    (lambda s: s.actions, "a Schedule"),
])
def test_fix_deadlock_check_rejects(wrong, says):
    with pytest.raises(ExerciseError, match=says):
        ch04b.check_fix_deadlock(wrong)


def test_fix_deadlock_check_fails_on_the_stub():
    with pytest.raises(NotImplementedError):
        ch04b.check_fix_deadlock(stub)
