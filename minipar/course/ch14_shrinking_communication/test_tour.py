"""Chapter 14's tour rows: PowerSGD and DiLoCo equal their own update rules (float64) and send the formula's
bytes per step; PowerSGD's wire bytes are within gloo's framing of the log's (3 all-reduces a step)."""
import pytest

from minipar.course import tour
from minipar.course.ch14_shrinking_communication import tour as ch14
from minipar import wire


@pytest.fixture(scope="module")
def rows():
    return {name: run() for name, run in ch14.STRATEGIES}


def test_compression_rows_follow_their_rules_with_their_formulas_bytes(rows):
    assert set(rows) == {"PowerSGD r=2", "DiLoCo H=2"}
    for name, row in rows.items():
        assert row.matches and row.kind == "update rule", (name, row)
        assert row.bytes_sent_per_rank == pytest.approx(row.bytes_formula, rel=1e-9), name
    if wire.available():
        assert tour.observed_status(rows["PowerSGD r=2"]) == "within"
