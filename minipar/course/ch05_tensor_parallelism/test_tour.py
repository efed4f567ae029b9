"""Chapter 05/06 tour rows: TP, TP+SP and TP+SP with the gathered inputs kept (reduce-scatters on minipar's
ring) equal one device (float64
harness tolerance); bytes per layer in the log = the formula (48, 48 + 12, 48 KiB at t=4) and observed on
the sockets (gloo's headers; SP's reduce-scatters 2x on gloo, said in the note); the peak of a whole-model
step per rank is measured and below one device's."""
import pytest

from minipar import wire
from minipar.course.ch05_tensor_parallelism import tour as ch05


@pytest.fixture(scope="module")
def rows(tour_row):
    return {name: tour_row(name) for name, _ in ch05.STRATEGIES}


def test_rows_match_bytes_and_memory(rows):
    tp, sp = rows["tensor parallel"], rows["tensor parallel + sequence parallel"]
    kept = rows["tensor parallel + sequence parallel, inputs kept, ring RS"]
    for row in (tp, sp, kept):
        assert row.matches and row.bytes_sent_per_rank == row.bytes_formula, row
        assert row.peak_bytes_per_rank is not None and "vs one device" in row.note
    assert tp.bytes_sent_per_rank == kept.bytes_sent_per_rank == 48 * 1024
    assert sp.bytes_sent_per_rank == 60 * 1024 and "re-gathers" in sp.note
    one_device = int(tp.note.rsplit("vs one device ", 1)[1].split()[0])
    assert tp.peak_bytes_per_rank < one_device and sp.peak_bytes_per_rank < tp.peak_bytes_per_rank
    if wire.available():
        assert tp.bytes_formula <= tp.bytes_observed_per_rank <= tp.bytes_formula + 4 * 2048
        # SP with the inputs kept and its reduce-scatters on the ring: TP's bytes on the wire too, up to the
        # headers (TP: 4 gloo all-reduces, ~1.7 KiB each; SP: 4 all-gathers + 12 ring messages, less)
        assert kept.bytes_formula <= kept.bytes_observed_per_rank <= tp.bytes_observed_per_rank
        assert abs(kept.bytes_observed_per_rank - tp.bytes_observed_per_rank) < 8 * 1024
        assert sp.bytes_observed_per_rank > 60 * 1024 + 12 * 1024 and "all-reduces" in sp.note


def test_collective_matmul_row_equals_one_device_with_sps_bytes(rows):
    row = rows["tensor parallel + SP, collective matmul"]
    assert row.matches and row.max_abs_diff < 1e-10
    assert row.bytes_sent_per_rank == row.bytes_formula == rows["tensor parallel + sequence parallel"].bytes_formula
