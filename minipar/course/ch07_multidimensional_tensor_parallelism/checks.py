"""Chapter 07 exercise checks: one SUMMA step (2D, 4 ranks) and the 3D forward's three collectives (8 ranks)."""
from __future__ import annotations

import torch

from minipar import comm
from minipar.course.checks import fail, run_on_ranks

__all__ = ["check_summa_step", "check_cube_forward"]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(12, 6, generator=g, dtype=torch.float64)


def _close(got, want):
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-10)


def _diff(got, want):
    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} (expected {tuple(want.shape)})"
    return f"max |Δ| = {float((got - want).abs().max()):.3g}"


# ----------------------------------------------------------------------------------------------------
# 1. One SUMMA step
# ----------------------------------------------------------------------------------------------------

def _run_summa(rank, world_size, summa_step):
    from minipar.tensor.grid import build, grid_2d
    from minipar.tensor.tp2d import block
    g = build(grid_2d(world_size), rank)
    q, i, j = g.size("i"), g.coord("i"), g.coord("j")
    x, a = _data()
    xb, ab = block(x, i, j, q), block(a, i, j, q)
    acc, steps = xb.new_zeros(xb.shape[0], ab.shape[1]), []
    for k in range(q):
        with comm.recording() as log:
            acc = summa_step(k, xb, ab, acc, g)
        steps.append([(r.op, r.group_size) for r in log.records])
        if not isinstance(acc, torch.Tensor):
            break
    return acc, steps, xb @ ab


def check_summa_step(summa_step) -> None:
    """``summa_step(k, x, a, acc, g)`` on rank (i, j) of a q×q grid: receive X_ik along the block row and
    A_kj along the block column (``comm.broadcast``), return ``acc + X_ik A_kj``. Looping k = 0 … q−1 must
    give ``Y_ij = Σ_k X_ik A_kj``, with exactly two broadcasts per step."""
    from minipar.tensor.tp2d import block
    x, a = _data()
    y = x @ a
    results = run_on_ranks(_run_summa, 4, summa_step, what="summa_step", timeout=15)
    for rank, (got, steps, own) in enumerate(results):
        i, j = divmod(rank, 2)
        want = block(y, i, j, 2)
        where = f"SUMMA on a 2×2 grid, rank {rank} = (i={i}, j={j})"
        if not isinstance(got, torch.Tensor):
            fail(where, "acc + X_ik @ A_kj (a tensor)", _diff(got, want), "return the new accumulator")
        ops = [op for step in steps for op, _ in step]
        if not _close(got, want):
            if _close(got, own * 2) or _close(got, own) or "broadcast" not in ops:
                fail(where, "Y_ij = Σ_k X_ik A_kj", _diff(got, want),
                     "each rank multiplied only its own blocks: in step k, X_ik must come from rank (i, k) "
                     "(comm.broadcast along the row, group g.group('j')) and A_kj from rank (k, j) (along "
                     "the column, group g.group('i'))")
            x1 = block(x, i, 1, 2) @ block(a, 1, j, 2)
            if _close(got, x1):
                fail(where, "Y_ij = Σ_k X_ik A_kj", _diff(got, want),
                     "only the last step's product survived: return acc + x_k @ a_k, not x_k @ a_k")
            fail(where, "Y_ij = Σ_k X_ik A_kj", _diff(got, want),
                 "check the roots and the groups: X_ik is owned by g.rank_at(j=k) and travels along "
                 "g.group('j') (the block row); A_kj is owned by g.rank_at(i=k) and travels along "
                 "g.group('i') (the block column). Broadcast into a copy on the root (x.clone()) and into an "
                 "empty buffer elsewhere — never into x itself, or the next step sees someone else's block")
        for k, step in enumerate(steps):
            if [op for op, _ in step] != ["broadcast", "broadcast"]:
                fail(f"{where}: step {k}'s communication", "two broadcasts (X_ik along the row, A_kj along "
                     "the column)", step, "one broadcast per operand per step; no all-reduce is needed — "
                     "every rank accumulates its own Y_ij")
    print("SUMMA step: Y_ij = Σ_k X_ik A_kj on every rank of a 2×2 grid, two broadcasts per step")


# ----------------------------------------------------------------------------------------------------
# 2. The 3D forward's three collectives
# ----------------------------------------------------------------------------------------------------

def _run_cube(rank, world_size, cube_forward, layer):
    from minipar.tensor.grid import build, grid_3d
    from minipar.tensor.tp3d import piece, roles
    g = build(grid_3d(world_size), rank)
    axes = roles(layer)
    m, k, n = (g.coord(d) for d in axes)
    x, a = _data(layer + 1)
    xp, ap = piece(x, m, k, n, 2), piece(a, k, n, m, 2)
    with comm.recording() as log:
        y = cube_forward(xp, ap, g, axes)
    ops = [(r.op, r.group_size) for r in log.records if r.op != "recv"]
    return (m, k, n), y, ops


def check_cube_forward(cube_forward) -> None:
    """``cube_forward(x, a, g, axes)`` with ``axes = (m_axis, k_axis, n_axis)``: all-gather X's pieces along
    the n-axis, A's along the m-axis, multiply, reduce-scatter (rows) along the k-axis; return piece k of
    Y_mn. Checked on the 2×2×2 cube with both role sets (layers 0 and 1)."""
    from minipar.tensor.tp3d import piece
    for layer in (0, 1):
        x, a = _data(layer + 1)
        y = x @ a
        for rank, ((m, k, n), got, ops) in enumerate(run_on_ranks(_run_cube, 8, cube_forward, layer,
                                                                     what="cube_forward", timeout=20)):
            want = piece(y, m, n, k, 2)
            where = f"3D forward, layer {layer} (axes m, k, n = {('x', 'y', 'z') if layer == 0 else ('x', 'z', 'y')}), rank {rank}"
            if isinstance(got, tuple):
                fail(where, "the Y piece alone", "a tuple", "return only y (Cube keeps X_mk and A_kn itself)")
            names = [op for op, _ in ops]
            if names.count("all_gather") != 2:
                fail(f"{where}: communication", "two all-gathers (X along the n-axis, A along the m-axis)",
                     names, "gather X's pieces with all_gather_dim(x, 0, g.group(n_axis)) and A's with "
                     "all_gather_dim(a, 0, g.group(m_axis))")
            if isinstance(got, torch.Tensor) and got.shape == (y.shape[0] // 2, y.shape[1] // 2):
                fail(where, f"piece k of Y_mn: shape {tuple(want.shape)}", _diff(got, want),
                     "this is the whole block Y_mn: the ranks of the k-axis each keep 1/q of its rows — "
                     "reduce-scatter (reduce_scatter_rows), not all-reduce")
            if not _close(got, want):
                if "all_reduce" in names or not any(op in ("send", "reduce_scatter") for op in names):
                    fail(where, "piece k of Σ_k X_mk A_kn", _diff(got, want),
                         "the products X_mk A_kn are partial sums over k: reduce-scatter them along the "
                         "k-axis, g.group(k_axis)")
                fail(where, "piece k of Y_mn = Σ_k X_mk A_kn", _diff(got, want),
                     "a collective along the wrong axis: X's pieces differ along the n-axis "
                     "(g.group(axes[2])), A's along the m-axis (g.group(axes[0])), the partial products "
                     "along the k-axis (g.group(axes[1]))")
    print("3D forward: piece k of Y_mn on every rank of the 2×2×2 cube, for both layers' roles, with "
          "2 all-gathers and 1 reduce-scatter")

