"""Chapter 01 checks: each accepts a right answer and rejects the plausible wrong ones kept here
(wrong neighbour, whole tensor sent each step, missing all-gather, missing all-reduce, a division by
world_size, a transposed shard, communication where none is needed). Tolerance of the checks: 1e-5."""
import pytest
import torch
import torch.distributed as dist

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch01_splitting_one_matmul import checks as ch01


def _ring(t, group=None, right_offset=1, left_offset=-1, all_gather=True):
    """Ring all-reduce: reduce-scatter then all-gather (the offsets let a test break the neighbours)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(t.chunk(n))
    right, left = (r + right_offset) % n, (r + left_offset) % n
    for k in range(n - 1):
        incoming = torch.empty_like(chunks[0])
        req = comm.isend(chunks[(r - k - 1) % n].contiguous(), right)
        comm.recv(incoming, left)
        req.wait()
        chunks[(r - k - 2) % n] += incoming
    for k in range(n - 1 if all_gather else 0):
        incoming = torch.empty_like(chunks[0])
        req = comm.isend(chunks[(r - k) % n].contiguous(), right)
        comm.recv(incoming, left)
        req.wait()
        chunks[(r - k - 1) % n].copy_(incoming)
    return t


def ring_right(t):
    return _ring(t)


def ring_wrong_neighbour(t):
    return _ring(t, right_offset=1, left_offset=1)


def ring_without_all_gather(t):
    return _ring(t, all_gather=False)


def ring_whole_tensor(t):
    """Right sum, but passes the whole tensor around: (N-1)·S bytes instead of 2(N-1)/N·S."""
    n, r = dist.get_world_size(), dist.get_rank()
    total, passing = t.clone(), t.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(t)
        req = comm.isend(passing, (r + 1) % n)
        comm.recv(incoming, (r - 1) % n)
        req.wait()
        total += incoming
        passing = incoming
    return total


def ring_averaged(t):
    return _ring(t) / dist.get_world_size()


def ring_with_library_all_reduce(t):
    return comm.all_reduce(t)


def column_right(x, w_cols, dy_cols):
    dx = dy_cols @ w_cols.T
    comm.all_reduce(dx)
    return x @ w_cols, dx, x.T @ dy_cols


def column_missing_all_reduce(x, w_cols, dy_cols):
    return x @ w_cols, dy_cols @ w_cols.T, x.T @ dy_cols


def column_transposed_dw(x, w_cols, dy_cols):
    y, dx, dw = column_right(x, w_cols, dy_cols)
    return y, dx, dy_cols.T @ x


def column_averaged_dx(x, w_cols, dy_cols):
    y, dx, dw = column_right(x, w_cols, dy_cols)
    return y, dx / dist.get_world_size(), dw


def row_right(x_cols, w_rows, dy):
    y = x_cols @ w_rows
    comm.all_reduce(y)
    return y, dy @ w_rows.T, x_cols.T @ dy


def row_missing_all_reduce(x_cols, w_rows, dy):
    return x_cols @ w_rows, dy @ w_rows.T, x_cols.T @ dy


def row_transposed_dw(x_cols, w_rows, dy):
    y, dx, dw = row_right(x_cols, w_rows, dy)
    return y, dx, dy.T @ x_cols


def row_extra_backward_all_reduce(x_cols, w_rows, dy):
    y, dx, dw = row_right(x_cols, w_rows, dy)
    comm.all_reduce(dy.clone())   # "to be safe": right values, communication the split does not need
    return y, dx, dw


def test_ring_all_reduce_accepts_the_right_ring(capsys):
    ch01.check_ring_all_reduce(ring_right)
    assert "every rank holds the sum" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (ring_without_all_gather, "all-gather phase is missing"),
    (ring_whole_tensor, "not the whole tensor"),
    (ring_averaged, "divided by world_size"),
    (ring_with_library_all_reduce, "only send/recv"),
])
def test_ring_all_reduce_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_ring_all_reduce(wrong)


def test_ring_all_reduce_rejects_a_wrong_neighbour_as_a_deadlock():
    with pytest.raises(ExerciseError, match="wrong neighbour"):
        ch01.check_ring_all_reduce(ring_wrong_neighbour, timeout=3)


def test_ring_stub_stays_not_implemented():
    def stub(t):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError, match="not written yet"):
        ch01.check_ring_all_reduce(stub)


def test_column_parallel_accepts_the_right_answer():
    ch01.check_column_parallel(column_right)


@pytest.mark.parametrize("wrong, message", [
    (column_missing_all_reduce, "missing all-reduce"),
    (column_transposed_dw, "transposed shard"),
    (column_averaged_dx, "divided by world_size"),
])
def test_column_parallel_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_column_parallel(wrong, world_sizes=(2,))


def test_row_parallel_accepts_the_right_answer():
    ch01.check_row_parallel(row_right)


@pytest.mark.parametrize("wrong, message", [
    (row_missing_all_reduce, "missing all-reduce"),
    (row_transposed_dw, "transposed shard"),
    (row_extra_backward_all_reduce, "backward needs no communication"),
])
def test_row_parallel_rejects(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        ch01.check_row_parallel(wrong, world_sizes=(2,))
