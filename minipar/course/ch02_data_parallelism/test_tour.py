"""Chapter 02 tour rows: DP, the parameter server and DDP equal one device (float32 defaults of
minipar.check; bf16 wire 2e-2), and their bytes are observed on the sockets (minipar.wire): the parameter
server's row shows the server's own (N-1)·P, observed, and DDP's rows the ring formula + gloo's headers."""
import pytest

from minipar import wire
from minipar.course import tour
from minipar.course.ch02_data_parallelism import tour as ch02


@pytest.fixture(scope="module")
def rows():
    return {name: run() for name, run in ch02.STRATEGIES if name != "DP threads"}   # DP: tests/test_dp.py


def test_rows_match_and_observed_bytes_follow_the_formula(rows):
    for name, row in rows.items():
        assert row.matches and row.kind == "training", (name, row)
        if wire.available():
            assert tour.observed_status(row) == "within", (name, row.bytes_observed_per_rank, row.bytes_formula)
            assert row.bytes_observed_per_rank >= row.bytes_formula, name


def test_the_parameter_server_row_shows_the_servers_bytes(rows):
    server, ddp = rows["parameter server"], rows["DDP"]
    p = server.bytes_formula / 3
    assert server.bytes_sent_per_rank == server.bytes_formula == 3 * p      # (N-1)·P, the server alone
    assert ddp.bytes_formula == pytest.approx(1.5 * p)                      # 2(N-1)/N·P on every rank
    assert "each worker sends P" in server.note

