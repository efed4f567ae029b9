"""Chapter 01 in the tour: one matmul x (8×8) · w (8×16) split by data, by columns of w, by rows of w.

Each row trains the one-layer model ``y = x @ w`` (MSE, SGD, 3 steps) with the split's hand-written forward
and backward (:mod:`minipar.tensor.matmul_split`) and compares loss and w with one device
(:func:`minipar.check.check_equivalence`, float32 default tolerances). Bytes: what one rank sends in one
forward and backward of the matmul (mean over ranks, from the communication log), next to the formula
(one all-reduce: of dw for data, of dx for column, of y for row: 2(N-1)/N · S).
"""
from __future__ import annotations

import functools

import torch

from minipar.check import check_equivalence
from minipar.tensor import matmul_split as ms
from minipar.course.tour import WORLD_SIZE, TourRow

B, K, M = 8, 8, 16
WHAT = {"data": "all-reduce dw", "column": "all-reduce dx", "row": "all-reduce y"}


def _run(split: str) -> TourRow:
    comparison = check_equivalence(ms.parallel_train, WORLD_SIZE, ms.matmul_recipe(B, K, M), split=split,
                                   launch_kwargs={"quiet": True})
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((B, K), (K, M), (B, M)))
    per_rank = ms.run(x, w, dy, world_size=WORLD_SIZE, splits=(split,))
    sent = [r[split]["bytes"]["forward"] + r[split]["bytes"]["backward"] for r in per_rank]
    formula = sum(ms.predicted_bytes(split, x.shape, w.shape, WORLD_SIZE).values())
    return TourRow(strategy=f"matmul {split} split ({B}x{K}·{K}x{M})", world_size=WORLD_SIZE,
                   matches=comparison.matches, max_abs_diff=comparison.max_abs_diff,
                   bytes_sent_per_rank=sum(sent) / len(sent), bytes_formula=formula, peak_bytes_per_rank=None,
                   note=WHAT[split])


STRATEGIES = [(f"matmul {s} split", functools.partial(_run, s)) for s in ms.SPLITS]
