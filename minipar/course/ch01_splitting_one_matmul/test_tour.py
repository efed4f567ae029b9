"""Chapter 01 tour rows: each matmul split trains like one device (minipar.check, float32 defaults:
atol 2e-5, rtol 1e-4) and the bytes in the communication log equal the formula exactly."""
from minipar.course.ch01_splitting_one_matmul import tour as ch01


def test_matmul_split_rows_match_and_bytes_equal_formula():
    rows = [run() for _, run in ch01.STRATEGIES]
    assert [r.note for r in rows] == ["all-reduce dw", "all-reduce dx", "all-reduce y"]
    for r in rows:
        assert r.matches and r.world_size == 4, r
        assert r.bytes_sent_per_rank == r.bytes_formula > 0, r
    # 8x8 · 8x16 on 4 ranks: dw and y are 128 floats, dx 64: all-reduce sends 2·3/4 of them
    assert [r.bytes_formula for r in rows] == [768, 384, 768]
