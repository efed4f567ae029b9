"""Chapter 07's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch

from minipar.course.ch07_multidimensional_tensor_parallelism import figures as fig07
from minipar.tensor import tp2d


def check_grids(g25) -> None:
    """The grids"""
    assert g25.groups("k") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def check_3d_every_weight_element_on_one_rank(held) -> None:
    """The grids: 3D: every weight element on one rank"""
    assert all(len(who) == 1 for row in held["A = Wᵀ"] for who in row)          # 3D: every weight element on one rank
    assert all(len(who) == 2 for row in dict(fig07.owners("2.5d"))["A = Wᵀ"] for who in row)   # 2.5D: on d = 2


def check_after_q_steps_block(steps, x, a, i, j) -> None:
    """SUMMA, step by step: after q steps: the block of X A"""
    assert torch.allclose(steps[-1]["acc"], tp2d.block(x @ a, i, j, 2))     # after q steps: the block of X A
    assert [s["x_from"] for s in steps] == [2 * i, 2 * i + 1]                  # X_ik from rank (i, k)


def check_backward_2d_layer_layernorm_bias(diffs) -> None:
    """Backward, the 2D layer, LayerNorm and bias on the grid"""
    assert max(diffs.values()) < 1e-12


def check_ring_rs_2_ranks_1_send(dy, da, ops) -> None:
    """3D: the cube's three collectives: the ring RS on 2 ranks: 1 send"""
    assert dy < 1e-12 and da < 1e-12 and ops == ["all_gather", "all_gather", "send"]


def check_tesseract_weight_gradient_needs_sum(with_sum, without) -> None:
    """2.5D: Tesseract, and the weight gradient summed over depth"""
    assert max(with_sum) < 1e-12 and min(without) > 1e-3


def check_measured_per_rank_memory_held(c, per_rank) -> None:
    """Measured per rank: memory held, bytes sent, messages"""
    assert all(r["bytes_model"] == c["bytes"] and r["messages"] == c["messages"] for r in per_rank)
    assert all(r["bytes_model"] < r["bytes_observed"] <= r["bytes_model"] + 300 * r["messages"] for r in per_rank)


def check_2d_same_weights_fewer_bytes_than_1d(one, two, one8, cube, tess) -> None:
    """Measured per rank: memory held, bytes sent, messages: 2D: same weights as 1D, fewer activations"""
    assert one[2] == two[2] and two[3] < one[3]                  # 2D: same weights as 1D, fewer activations
    assert one8[4] < cube[4] < tess[4]                           # 总结's "3D: least communication" fails here
    assert tess[3] < cube[3] and tess[2] == 2 * cube[2]          # 2.5D: least activation, 2× 3D's weights (replicas)


def check_range_table_8_quotes(same_p) -> None:
    """Measured per rank: memory held, bytes sent, messages: the range the table in §8 quotes"""
    assert all(1.3 < r < 1.45 for r in same_p.values())


def check_small_batch_p_8_1d(t256, t16k, c1, c3) -> None:
    """*总结*'s table, checked with an α-β link model (P = 8 … 512): small batch, P=8: 1D"""
    assert dict((p, t) for p, t, _ in t256["1d"])[8] < dict((p, t) for p, t, _ in t256["3d"])[8]      # small batch, P=8: 1D
    assert min((t, l) for l, rows in t16k.items() for p, t, _ in rows if p == 512)[1] == "3d"          # large P: 3D
    assert c1["bytes"] < c3["bytes"] and c1["messages"] > 10 * c3["messages"]   # 1D loses on latency, not on bytes


def check_below_2d_where_both_exist(thresholds, mlp7, big16k, big2k, big256) -> None:
    """*总结*'s table, checked with an α-β link model (P = 8 … 512): below 2D where both exist"""
    assert all(r["vs_2d"][0] == 64 and r["vs_2d"][1] < 1 for r in thresholds)          # below 2D where both exist
    assert round(mlp7["3d_over_1d_at_8"], 2) == 1.29 and mlp7["vs_1d"][0] == 27
    assert [r["vs_1d"][0] for r in (big16k, big2k, big256)] == [27, 125, 1728]
