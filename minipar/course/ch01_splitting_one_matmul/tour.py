"""Chapter 01 in the tour: one matmul x (8×8) · w (8×16) split by data, by columns of w, by rows of w.

Each row trains the one-layer model ``y = x @ w`` (MSE, SGD, 3 steps) with the split's hand-written forward
and backward (:mod:`minipar.tensor.matmul_split`) and compares loss and w with one device
(:func:`minipar.check.check_equivalence`, float32 default tolerances). Bytes: what one rank sends in one
forward and backward of the matmul (mean over ranks), from the communication log (the model) and from the
sockets (:mod:`minipar.wire`, observed), next to the formula (one all-reduce: of dw for data, of dx for
column, of y for row: 2(N-1)/N · S). The payloads are tiny (≤ 512 B), so gloo's framing (~1.7 KiB per
4-rank all-reduce) is most of what the wire carries: the row states it.
"""
from __future__ import annotations

import functools

import torch

from minipar import comm
from minipar.check import check_equivalence
from minipar.launcher import launch
from minipar.tensor import matmul_split as ms
from minipar.course.tour import WORLD_SIZE, TourRow

B, K, M = 8, 8, 16
WHAT = {"data": "all-reduce dw", "column": "all-reduce dx", "row": "all-reduce y"}


def _forward_backward(rank, n, split, x, w, dy):
    """The split's forward and backward on this rank's pieces, as in ms.run_split, inside one log."""
    if split == "data":
        x_p, w_p, dy_p = ms.shard(x, 0, rank, n), w, ms.shard(dy, 0, rank, n)
    elif split == "column":
        x_p, w_p, dy_p = x, ms.shard(w, 1, rank, n), ms.shard(dy, 1, rank, n)
    else:
        x_p, w_p, dy_p = ms.shard(x, 1, rank, n), ms.shard(w, 0, rank, n), dy
    forward = {"data": ms.data_forward, "column": ms.column_forward, "row": ms.row_forward}[split]
    backward = {"data": ms.data_backward, "column": ms.column_backward, "row": ms.row_backward}[split]
    with comm.recording() as log:
        forward(x_p, w_p)
        backward(x_p, w_p, dy_p)
    return log.bytes_sent, log.observed_bytes_sent, log.count()


def _run(split: str) -> TourRow:
    comparison = check_equivalence(ms.parallel_train, WORLD_SIZE, ms.matmul_recipe(B, K, M), split=split,
                                   launch_kwargs={"quiet": True})
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((B, K), (K, M), (B, M)))
    ms.validate(split, tuple(x.shape), tuple(w.shape), world_size=WORLD_SIZE)
    per_rank = launch(_forward_backward, WORLD_SIZE, split, x, w, dy, quiet=True)
    mean = lambda i: sum(r[i] for r in per_rank) / len(per_rank)  # noqa: E731
    formula = sum(ms.predicted_bytes(split, x.shape, w.shape, WORLD_SIZE).values())
    observed = None if any(r[1] is None for r in per_rank) else mean(1)
    return TourRow(strategy=f"matmul {split} split ({B}x{K}·{K}x{M})", world_size=WORLD_SIZE,
                   matches=comparison.matches, max_abs_diff=comparison.max_abs_diff,
                   bytes_sent_per_rank=mean(0), bytes_formula=formula, peak_bytes_per_rank=None,
                   note=f"{WHAT[split]}; per forward+backward; observed = formula + gloo's framing "
                        f"(~1.7 KiB per 4-rank all-reduce, larger than these payloads)",
                   bytes_observed_per_rank=observed, calls_per_rank=mean(2))


STRATEGIES = [(f"matmul {s} split", functools.partial(_run, s)) for s in ms.SPLITS]
