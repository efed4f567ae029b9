"""Checks for chapter 01's exercises: ring all-reduce from send/recv, and the column- and row-parallel
matmul forward and backward by hand.

Each check runs the learner's function on several ranks with :func:`minipar.checks.run_on_ranks`, compares
every rank's result with one device, reads the communication log (values can be right and the traffic
wrong), and names the likely mistake when the answer matches a known wrong one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minipar import comm
from minipar.tensor.matmul_split import shard
from minipar.course.checks import fail, run_on_ranks

__all__ = ["check_ring_all_reduce", "check_column_parallel", "check_row_parallel", "matmul_problem"]

TOL = 1e-5   # float32, sums over ranks in another order than one device


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=TOL, rtol=TOL)


def _show(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)[:80]


# ----------------------------------------------------------------------------------------------------
# Ring all-reduce
# ----------------------------------------------------------------------------------------------------

def _run_ring(rank, n, ring_all_reduce, inputs):
    with comm.recording() as log:
        out = ring_all_reduce(inputs[rank].clone())
    dist.barrier()
    other_ops = sorted({r.op for r in log.records} - {"send", "recv"})
    return out, log.bytes_sent, other_ops


def check_ring_all_reduce(ring_all_reduce, timeout: float = 10.0) -> None:
    """``ring_all_reduce(t)`` on every rank -> the sum of every rank's ``t`` (1-D, N divides its length),
    built from ``comm.isend``/``comm.send`` and ``comm.recv`` only, sending 2(N-1)/N · S bytes per rank."""
    for n, numel in ((4, 8), (3, 6)):
        inputs = [torch.arange(1.0, numel + 1) + 10 * r for r in range(n)]
        total = sum(inputs)
        s = total.numel() * total.element_size()
        results = run_on_ranks(_run_ring, n, ring_all_reduce, inputs, what="ring_all_reduce(t)", timeout=timeout)
        for r, (got, sent, other_ops) in enumerate(results):
            if other_ops:
                fail(f"ring_all_reduce on {n} ranks, rank {r}", "only send/recv", f"calls to {other_ops}",
                     "build the ring from comm.isend / comm.recv: the point is to see the collective's inside")
            if got is None:
                fail(f"ring_all_reduce on {n} ranks, rank {r}", "the summed tensor", None, "return the tensor")
            if not _close(got, total):
                _diagnose_ring(n, r, got, total, inputs)
            formula = comm.predicted_bytes_sent("all_reduce", s, n)
            if sent != formula:
                fail(f"ring_all_reduce on {n} ranks, rank {r}: bytes sent", f"2(N-1)/N·S = {formula:.0f}",
                     f"{sent}", "each of the 2(N-1) steps sends one chunk (S/N bytes), not the whole tensor"
                     if sent >= (n - 1) * s else "every rank sends N-1 chunks in each phase")
    print("ring all-reduce: every rank holds the sum, on 4 and 3 ranks, sending 2(N-1)/N·S bytes each")


def _diagnose_ring(n, r, got, total, inputs):
    what = f"ring_all_reduce on {n} ranks, rank {r}"
    if _close(got, total / n):
        fail(what, total.tolist(), got.tolist(), "divided by world_size: an all-reduce sums")
    if got.shape == total.shape and _close(got.chunk(n)[r], total.chunk(n)[r]):
        fail(what, total.tolist(), got.tolist(), f"chunk {r} is right, the others are not: the all-gather "
             "phase is missing (after the reduce-scatter rank r holds only chunk r of the sum)")
    if _close(got, inputs[r]):
        fail(what, total.tolist(), got.tolist(), "nothing was added: add what you receive into your chunk")
    fail(what, total.tolist(), got.tolist() if got.shape == total.shape else _show(got),
         "check the chunk indices: in reduce-scatter step k rank r sends chunk (r-k-1)%N and adds into "
         "(r-k-2)%N; in all-gather step k it sends (r-k)%N and overwrites (r-k-1)%N")


# ----------------------------------------------------------------------------------------------------
# Column- and row-parallel matmul by hand
# ----------------------------------------------------------------------------------------------------

def matmul_problem(b: int = 4, k: int = 5, m: int = 8, seed: int = 0):
    """The OneFlow article's x (4×5) · w (5×8), an upstream gradient dy, and the single-device y, dx, dw."""
    g = torch.Generator().manual_seed(seed)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((b, k), (k, m), (b, m)))
    return (x, w, dy), {"y": x @ w, "dx": dy @ w.T, "dw": x.T @ dy}


def _run_column(rank, n, fn, x, w, dy):
    w_cols, dy_cols = shard(w, 1, rank, n), shard(dy, 1, rank, n)
    with comm.recording() as log:
        out = fn(x.clone(), w_cols, dy_cols)
    return out, log.by_op(), dy_cols @ w_cols.T


def _unpack(out, what):
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        fail(what, "a tuple of three tensors", repr(out)[:100], "return the three tensors asked for")
    return out


def check_column_parallel(column_parallel, world_sizes=(2, 4)) -> None:
    """``column_parallel(x, w_cols, dy_cols)`` -> ``(y_cols, dx, dw_cols)`` on every rank: its columns of
    y and of dw, and the whole dx."""
    (x, w, dy), ref = matmul_problem()
    for n in world_sizes:
        results = run_on_ranks(_run_column, n, column_parallel, x, w, dy, what="column_parallel")
        for r, (out, ops, dx_partial) in enumerate(results):
            what = f"column split on {n} ranks, rank {r}"
            y_cols, dx, dw_cols = _unpack(out, what + ": the return value")
            want_y, want_dw = shard(ref["y"], 1, r, n), shard(ref["dw"], 1, r, n)
            if not _close(y_cols, want_y):
                fail(what + ": y_cols", _show(want_y) + " = x @ w_cols", _show(y_cols),
                     "this rank's columns of y need no communication: y_cols = x @ w_cols")
            _check_dw(what, dw_cols, want_dw, "dw_cols = x.T @ dy_cols")
            if not _close(dx, ref["dx"]):
                if _close(dx, dx_partial):
                    fail(what + ": dx", "the whole dx = Σ_i dy_i w_iᵀ", "this rank's dy_cols @ w_cols.T only",
                         "missing all-reduce: every output column depends on every input, so each rank holds a "
                         "partial sum of dx; comm.all_reduce(dx) adds them")
                if _close(dx, ref["dx"] / n):
                    fail(what + ": dx", "the sum over ranks", "the mean", "divided by world_size: dx is a sum")
                fail(what + ": dx", _show(ref["dx"]), _show(dx), "dx = all-reduce of dy_cols @ w_cols.T")
            if "all_reduce" not in ops or ops["all_reduce"][0] != 1 or len(ops) != 1:
                fail(what + ": communication", "one all-reduce (of dx)", ops, "the column split communicates "
                     "once: the all-reduce of dx in the backward")
    print(f"column split: y columns, dx and dw columns equal one device on {' and '.join(map(str, world_sizes))} "
          f"ranks; gathered dw = single-device dw (max |Δ| ≤ {TOL:g})")


def _check_dw(what, dw, want, formula):
    if isinstance(dw, torch.Tensor) and dw.shape == want.T.shape and dw.shape != want.shape:
        fail(what + ": dw piece", f"shape {tuple(want.shape)} (the shape of this rank's w piece)",
             f"shape {tuple(dw.shape)}", f"transposed shard: {formula}, a gradient has its parameter's shape")
    if not _close(dw, want):
        fail(what + ": dw piece", _show(want), _show(dw), f"{formula}; this rank's piece needs no communication")


def _run_row(rank, n, fn, x, w, dy):
    x_cols, w_rows = shard(x, 1, rank, n), shard(w, 0, rank, n)
    with comm.recording() as log:
        out = fn(x_cols, w_rows, dy.clone())
    return out, log.by_op(), x_cols @ w_rows


def check_row_parallel(row_parallel, world_sizes=(2, 4)) -> None:
    """``row_parallel(x_cols, w_rows, dy)`` -> ``(y, dx_cols, dw_rows)``: the whole y, this rank's columns of
    dx and rows of dw. w's 5 rows do not divide evenly (3+2 on 2 ranks, 2+1+1+1 on 4)."""
    (x, w, dy), ref = matmul_problem()
    for n in world_sizes:
        results = run_on_ranks(_run_row, n, row_parallel, x, w, dy, what="row_parallel")
        for r, (out, ops, y_partial) in enumerate(results):
            what = f"row split on {n} ranks, rank {r}"
            y, dx_cols, dw_rows = _unpack(out, what + ": the return value")
            if not _close(y, ref["y"]):
                if _close(y, y_partial):
                    fail(what + ": y", "the whole y = Σ_i x_i w_i", "x_cols @ w_rows of this rank only",
                         "missing all-reduce: each rank's product is a partial sum of y")
                if _close(y, ref["y"] / n):
                    fail(what + ": y", "the sum over ranks", "the mean", "divided by world_size: y is a sum")
                fail(what + ": y", _show(ref["y"]), _show(y), "y = all-reduce of x_cols @ w_rows")
            _check_dw(what, dw_rows, shard(ref["dw"], 0, r, n), "dw_rows = x_cols.T @ dy")
            want_dx = shard(ref["dx"], 1, r, n)
            if not _close(dx_cols, want_dx):
                fail(what + ": dx_cols", _show(want_dx) + " = dy @ w_rows.T", _show(dx_cols),
                     "dy is whole on every rank, so this rank's columns of dx need no communication")
            if set(ops) != {"all_reduce"} or ops["all_reduce"][0] != 1:
                fail(what + ": communication", "one all-reduce (of y, in the forward)", ops,
                     "the row split's backward needs no communication (its input arrived as column shards)")
    print(f"row split (uneven: 5 rows of w): y, dx columns and dw rows equal one device on "
          f"{' and '.join(map(str, world_sizes))} ranks")
