"""minipar.comm_log and minipar.wire without processes: the log and the wire counter as scoped hooks, the
log's message count, and the wire counter's kept-open reader of /proc/self/io."""

import pytest

from minipar import comm, hooks, wire
from minipar.comm_log import CommLog, CommRecord, recording


def _record(op, n, sent=1):
    return CommRecord(op, n, 64, sent, 0, 0.0, "ring")


def test_comm_names_the_log_which_is_a_scoped_hook():
    assert comm.recording is recording and comm.CommLog is CommLog and comm.CommRecord is CommRecord
    assert hooks.active() == ()
    with recording() as outer, recording() as inner:
        logs = [h.log for h in hooks.active() if hasattr(h, "log")]
        assert logs == [outer, inner]                            # outermost first
        assert sum(isinstance(h, wire.CallCounter) for h in hooks.active()) == 2
    assert hooks.active() == ()
    assert not hasattr(comm, "observers") and not hasattr(comm, "checks")     # no process-wide lists in comm


def test_messages_are_counted_under_each_records_algorithm():
    """Ring all-reduce 2(N-1), all-gather / reduce-scatter / all-to-all N-1, a broadcast's root N-1 (others 0),
    a send 1, a receive 0 — what minipar.sequence.measure and minipar.tensor.multidim_measure report."""
    log = CommLog([_record("all_reduce", 4), _record("all_gather", 4), _record("reduce_scatter", 2),
                   _record("all_to_all", 4), _record("broadcast", 4), _record("broadcast", 4, sent=0),
                   _record("send", 2), _record("recv", 2), _record("reduce", 4)])
    assert log.messages() == 6 + 3 + 1 + 3 + 3 + 0 + 1 + 0 + 0
    assert CommLog().messages() == 0


@pytest.mark.skipif(not wire.available(), reason="no /proc/self/io")
def test_wire_written_reads_one_kept_open_file(tmp_path):
    before = wire.written()
    with open(tmp_path / "x", "wb", buffering=0) as f:
        f.write(b"x" * 1000)
    assert wire.written() - before >= 1000
    assert wire.counters()["wchar"] >= before + 1000
    with wire.counting_calls() as counter:                       # a kept-open reader, while it counts
        reader = counter.reader
        assert counter.written() >= before + 1000 and counter.written() - counter.written() <= 0
    assert reader.closed and not hasattr(wire, "_readers")
