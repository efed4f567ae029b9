"""Chapter 01's claims, held against the numbers its cells compute.

Each function takes what one cell computed, raises AssertionError naming the claim when one does not hold
and prints nothing when all hold."""
from __future__ import annotations

import torch


def check_autograd_formulas(reference, dy, w, x) -> None:
    """The logical matmul, on one device: autograd = the formulas"""
    assert torch.allclose(reference["dx"], dy @ w.T) and torch.allclose(reference["dw"], x.T @ dy)


def check_run_live_2_ranks_equal(table_2) -> None:
    """Run live on 2 ranks: equal to one device, and the bytes"""
    assert all(m.agrees(1e-5) for m in table_2.values()) and (table_2["data"].backward[0], table_2["column"].backward[0], table_2["row"].forward[0]) == (160, 80, 128)
    assert (table_2["row_whole_x"].forward[0], table_2["row_whole_x"].backward[0]) == (128, 48)   # dx: 3 of 5 columns
    check_w_held_once(table_2, 5 * 8 * 4)
    assert [h["w"] for h in table_2["column"].holds] == [80, 80] and [h["w"] for h in table_2["row"].holds] == [96, 64]


def check_w_held_once(table, w_bytes) -> None:
    """Each replica of data parallelism holds all of w; the column and row splits hold it once over all ranks"""
    assert all(h["w"] == w_bytes for h in table["data"].holds)
    assert all(sum(h["w"] for h in table[s].holds) == w_bytes for s in ("column", "row", "row_whole_x"))


def check_run_live_4_ranks_uneven(table_4, sent, padded) -> None:
    """Run live on 4 ranks: uneven splits; the row split fed a whole x all-gathers dx in its backward, every
    piece padded to the largest (3 × 4×2 floats = 96 B per rank, not 3/4 of dx's 80 B)"""
    assert all(m.agrees(1e-5) for m in table_4.values()) and (table_4["data"].backward[0], table_4["column"].backward[0], table_4["row"].forward[0]) == (240, 120, 192)
    assert sent == [padded] * 4 == [96] * 4 and table_4["row_whole_x"].forward == table_4["row"].forward
    check_w_held_once(table_4, 5 * 8 * 4)


def check_unpadded_rank0(rank0, mean) -> None:
    """The row split fed a whole x: unpadded, the ring all-gather's ranks send unequal bytes (pieces 2, 1, 1, 1
    columns of 4 rows): rank 0 forwards pieces 0, 3, 2, 64 B; rank 3 forwards 3, 2, 1, 48 B; the mean is 60 B."""
    assert (rank0, mean) == (64, 60)


def check_column_split_trades_dw_for_dx(table_b, bwd, K, M) -> None:
    """Does splitting w save communication: x 64×5 on 4 ranks, each split equals one device, and the column
    split's all-reduce of dx sends more than data parallelism's of dw"""
    assert all(m.agrees(1e-4) for m in table_b.values()) and bwd["column"] == 2 * 3 / 4 * 64 * K * 4 > bwd["data"] == 2 * 3 / 4 * K * M * 4


def check_whole_y_is_an_all_gather(gathered_y, formula) -> None:
    """The whole y on every rank after a column split is an all-gather of (N−1)/N·|y| per rank"""
    assert gathered_y == formula, (gathered_y, formula)


def check_column_then_row(run, world_size) -> None:
    """Column then row (Megatron's pair): z, dx and every rank's dw1, dw2 pieces equal one device; the forward
    sends exactly one ring all-reduce of z and the backward one of dx: 2(N−1) sends of 2(N−1)/N·S bytes each"""
    ref, n = run["reference"], world_size
    z_bytes, dx_bytes = (ref[k].numel() * 4 for k in ("z", "dx"))
    for rank, r in enumerate(run["per_rank"]):
        assert torch.allclose(r["z"], ref["z"], atol=1e-5) and torch.allclose(r["dx"], ref["dx"], atol=1e-5), rank
        assert torch.allclose(r["dw1"], torch.tensor_split(ref["dw1"], n, dim=1)[rank], atol=1e-5), rank
        assert torch.allclose(r["dw2"], torch.tensor_split(ref["dw2"], n, dim=0)[rank], atol=1e-5), rank
        assert r["sends"] == {"forward": 2 * (n - 1), "backward": 2 * (n - 1)}, (rank, r["sends"])
        assert r["sent"] == {"forward": 2 * (n - 1) / n * z_bytes, "backward": 2 * (n - 1) / n * dx_bytes}, r["sent"]


def check_real_size_column_sends_4x(real) -> None:
    """Does model parallelism save communication, at a real size: dx (B·K) and y (B·M) are B/M = 4 times dw
    (K·M), so the column split's backward and the row split's forward each send 4 times data parallelism's"""
    dw_bytes = 2 * 3 / 4 * 4096 * 4096 * 4
    assert real["data"] == {"forward": 0, "backward": dw_bytes}, real
    assert real["column"] == {"forward": 0, "backward": 4 * dw_bytes}, real
    assert real["row"] == {"forward": 4 * dw_bytes, "backward": 0}, real


def check_real_size_state_per_rank(state) -> None:
    """At a real size, what a split saves in memory: data parallelism keeps the 4096×4096 weight's training
    state (16 B/param) on every rank, 256 MiB; a column or row split over 4 ranks keeps a quarter, 64 MiB"""
    assert state["data"] == 4096 * 4096 * 16 == 256 * 2 ** 20, state
    assert state["column"] == state["row"] == state["data"] // 4, state
