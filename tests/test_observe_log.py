"""minipar.observe.log and minipar.observe.wire without processes: comm's one observer list, the log's message
count, and the one kept-open reader of /proc/self/io."""
import os

import pytest

from minipar import comm
from minipar.observe import wire
from minipar.observe.log import RECORDER, CommLog, CommRecord, recording


def _record(op, n, sent=1):
    return CommRecord(op, n, 64, sent, 0, 0.0, "ring")


def test_comm_names_the_log_and_owns_one_observer_list():
    assert comm.recording is recording and comm.CommLog is CommLog and comm.CommRecord is CommRecord
    assert comm.observers[0] is RECORDER and not RECORDER.watching
    with recording() as outer, recording() as inner:
        assert RECORDER.watching and RECORDER.logs == [outer, inner]
    assert not RECORDER.watching
    assert not hasattr(comm, "_last_observed") and not hasattr(comm, "_wchar")    # no per-call state in comm


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
    assert list(wire._readers) == [os.getpid()]                  # opened once for this process
    assert wire.counters()["wchar"] >= before + 1000
