"""Chapter 04 tour rows: GPipe, 1F1B and interleaved on 4 ranks equal one device (float64 harness tolerance), the bytes
in the communication log equal 2(p·v-1)·m·A/p exactly (bookkeeping), the bytes observed on the sockets
(minipar.wire, one step = 2-step run minus 1-step run) are that plus gloo's framing (tour.OVERHEAD_PER_CALL
per call at most), and the measured peaks order as the chapter says."""
import pytest

from minipar.course.ch04_pipeline_parallelism import tour as ch04
from minipar.course.pipeline_views import assert_rows_match


@pytest.fixture(scope="module")
def rows(tour_row):
    return {name: tour_row(name) for name, _ in ch04.STRATEGIES if "PipeDream" not in name}   # tests/test_pipedream


def test_every_schedule_row_matches_and_its_bytes_equal_the_formula(rows):
    assert set(rows) == {"pipeline GPipe", "pipeline GPipe + recompute", "pipeline 1F1B",
                         "pipeline interleaved 1F1B"}
    assert_rows_match(rows)


def test_measured_peaks_order_as_the_chapter_says(rows):
    gpipe, ofob = rows["pipeline GPipe"].peak_bytes_per_rank, rows["pipeline 1F1B"].peak_bytes_per_rank
    assert ofob < gpipe and rows["pipeline GPipe + recompute"].peak_bytes_per_rank < 0.5 * gpipe
    # interleaving: (p·v - 1)/(p - 1) = 7/3 times the traffic of 1F1B
    assert rows["pipeline interleaved 1F1B"].bytes_sent_per_rank * 3 == rows["pipeline 1F1B"].bytes_sent_per_rank * 7
