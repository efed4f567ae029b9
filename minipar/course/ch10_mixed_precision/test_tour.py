"""Chapter 10 tour rows: mixed precision under DDP (FP16 wire) and ZeRO-2 (BF16) equals one device's mixed
precision (1e-3 / 5e-3, SGD); bytes observed on the sockets: DDP's FP16 all-reduce = the formula + headers
(+ the overflow flag's all-reduce), ZeRO-2's ~1.5x (gloo's reduce-scatter all-reduces, said in the note);
the peak of one step per rank measured."""
import pytest

from minipar import wire
from minipar.course import tour
from minipar.course.ch10_mixed_precision import tour as ch10


@pytest.fixture(scope="module")
def rows():
    return {name: run() for name, run in ch10.STRATEGIES}


def test_rows_match_and_bytes_are_observed(rows):
    ddp, zero2 = rows["DDP + FP16 mixed precision (FP16 wire)"], rows["ZeRO-2 + BF16 (FP32 master shards)"]
    for row in (ddp, zero2):
        assert row.matches and row.peak_bytes_per_rank > 0, row
    if wire.available():
        assert tour.observed_status(ddp) == "within", ddp
        assert 1.45 < zero2.bytes_observed_per_rank / zero2.bytes_formula < 1.65, zero2
        assert "all-reduces the whole buffer" in zero2.note
