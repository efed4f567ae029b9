"""Chapter 01 tour rows: each matmul split trains like one device (minipar.check, float32 defaults:
atol 2e-5, rtol 1e-4); the bytes in the communication log equal the formula exactly (the bookkeeping) and
the bytes observed on the sockets are the formula plus gloo's framing (at most tour.OVERHEAD_PER_CALL per
call: these payloads are ≤ 512 B, so the framing is most of the traffic)."""
from minipar import wire
from minipar.course import tour
from minipar.course.ch01_splitting_one_matmul import tour as ch01


def test_matmul_split_rows_match_and_bytes_equal_formula():
    rows = [run() for _, run in ch01.STRATEGIES]
    assert [r.note.split(";")[0] for r in rows] == ["all-reduce dw", "all-reduce dx", "all-reduce y"]
    for r in rows:
        assert r.matches and r.world_size == 4 and r.kind == "training", r
        assert r.bytes_sent_per_rank == r.bytes_formula > 0, r
        assert r.calls_per_rank == 1, r                       # one all-reduce per forward+backward
        if wire.available():
            assert r.bytes_formula < r.bytes_observed_per_rank <= r.bytes_formula + tour.OVERHEAD_PER_CALL, r
            assert tour.observed_status(r) == "within", r
    # 8x8 · 8x16 on 4 ranks: dw and y are 128 floats, dx 64: all-reduce sends 2·3/4 of them
    assert [r.bytes_formula for r in rows] == [768, 384, 768]
