"""Chapter 01's harness: every split equals one device and its ring sends carry exactly the formula's bytes on
every rank; ``agrees`` refuses a wrong byte count or a difference above the tolerance."""
import dataclasses

import torch

from minipar.course.ch01_splitting_one_matmul.measure import compare_and_measure, format_table, format_w_held


def test_compare_and_measure_on_two_ranks():
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(4, 5, generator=g), torch.randn(5, 8, generator=g), torch.randn(4, 8, generator=g)
    per_rank, table = compare_and_measure(2, x, w, dy, {"y": x @ w, "dx": dy @ w.T, "dw": x.T @ dy})
    assert len(per_rank) == 2 and list(table) == ["data", "column", "row", "row_whole_x"]
    assert all(m.agrees(1e-5) for m in table.values())
    # the row split fed a whole x: all-reduce of y forward, all-gather of dx backward, its uneven column
    # pieces (3 + 2 of 5) padded to 3 columns: 1 · 4·3·4 = 48 B, not the unpadded 1/2 · 80 = 40 B
    whole_x = table["row_whole_x"]
    assert (whole_x.forward, whole_x.backward, whole_x.backward_formula) == ([128] * 2, [48] * 2, 48)
    assert whole_x.max_abs_diff <= 1e-5 and whole_x.ops["backward"]["send"][0] == 1
    assert all(torch.equal(r["row_whole_x"]["dx"], r["row_whole_x"]["dx_piece"]) for r in per_rank)   # whole dx
    assert (table["data"].backward, table["column"].backward, table["row"].forward) == ([160] * 2, [80] * 2, [128] * 2)
    assert table["row"].ops["forward"] and not table["row"].ops["backward"]
    # the bytes are the ring's sends, which the log counts as sent (gloo's all_reduce it could only price)
    assert set(table["data"].ops["backward"]) == {"send", "recv"} and table["data"].ops["backward"]["send"][0] == 2
    # what each rank holds after the forward: w whole under data parallelism, cut in two by the column and
    # row splits (the row split's 5 rows as 3 + 2); y cut by data and column, whole (all-reduced) under row
    assert [h["w"] for h in table["data"].holds] == [160, 160] and [h["w"] for h in table["column"].holds] == [80, 80]
    assert [h["w"] for h in table["row"].holds] == [96, 64] and [h["y"] for h in table["row"].holds] == [128, 128]
    assert [(h["x"], h["y"]) for h in table["column"].holds] == [(80, 64)] * 2
    assert not dataclasses.replace(table["data"], backward=[160, 161]).agrees(1e-5)
    assert not dataclasses.replace(table["data"], max_abs_diff=1e-3).agrees(1e-5)
    text = format_table(table, x.shape, w.shape)
    assert text.splitlines()[0].startswith("2 ranks, x (4, 5) · w (5, 8)") and "column" in text
    assert "bytes sent per rank" in text.splitlines()[0] and "(B)" not in text   # B is the batch, not bytes
    held = format_w_held(table, 160).splitlines()
    assert held[1].split() == ["data", "160,", "160"] and held[3].split() == ["row", "96,", "64"]


def test_column_then_row_sends_one_all_reduce_each_way():
    """Megatron's pair on 2 ranks equals one device and sends one all-reduce forward (z), one backward (dx);
    the claim refuses a run that sent an extra message or got a wrong piece."""
    import pytest

    from minipar.course.ch01_splitting_one_matmul.claims import check_column_then_row
    from minipar.course.ch01_splitting_one_matmul.measure import column_then_row
    g = torch.Generator().manual_seed(0)
    x, w1, w2, dz = (torch.randn(*s, generator=g) for s in ((4, 5), (5, 8), (8, 5), (4, 5)))
    run = column_then_row(2, x, w1, w2, dz)
    check_column_then_row(run, 2)
    assert [r["sent"] for r in run["per_rank"]] == [{"forward": 80.0, "backward": 80.0}] * 2   # 2·1/2·80 B each
    run["per_rank"][1]["sends"]["backward"] += 1
    with pytest.raises(AssertionError):
        check_column_then_row(run, 2)
    run["per_rank"][1]["sends"]["backward"] -= 1
    run["per_rank"][0]["dw2"] = run["per_rank"][0]["dw2"] + 1e-3
    with pytest.raises(AssertionError):
        check_column_then_row(run, 2)
