"""Chapter 04b tour rows: ZB-H1, ZB-V and DualPipeV on 4 ranks equal one device (float64 harness tolerance), the
bytes in the communication log equal 2·c·m·A/p exactly (bookkeeping), the bytes observed on the sockets
(minipar.wire, one step = 2-step run minus 1-step run) are that plus gloo's framing
(tour.OVERHEAD_PER_CALL per call at most), and the V sends twice what 1F1B's placement implies."""
import pytest

from minipar.course import tour
from minipar.course.ch04b_zero_bubble_and_v_schedules import tour as ch04b
from minipar.course.pipeline_views import M, assert_rows_match, bytes_formula
from minipar.pipeline.schedules import make_schedule


@pytest.fixture(scope="module")
def rows(tour_row):
    return {name: tour_row(name) for name, _ in ch04b.STRATEGIES}


def test_every_schedule_row_matches_and_its_bytes_equal_the_formula(rows):
    assert set(rows) == {"pipeline zero bubble ZB-H1", "pipeline ZB-V", "pipeline DualPipeV"}
    assert_rows_match(rows)


def test_the_v_sends_twice_what_1f1b_sends(rows):
    one_f_one_b = bytes_formula(make_schedule("1f1b", tour.WORLD_SIZE, M))      # chapter 04's row measures it
    assert rows["pipeline zero bubble ZB-H1"].bytes_sent_per_rank == one_f_one_b
    for name in ("pipeline ZB-V", "pipeline DualPipeV"):   # 2p-2 = 6 crossings, twice 1F1B's p-1 = 3
        assert rows[name].bytes_sent_per_rank == 2 * one_f_one_b
