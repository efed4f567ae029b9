"""Chapter 09b's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.mesh import Mesh


def check_five_dimensions_one_mesh_dp(g16, g32) -> None:
    """Five dimensions on one mesh: dp × pp × cp × tp, with ep folded in"""
    assert g16["ep"][:2] == [[0, 1], [2, 3]] and g16["ep"][0] == Mesh(16, dp=2, pp=2, cp=2, tp=2).group_ranks("tp", 0)
    assert g32["ep"][0] == [0, 1, 2, 3] and g32["expert_dp"][0] == [0, 8, 16, 24]


def check_bad_layouts_refused(refusals) -> None:
    """Five dimensions on one mesh: dp × pp × cp × tp, with ep folded in"""
    assert len(refusals) == 2 and "multiply to the world size" in refusals[0] and "ep=3 must divide dp·cp·tp = 8" in refusals[1]


def check_slow_link_shows_no_rank_busy(busiest, table) -> None:
    """One 5D step, traced: the slow link shows; no rank is busy all the time"""
    assert busiest["exposed"] > 0 and all(r["idle"] > 0 for r in table)


def check_one_5d_step_traced(here_share, model_share) -> None:
    """One 5D step, traced"""
    assert 0 < here_share < 1 and 0 < model_share < 1


def check_why_does_my_loss_differ(mm, red, dtype) -> None:
    """Why does my loss differ across layouts?"""
    assert (mm < 1e-12 and red < 1e-13) if dtype == torch.float64 else (1e-8 < mm < 1e-4 and 1e-9 < red < 1e-5)
