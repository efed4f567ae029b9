"""Chapter 00 checks: each accepts a right answer and rejects the plausible wrong ones kept here; and
run_on_ranks reports the rank that really failed (not one that lost its peer), a deadlock as a deadlock
and the stub as NotImplementedError."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm
from minipar.course.checks import ExerciseError, run_on_ranks
from minipar.course.ch00_setup_and_collectives import checks as ch00


def all_gather_right(inputs):
    return [torch.cat(inputs) for _ in inputs]


def all_gather_own_only(inputs):
    return [t.clone() for t in inputs]


def all_gather_reversed(inputs):
    return [torch.cat(inputs[::-1]) for _ in inputs]


def reduce_scatter_right(inputs):
    n = len(inputs)
    return [sum(inputs).chunk(n)[r] for r in range(n)]


def reduce_scatter_is_all_reduce(inputs):
    return [sum(inputs) for _ in inputs]


def reduce_scatter_not_reduced(inputs):
    n = len(inputs)
    return [t.chunk(n)[r] for r, t in enumerate(inputs)]


def reduce_scatter_mean(inputs):
    n = len(inputs)
    return [(sum(inputs) / n).chunk(n)[r] for r in range(n)]


def average_right(t):
    comm.all_reduce(t)
    return t / dist.get_world_size()


def average_not_divided(t):
    return comm.all_reduce(t)


def average_around_the_log(t):
    """Right numbers, but the all-reduce goes straight through torch.distributed: the log cannot count it,
    the sockets do."""
    dist.all_reduce(t)
    return t / dist.get_world_size()


def average_without_communication(t):
    return t / dist.get_world_size()


def ring_step_right(rank, n, step):
    return (rank + 1) % n, (rank - step - 1) % n, (rank - 1) % n, (rank - step - 2) % n


def ring_step_wrong_neighbour(rank, n, step):
    return (rank - 1) % n, (rank - step - 1) % n, (rank + 1) % n, (rank - step - 2) % n


def ring_step_off_by_one(rank, n, step):
    """Sends its own chunk first: consistent between neighbours, but rank r ends complete on chunk r-1."""
    return (rank + 1) % n, (rank - step) % n, (rank - 1) % n, (rank - step - 1) % n


def ring_step_mismatched(rank, n, step):
    return (rank + 1) % n, (rank - step - 1) % n, (rank - 1) % n, (rank - step) % n


@pytest.mark.parametrize("check, right", [
    (ch00.check_after_all_gather, all_gather_right),
    (ch00.check_after_reduce_scatter, reduce_scatter_right),
    (ch00.check_average, average_right),
    (ch00.check_ring_step, ring_step_right),
])
def test_checks_accept_the_right_answer(check, right, capsys):
    check(right)
    out = capsys.readouterr().out.strip()
    assert out
    if check is ch00.check_average:     # the success message prints what was measured, the wire included
        assert "written to the sockets" in out and "1 all-reduce(s)" in out


@pytest.mark.parametrize("check, wrong, message", [
    (ch00.check_after_all_gather, all_gather_own_only, "only its own input"),
    (ch00.check_after_all_gather, all_gather_reversed, "reverse order"),
    (ch00.check_after_reduce_scatter, reduce_scatter_is_all_reduce, "all-reduce"),
    (ch00.check_after_reduce_scatter, reduce_scatter_not_reduced, "not reduced"),
    (ch00.check_after_reduce_scatter, reduce_scatter_mean, "divided by world_size"),
    (ch00.check_average, average_not_divided, "holds the sum over ranks 0..3 but was not divided by world_size"),
    (ch00.check_average, average_without_communication, "nothing came from the other ranks"),
    (ch00.check_average, average_around_the_log, "straight through torch.distributed"),
    (ch00.check_ring_step, ring_step_wrong_neighbour, "wrong neighbour"),
    (ch00.check_ring_step, ring_step_off_by_one, "the sum over ranks"),
    (ch00.check_ring_step, ring_step_mismatched, "must be the one its left neighbour sends"),
])
def test_checks_reject_the_wrong_answer(check, wrong, message):
    with pytest.raises(ExerciseError, match=message):
        check(wrong)


def test_the_stubs_stay_not_implemented():
    def stub(*args):
        raise NotImplementedError()
    for check in (ch00.check_after_all_gather, ch00.check_average, ch00.check_ring_step):
        with pytest.raises(NotImplementedError):
            check(stub)


def _rank2_crashes_while_others_wait(rank, n):
    if rank == 2:
        raise IndexError("chunk 7 of 4")
    comm.recv(torch.empty(1), 2)


def _everyone_waits_on_the_right(rank, n):
    comm.recv(torch.empty(1), (rank + 1) % n)


def test_run_on_ranks_names_the_rank_that_really_failed():
    with pytest.raises(ExerciseError, match=r"raised on rank 2:(.|\n)*IndexError: chunk 7 of 4"):
        run_on_ranks(_rank2_crashes_while_others_wait, 4, timeout=5)


def test_run_on_ranks_calls_a_deadlock_a_deadlock():
    with pytest.raises(ExerciseError, match="deadlock"):
        run_on_ranks(_everyone_waits_on_the_right, 3, timeout=2)
