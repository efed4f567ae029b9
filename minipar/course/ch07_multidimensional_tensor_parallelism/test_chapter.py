"""Chapter 07: tour rows, and every check rejects the stub and plausible wrong answers, accepts the solution."""
import pytest
import torch

from minipar import comm
from minipar.course.checks import ExerciseError
from minipar.course.ch07_multidimensional_tensor_parallelism import checks
from minipar.tensor.operators import all_gather_dim, all_reduce_sum
from minipar.tensor.tp3d import reduce_scatter_rows


# --- one SUMMA step: the solution and wrong answers ---------------------------------------------------

def summa_right(k, x, a, acc, g):
    x_k = x.clone() if g.coord("j") == k else torch.empty_like(x)
    comm.broadcast(x_k, src=g.rank_at(j=k), group=g.group("j"))
    a_k = a.clone() if g.coord("i") == k else torch.empty_like(a)
    comm.broadcast(a_k, src=g.rank_at(i=k), group=g.group("i"))
    return acc + x_k @ a_k


def summa_stub(k, x, a, acc, g):
    raise NotImplementedError()


def summa_no_comm(k, x, a, acc, g):
    return acc + x @ a


def summa_forgets_acc(k, x, a, acc, g):
    x_k = x.clone() if g.coord("j") == k else torch.empty_like(x)
    comm.broadcast(x_k, src=g.rank_at(j=k), group=g.group("j"))
    a_k = a.clone() if g.coord("i") == k else torch.empty_like(a)
    comm.broadcast(a_k, src=g.rank_at(i=k), group=g.group("i"))
    return x_k @ a_k


def summa_in_place(k, x, a, acc, g):          # broadcasts into x and a: later steps send the wrong blocks
    comm.broadcast(x, src=g.rank_at(j=k), group=g.group("j"))
    comm.broadcast(a, src=g.rank_at(i=k), group=g.group("i"))
    return acc + x @ a


def summa_swapped_roots(k, x, a, acc, g):     # X_ki and A_jk: the roles of the row and the column mixed up
    x_k = x.clone() if g.coord("i") == k else torch.empty_like(x)
    comm.broadcast(x_k, src=g.rank_at(i=k), group=g.group("i"))
    a_k = a.clone() if g.coord("j") == k else torch.empty_like(a)
    comm.broadcast(a_k, src=g.rank_at(j=k), group=g.group("j"))
    return acc + x_k @ a_k


def summa_all_reduce(k, x, a, acc, g):        # sums every rank's own product: not a matmul of blocks
    return acc + all_reduce_sum(x @ a, g.group("j")) / 2


def test_summa_check():
    checks.check_summa_step(summa_right)
    with pytest.raises(NotImplementedError):
        checks.check_summa_step(summa_stub)
    for wrong in (summa_no_comm, summa_forgets_acc, summa_in_place, summa_swapped_roots, summa_all_reduce):
        with pytest.raises(ExerciseError):
            checks.check_summa_step(wrong)


# --- the 3D forward: the solution and wrong answers ---------------------------------------------------

def cube_right(x, a, g, axes):
    m, k, n = axes
    x_mk = all_gather_dim(x, 0, g.group(n))
    a_kn = all_gather_dim(a, 0, g.group(m))
    return reduce_scatter_rows(x_mk @ a_kn, g.group(k))


def cube_stub(x, a, g, axes):
    raise NotImplementedError()


def cube_swapped_axes(x, a, g, axes):
    m, k, n = axes
    x_mk = all_gather_dim(x, 0, g.group(m))
    a_kn = all_gather_dim(a, 0, g.group(n))
    return reduce_scatter_rows(x_mk @ a_kn, g.group(k))


def cube_all_reduce(x, a, g, axes):
    m, k, n = axes
    return all_reduce_sum(all_gather_dim(x, 0, g.group(n)) @ all_gather_dim(a, 0, g.group(m)), g.group(k))


def cube_no_reduction(x, a, g, axes):
    m, k, n = axes
    y = all_gather_dim(x, 0, g.group(n)) @ all_gather_dim(a, 0, g.group(m))
    return y.chunk(2)[g.coord(k)]


def cube_returns_tuple(x, a, g, axes):
    m, k, n = axes
    x_mk, a_kn = all_gather_dim(x, 0, g.group(n)), all_gather_dim(a, 0, g.group(m))
    return reduce_scatter_rows(x_mk @ a_kn, g.group(k)), x_mk, a_kn


def test_cube_check():
    checks.check_cube_forward(cube_right)
    with pytest.raises(NotImplementedError):
        checks.check_cube_forward(cube_stub)
    for wrong in (cube_swapped_axes, cube_all_reduce, cube_no_reduction, cube_returns_tuple):
        with pytest.raises(ExerciseError):
            checks.check_cube_forward(wrong)


# --- the tour rows -------------------------------------------------------------------------------------

def test_tour_rows():
    from minipar.course.ch07_multidimensional_tensor_parallelism.tour import STRATEGIES
    assert [name for name, _ in STRATEGIES] == ["tp-2d", "tp-2.5d", "tp-3d"]
    for name, run in STRATEGIES:
        row = run()
        assert row.strategy == name and row.matches and row.max_abs_diff < 1e-12
        assert row.bytes_sent_per_rank == row.bytes_formula                 # the log's model = the formula
        # the sockets: the formula + a header (≤ 300 B) per message, at most 16 messages per rank here
        assert row.bytes_formula < row.bytes_observed_per_rank < row.bytes_formula + 300 * 16
        assert row.world_size == (4 if name == "tp-2d" else 8)


def test_3d_least_communication_thresholds_by_the_formulas():
    from minipar.course.ch07_multidimensional_tensor_parallelism import crossover
    from minipar.tensor.multidim_measure import formula_bytes
    rows = crossover.threshold_table()
    mlp, big16k, big2k, big256 = rows
    assert mlp["vs_1d"][0] == 27 and mlp["3d_over_1d_at_8"] > 1          # measured at P = 8: 1D sends less
    assert formula_bytes("3d", 8) > formula_bytes("1d", 8) and formula_bytes("3d", 27) < formula_bytes("1d", 27)
    assert big16k["vs_1d"][0] < big2k["vs_1d"][0] < big256["vs_1d"][0]    # fewer tokens, later crossover
    for r in rows:   # 3D below 2D at every P where both grids exist (64, 729, 4096, ...)
        assert r["vs_2d"][0] == 64 and r["vs_2d"][1] < 1
    assert all(formula_bytes("3d", p) < formula_bytes("2d", p) for p in (64, 729, 4096))
    assert "P = 27" in crossover.threshold_text([mlp])
