"""Chapter 10b's tour row: FP8 block-wise GEMMs under DDP on 4 ranks equal one device's FP8 (5e-3, SGD) and
train the tiny GPT to within the stated gap of one-device BF16; the BF16 gradient all-reduce's bytes are the formula's (log) and observed within
protocol overhead."""
import pytest

from minipar import wire
from minipar.course import tour
from minipar.course.ch10b_fp8 import tour as ch10b


@pytest.fixture(scope="module")
def row():
    return dict(ch10b.STRATEGIES)["FP8 (block-wise)"]()


def test_fp8_blockwise_row_is_within_the_stated_gap(row):
    assert row.matches, row
    assert f"within {ch10b.GAP:.2%}" in row.note and "gap " in row.note and row.max_abs_diff <= ch10b.TOL
    assert row.bytes_sent_per_rank == row.bytes_formula
    if wire.available():
        assert tour.observed_status(row) == "within", row
